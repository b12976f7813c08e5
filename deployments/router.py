"""`PrefixAwareRouter`: a Ray Serve RequestRouter that sends each request to the replica holding the
checkpoint covering the longest prefix of its prompt, weighed against load (`routing_policy.rank`).

Replicas publish, through `record_routing_stats()`, their queue length and a digest (chained block hashes
of the prefixes they hold checkpoints for) every `request_routing_stats_period_s`. The router also remembers
for `remember_s` seconds which block chains it sent where, so requests sharing a new prefix stick to one
replica until that replica's digest shows the prefix (a digest taken while the first request was still in
flight would not).

Knobs (deployment `request_router_kwargs`): block_size, min_match_tokens, max_queue_gap, max_ratio,
share_window — see `RouterKnobs` — and remember_s.
"""

from __future__ import annotations

import time
from collections import deque

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.routing_policy import Candidate, RouterKnobs, rank


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, remember_s: float = 30.0, **knobs) -> None:
        self.knobs = RouterKnobs(**knobs)
        self.remember_s = remember_s
        self._recent: deque[str] = deque(maxlen=self.knobs.share_window)
        self._routed: dict[str, dict[int, float]] = {}  # replica -> block hash -> when it was sent there
        self._digests: dict[str, tuple[object, frozenset[int]]] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        chain = _chain(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        candidates = [self._candidate(r) for r in candidate_replicas]
        return [[by_id[i] for i in tier] for tier in rank(candidates, chain, self.knobs)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        rid = replica_id.unique_id
        self._recent.append(rid)
        now = time.monotonic()
        self._routed.setdefault(rid, {}).update((h, now) for h in _chain(pending_request))

    def _candidate(self, replica: RunningReplica) -> Candidate:
        rid = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        version = stats.get("version")
        cached = self._digests.get(rid)
        if cached is None or cached[0] != version:
            cached = (version, frozenset(stats.get("digest", ())))
            self._digests[rid] = cached
        queue = self._replica_queue_len_cache.get(replica.replica_id)
        queue = stats.get("queue", 0) if queue is None else queue
        horizon = time.monotonic() - self.remember_s
        routed = self._routed.get(rid, {})
        for h in [h for h, t in routed.items() if t < horizon]:
            del routed[h]
        known = cached[1] | frozenset(routed) if routed else cached[1]
        return Candidate(rid, int(queue), known, sum(1 for r in self._recent if r == rid))


def _chain(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None or not pending_request.args:
        return []
    return list(getattr(pending_request.args[0], "hashes", []) or [])

"""`PrefixAwareRouter`: a Ray Serve RequestRouter that sends each request to the replica holding the
checkpoint covering the longest prefix of its prompt, weighed against load (`routing_policy.rank`).

Replicas publish, through `record_routing_stats()`, their queue length and a digest (chained block hashes
of the prefixes they hold checkpoints for) every `request_routing_stats_period_s`. The router also remembers
for `remember_s` seconds which block chains it sent where, so requests sharing a new prefix stick to one
replica until that replica's digest shows the prefix (a digest taken while the first request was still in
flight would not).

Knobs (deployment `request_router_kwargs`): block_size, min_match_tokens, max_queue_gap, max_ratio,
share_window — see `RouterKnobs` — and remember_s (see `RouterMemory`).

A retried request names the replica that failed it (`GenerateRequest.avoid`: its engine could not step); that
replica is left out unless it is the only one.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.routing_policy import Candidate, RouterKnobs, RouterMemory, rank


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, remember_s: float = 30.0, **knobs) -> None:
        self.knobs = RouterKnobs(**knobs)
        self.memory = RouterMemory(remember_s, self.knobs.share_window)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        chain = _chain(pending_request)
        avoid = getattr(pending_request.args[0], "avoid", None) if pending_request and pending_request.args else None
        candidate_replicas = [r for r in candidate_replicas if r.replica_id.unique_id != avoid] or candidate_replicas
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        candidates = [self._candidate(r) for r in candidate_replicas]
        return [[by_id[i] for i in tier] for tier in rank(candidates, chain, self.knobs)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.memory.routed(replica_id.unique_id, _chain(pending_request))

    def _candidate(self, replica: RunningReplica) -> Candidate:
        return self.memory.candidate(replica.replica_id.unique_id, replica.routing_stats,
                                     self._replica_queue_len_cache.get(replica.replica_id))


def _chain(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None or not pending_request.args:
        return []
    return list(getattr(pending_request.args[0], "hashes", []) or [])

"""`PrefixAwareRouter`: a Ray Serve RequestRouter that sends each request to the replica where its predicted time
to first token is least (`routing_policy.rank`): the prefill queued there, plus the tokens the replica's
checkpoints leave this request to prefill, at the replica's measured step cost.

Replicas publish, through `record_routing_stats()`, their load, a digest (chained block hashes of the prefixes
they hold KV for) and their checkpoints' marks every `request_routing_stats_period_s`. The router also remembers
which block chains it sent where (`RouterMemory`), so requests sharing a new prefix stick to one replica until
that replica's digest shows the prefix, the checkpoints those requests will have it store, and the prefill it
sent since the last stats. A decision is remembered when it is made, not when Ray reports the request sent (a
burst of requests is routed before the first is sent); a request Ray sends elsewhere is remembered there too.

Knobs (deployment `request_router_kwargs`): block_size, affinity_credit, share_window (see `RouterKnobs`),
remember_s and settle_s (see `RouterMemory`).

Hints (`GenerateRequest.affinity`, `.resume`; app/api/hints.py): a prompt_cache_key credits the replicas that
served it lately (`RouterKnobs.key_credit`), and a Responses continuation counts the stored response's
checkpoint on the replica that served it (`routing_policy.claimed`), each weighed in the same cost model.

Peer fetches (issue 40; deployments/peer_fetch.py): where a replica that can fetch would resume sooner from a
peer's deeper checkpoint, pulled first, than from its own or at the holder behind its queue (`routing_policy.choose`),
the router notes it in `GenerateRequest.fetch` (for every candidate, so that a request Ray sends to its second
choice fetches there too). A call that names a replica (`route_to`: a replica's `ExportRequest`, a pinned
`GenerateRequest`, a `FetchStatusRequest`) goes to that replica.

A retried request names the replica that failed it (`GenerateRequest.avoid`: its engine could not step); that
replica is left out unless it is the only one.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.messages import GenerateRequest
from deployments.router_memory import RouterMemory
from deployments.routing_policy import Hint, RouterKnobs, choose, expected_marks, predict


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, remember_s: float = 30.0, settle_s: float = 2.0, **knobs) -> None:
        self.knobs = RouterKnobs(**knobs)
        self.memory = RouterMemory(remember_s, self.knobs.share_window, settle_s)
        self._decided: OrderedDict[str, str] = OrderedDict()  # request id -> replica id, until Ray sends it

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        req = pending_request.args[0] if pending_request is not None and pending_request.args else None
        target = getattr(req, "route_to", None)
        if target is not None:  # a peer's export, a pinned request, a status question: to the replica it names,
            # if still there (else to any, which answers that it is not the one named)
            named = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            return [named] if named else [candidate_replicas]
        chain, tokens = _request(pending_request, self.knobs.block_size)
        hint = self._hint(pending_request)
        avoid = getattr(pending_request.args[0], "avoid", None) if pending_request and pending_request.args else None
        candidate_replicas = [r for r in candidate_replicas if r.replica_id.unique_id != avoid] or candidate_replicas
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        candidates = {c.replica_id: c for c in map(self._candidate, candidate_replicas)}
        decision = choose(list(candidates.values()), chain, tokens, self.knobs, hint)
        ranks = decision.ranks
        if isinstance(req, GenerateRequest):  # which replica would pull a peer's checkpoint first, from which peer
            req.fetch = {rid: (p.fetch_from, p.fetch_bytes, p.checkpointed)
                         for rid, p in decision.predictions.items() if p.fetch_from} or None
        request_id = pending_request.metadata.request_id if pending_request is not None else None
        if ranks and request_id is not None and self._decided.get(request_id) != ranks[0][0]:
            self._remember(candidates[ranks[0][0]], chain, tokens, hint, confirmed=False, p=decision.prediction)
            self._decided[request_id] = ranks[0][0]
            while len(self._decided) > 4096:  # requests never sent (cancelled while routing)
                self._decided.popitem(last=False)
        return [[by_id[i] for i in tier] for tier in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        decided = self._decided.pop(pending_request.metadata.request_id, None)
        if decided is not None:
            self.memory.confirmed(decided)
        if decided != replica_id.unique_id:  # sent elsewhere (its first choice was full), or not routed by us
            chain, tokens = _request(pending_request, self.knobs.block_size)
            replica = self.curr_replicas.get(replica_id)
            stats = replica.routing_stats if replica is not None else None
            self._remember(self.memory.candidate(replica_id.unique_id, stats, None), chain, tokens,
                           self._hint(pending_request), confirmed=True)

    def _remember(self, c, chain: list[int], tokens, hint: Hint | None, confirmed: bool, p=None) -> None:
        p = p or predict(c, chain, tokens, self.knobs, hint)
        self.memory.routed(c.replica_id, chain, p.uncached, expected_marks(c, chain, tokens, p, self.knobs.block_size),
                           confirmed, hint.key if hint else None)

    def _hint(self, pending_request: PendingRequest | None) -> Hint | None:
        """The request's routing hint (`GenerateRequest.affinity` and `.resume`), if it carries one."""
        req = pending_request.args[0] if pending_request is not None and pending_request.args else None
        key, resume = getattr(req, "affinity", None), getattr(req, "resume", None)
        if key is None and resume is None:
            return None
        if resume is None:
            return Hint(key)
        replica, prompt, prefix, stored_at = resume
        return Hint(key, replica, prompt, prefix, fresh=time.time() - stored_at <= self.memory.remember_s)

    def _candidate(self, replica: RunningReplica):
        return self.memory.candidate(replica.replica_id.unique_id, replica.routing_stats,
                                     self._replica_queue_len_cache.get(replica.replica_id))


def _request(pending_request: PendingRequest | None, block: int) -> tuple[list[int], list[int] | int]:
    """The request's block hashes and its prompt ids (or, where they are not there, the hashed length)."""
    if pending_request is None or not pending_request.args:
        return [], 0
    req = pending_request.args[0]
    chain = list(getattr(req, "hashes", []) or [])
    ids = getattr(req, "prompt_ids", None)
    return chain, list(ids) if ids is not None else len(chain) * block

"""The router's memory between decisions (`RouterMemory`): each replica's published stats, what this router sent
where lately and the checkpoints it expects those requests to leave, turned into the `Candidate`s the routing
policy (deployments/routing_policy.py) prices. A plain class with an injectable clock: tested without Ray."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from deployments.routing_policy import Candidate


class RouterMemory:
    """What one router remembers between decisions. `clock`: seconds, monotonic.

    - each replica's published stats; a new `version` is noted with the time it was first seen;
    - per replica, the block hashes this router sent it and when. A hash sent at t is known until t + remember_s
      (inclusive), so requests sharing a new prefix stick to one replica until its digest shows the prefix; and
      it is dropped earlier when a digest first seen more than `settle_s` after t does not hold it (the replica
      evicted it, or its codec changed and dropped its checkpoints);
    - per replica, the checkpoints it expects a sent request to store (`routed(marks=...)`, `expected_marks`),
      held until a stats version first seen more than `settle_s` after the send
      (which shows the real mark, or shows that none was cut) or for remember_s;
    - per replica, the prefill tokens sent since its last stats version, of which the latest `queue_len` (the
      requests in flight there, when known, plus those routed but not yet `confirmed` as sent) are added to the
      reported queue: a request that finished before the next stats no longer counts;
    - per replica, the prompt_cache_keys (hashed) this router sent it and when, for remember_s, beside those its
      stats publish;
    - the replicas of the last `share_window` routing decisions (`Candidate.recent`)."""

    def __init__(self, remember_s: float, share_window: int, settle_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.remember_s, self.settle_s, self.clock = remember_s, settle_s, clock
        self._recent: deque[str] = deque(maxlen=share_window)
        self._routed: dict[str, dict[int, float]] = {}  # replica -> block hash -> when it was sent there
        self._sent: dict[str, list[int]] = {}  # replica -> prefill tokens sent since its stats version
        self._unconfirmed: dict[str, int] = {}  # replica -> routed there, not yet seen sent (Ray counts it then)
        self._expected: dict[str, dict[tuple, float]] = {}  # replica -> expected mark -> when
        self._keys: dict[str, dict[int, float]] = {}  # replica -> hashed prompt_cache_key -> when it was sent there
        # replica -> (stats version, when first seen, digest, marks, host-tier marks, disk-tier marks)
        self._stats: dict[str, tuple[object, float, frozenset[int], dict]] = {}

    def routed(self, replica_id: str, chain: list[int], tokens: int = 0, marks: list[tuple] = (),
               confirmed: bool = True, key: int | None = None) -> None:
        """One decision: the request with block hashes `chain` (and hashed prompt_cache_key `key`), predicted to
        prefill `tokens` there and to have the replica store checkpoints at `marks` (`expected_marks`), went to
        `replica_id`. confirmed=False: decided, not yet sent (see `confirmed`)."""
        self._recent.append(replica_id)
        now = self.clock()
        if key is not None:
            self._keys.setdefault(replica_id, {})[key] = now
        self._routed.setdefault(replica_id, {}).update((h, now) for h in chain)
        self._sent.setdefault(replica_id, []).append(tokens)
        if marks:
            self._expected.setdefault(replica_id, {}).update((m, now) for m in marks)
        if not confirmed:
            self._unconfirmed[replica_id] = self._unconfirmed.get(replica_id, 0) + 1

    def confirmed(self, replica_id: str) -> None:
        """A request `routed(confirmed=False)` to `replica_id` was sent there: the replica's request count now
        includes it."""
        if self._unconfirmed.get(replica_id, 0) > 0:
            self._unconfirmed[replica_id] -= 1

    def candidate(self, replica_id: str, stats: dict | None, queue_len: int | None) -> Candidate:
        """The replica as `rank` sees it. stats: its published routing stats (`record_routing_stats`), None
        before the first; queue_len: a fresher request count than the stats' (None: use the stats')."""
        stats = stats or {}
        now = self.clock()
        version = stats.get("version")
        held = self._stats.get(replica_id)
        routed = self._routed.setdefault(replica_id, {})
        if held is None or held[0] != version:
            marks: dict[int, tuple] = {}
            for h, r, tail in stats.get("marks", ()):
                marks[h] = marks.get(h, ()) + ((r, tail),)
            held = (version, now, frozenset(stats.get("digest", ())), marks, _sized(stats.get("host_marks", ())),
                    _sized(stats.get("disk_marks", ())))
            self._stats[replica_id] = held
            self._sent[replica_id] = []  # taken as counted in the new stats' queue
            self._unconfirmed[replica_id] = 0
            if version is not None:  # a digest to disagree with
                for h in [h for h, t in routed.items() if t < now - self.settle_s and h not in held[2]]:
                    del routed[h]
                expected = self._expected.get(replica_id, {})
                for h in [h for h, t in expected.items() if t < now - self.settle_s]:
                    del expected[h]
        horizon = now - self.remember_s
        for memory in (routed, self._expected.get(replica_id, {}), self._keys.get(replica_id, {})):
            for h in [h for h, t in memory.items() if t < horizon]:
                del memory[h]
        sent = self._sent.get(replica_id, [])
        if queue_len is not None:  # at most the latest sends, as many as are in flight there, count
            in_flight = queue_len + self._unconfirmed.get(replica_id, 0)
            sent = sent[len(sent) - in_flight:] if in_flight < len(sent) else sent
        sent = sum(sent)
        marks = held[3]
        if self._expected.get(replica_id):
            marks = dict(marks)
            for h, r, tail in self._expected[replica_id]:
                marks[h] = marks.get(h, ()) + ((r, tail),)
        return Candidate(
            replica_id, held[2] | frozenset(routed) if routed else held[2], marks,
            queued=int(stats.get("prefill_tokens", 0)) + sent, decoding=int(stats.get("decoding", 0)),
            resume=int(stats.get("resume_tokens", 0)), tail=int(stats.get("tail_tokens", 0)),
            prompt_ends=bool(stats.get("prompt_ends", True)), lookback=int(stats.get("lookback", 0)),
            lookback_align=int(stats.get("lookback_align", 16)),
            token_s=stats.get("step_token_s"), fixed_s=stats.get("step_fixed_s"), step_tokens=stats.get("step_tokens"),
            queue_len=int(stats.get("queue", 0) if queue_len is None else queue_len),
            recent=sum(1 for r in self._recent if r == replica_id),
            keys=frozenset(stats.get("keys", ())) | frozenset(self._keys.get(replica_id, ())),
            host_marks=held[4], host_s_per_byte=stats.get("host_s_per_byte"),
            disk_marks=held[5], disk_s_per_byte=stats.get("disk_s_per_byte"),
            can_fetch=bool(stats.get("can_fetch", False)), fetch_room=stats.get("fetch_room"), stored_marks=held[3],
            state_bytes=int(stats.get("state_bytes", 0)), kv_bytes_per_token=int(stats.get("kv_bytes_per_token", 0)),
            fetch_costs={peer: tuple(cost) for peer, cost in (stats.get("fetch_costs") or {}).items()})


def _sized(published) -> dict[int, tuple]:
    """Published (block hash, r, tail hash, bytes) marks of a host or disk tier, by block hash."""
    out: dict[int, tuple] = {}
    for h, r, tail, nbytes in published:
        out[h] = out.get(h, ()) + ((r, tail, nbytes),)
    return out

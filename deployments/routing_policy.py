"""The prefix-aware routing decision as a pure function, and the router's memory as a plain class with an
injectable clock (no Ray): tests import both directly.

For each candidate replica: the prompt tokens it would not have to prefill (leading blocks of the request's
chained block hashes found in the replica's published digest or in what this router sent it within the last
`remember_s` seconds), its queue length, and its share of recently routed requests. The request goes to
the replica saving the most tokens among those not overloaded; with no useful match, to the least loaded.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from app.cache.digest import matched_blocks


@dataclass(frozen=True)
class RouterKnobs:
    """block_size: tokens per hashed block (must equal the replicas' digest block).
    min_match_tokens: a match shorter than this counts as no match (fall back to load).
    max_queue_gap: affinity only to replicas whose queue is at most this many requests above the shortest.
    max_ratio, slack: affinity only while a replica's count of recent decisions c stays within
        c + 1 <= max_ratio * (c_min + 1) + slack, c_min the least-used candidate's count: this bounds the
        request ratio between replicas under skewed traffic while a prefix's first repeats still stick.
    share_window: how many recent routing decisions the counts cover."""

    block_size: int = 16
    min_match_tokens: int = 32
    max_queue_gap: int = 4
    max_ratio: float = 1.4
    slack: int = 1
    share_window: int = 64


@dataclass(frozen=True)
class Candidate:
    replica_id: str
    queue_len: int
    known: frozenset[int]  # published digest plus hashes routed to it since
    recent: int  # of the last share_window decisions, how many went here


def rank(candidates: list[Candidate], chain: list[int], knobs: RouterKnobs) -> list[list[str]]:
    """Replica ids in preference ranks: [[chosen], [the rest by load]]."""
    if not candidates:
        return []
    least_used = min(c.recent for c in candidates)
    shortest = min(c.queue_len for c in candidates)

    def load(c: Candidate):
        return (c.queue_len, c.recent, c.replica_id)

    def eligible(c: Candidate) -> bool:
        over_share = c.recent + 1 > knobs.max_ratio * (least_used + 1) + knobs.slack
        return c.queue_len <= shortest + knobs.max_queue_gap and not over_share

    saved = {c.replica_id: matched_blocks(chain, c.known) * knobs.block_size for c in candidates}
    pool = [c for c in candidates if eligible(c) and saved[c.replica_id] >= knobs.min_match_tokens]
    if pool:
        chosen = max(pool, key=lambda c: (saved[c.replica_id], -c.queue_len, -c.recent, c.replica_id))
    else:
        balanced = [c for c in candidates if eligible(c)] or candidates
        chosen = min(balanced, key=load)
    rest = sorted((c for c in candidates if c is not chosen), key=load)
    return [[chosen.replica_id]] + ([[c.replica_id for c in rest]] if rest else [])


class RouterMemory:
    """What one router remembers between decisions. `clock`: seconds, monotonic.

    - each replica's published digest, rebuilt only when its stats' `version` changes;
    - per replica, the block hashes this router sent it and when: a hash sent at time t is known until
      t + remember_s (inclusive), so requests sharing a new prefix stick to one replica until that replica's
      digest shows the prefix;
    - the replicas of the last `share_window` routing decisions (`Candidate.recent`)."""

    def __init__(self, remember_s: float, share_window: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.remember_s, self.clock = remember_s, clock
        self._recent: deque[str] = deque(maxlen=share_window)
        self._routed: dict[str, dict[int, float]] = {}  # replica -> block hash -> when it was sent there
        self._digests: dict[str, tuple[object, frozenset[int]]] = {}  # replica -> (stats version, digest)

    def routed(self, replica_id: str, chain: list[int]) -> None:
        """One decision: the request with block hashes `chain` went to `replica_id`."""
        self._recent.append(replica_id)
        now = self.clock()
        self._routed.setdefault(replica_id, {}).update((h, now) for h in chain)

    def candidate(self, replica_id: str, stats: dict | None, queue_len: int | None) -> Candidate:
        """The replica as `rank` sees it. stats: its published routing stats (`version`, `digest`, `queue`),
        None before the first; queue_len: a fresher queue length than the stats' (None: use the stats')."""
        stats = stats or {}
        version = stats.get("version")
        cached = self._digests.get(replica_id)
        if cached is None or cached[0] != version:
            cached = (version, frozenset(stats.get("digest", ())))
            self._digests[replica_id] = cached
        queue = stats.get("queue", 0) if queue_len is None else queue_len
        horizon = self.clock() - self.remember_s
        routed = self._routed.get(replica_id, {})
        for h in [h for h, t in routed.items() if t < horizon]:
            del routed[h]
        known = cached[1] | frozenset(routed) if routed else cached[1]
        return Candidate(replica_id, int(queue), known, sum(1 for r in self._recent if r == replica_id))

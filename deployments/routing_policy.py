"""The prefix-aware routing decision as a pure function (no Ray): tests import it directly.

For each candidate replica: the prompt tokens it would not have to prefill (leading blocks of the request's
chained block hashes found in the replica's published digest or in what this router sent it since that
digest was published), its queue length, and its share of recently routed requests. The request goes to
the replica saving the most tokens among those not overloaded; with no useful match, to the least loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

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

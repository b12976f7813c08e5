"""Admission and eviction policies of the checkpoint cache.

Admission decides whether a prompt-end checkpoint is stored: `always`, or `second_hit` (Marconi/vLLM
style: only for a prefix seen before, so one-off prompts do not evict shared ones). Branch points and
interval checkpoints are always admitted.

Eviction picks which checkpoint to drop when the pool is full:
- `lru`: the least recently stored-or-used checkpoint; a hit refreshes only the checkpoint it used.
- `flop_aware` (Marconi): score = alpha * recency + (1 - alpha) * efficiency, both min-max normalised over
  the candidates, where efficiency = prefill FLOPs the checkpoint saves per byte it occupies; evict the
  lowest. FLOPs for a prefix of d tokens: d * linear_flops_per_token + attention_flops_per_token_pair * d^2/2.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from app.cache.radix import Node

ADMISSIONS = ("always", "second_hit")
EVICTIONS = ("lru", "flop_aware")


def lru_select(candidates: list[Node]) -> Node:
    return min(candidates, key=lambda n: (n.ckpt_access, n.id))


@dataclass(frozen=True)
class FlopAwareSelect:
    linear_flops_per_token: float
    attention_flops_per_pair: float
    bytes_per_checkpoint: int
    alpha: float = 0.5

    def saved_flops(self, depth: int) -> float:
        return depth * self.linear_flops_per_token + self.attention_flops_per_pair * depth * depth / 2

    def __call__(self, candidates: list[Node]) -> Node:
        rec = [n.ckpt_access for n in candidates]
        eff = [self.saved_flops(n.depth) / self.bytes_per_checkpoint for n in candidates]
        scores = [self.alpha * r + (1 - self.alpha) * e for r, e in zip(_norm(rec), _norm(eff))]
        return min(zip(scores, [n.id for n in candidates], candidates))[2]


def _norm(xs: list[float]) -> list[float]:
    lo, hi = min(xs), max(xs)
    return [0.0 if hi == lo else (x - lo) / (hi - lo) for x in xs]


class SecondHitFilter:
    """Remembers digests of prompt prefixes (bounded, LRU); `seen_before` is True from the second sighting."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self.capacity = capacity

    def seen_before(self, tokens: list[int], salt: str | None = None) -> bool:
        """A salted prefix is its own (the hash is keyed by the salt), as in the tree: one tenant's prompt does
        not admit another's checkpoint."""
        key = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16, key=_salt_key(salt)).digest()
        hit = key in self._seen
        self._seen[key] = None
        self._seen.move_to_end(key)
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return hit


def _salt_key(salt: str | None) -> bytes:
    return b"" if salt is None else hashlib.blake2b(salt.encode("utf-8", "surrogatepass")).digest()

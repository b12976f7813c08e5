"""The hybrid prefix cache: radix tree + KV slot pool + checkpoint pool + admission and eviction.

The engine talks to this class only, through a few verbs: `match`, `insert`, `lock`/`unlock`,
`alloc_kv`/`free_kv`, `store_checkpoint`/`load_checkpoint`, `check_integrity`. It does the bookkeeping
(which slot holds what); the bytes move in the workers, through the `write` callback of a store and the
slot id a load returns. KV slots are owned either
by the tree or by one running request (its private, not yet inserted tokens); `check_integrity(private)`
verifies that every slot is owned exactly once or free. A full KV pool evicts unlocked tree leaves; a full
checkpoint pool evicts a checkpoint by policy; when nothing is evictable the caller waits or preempts,
and a checkpoint that cannot be stored is skipped: no request ever fails because the cache is full.

With a host tier (`host`, app/cache/host_tier.py), a checkpoint leaving the pool is demoted there instead of lost
and `match` reports a deeper host entry the prompt starts with (`host_len`, `host_bytes`); with a disk tier (`disk`,
app/cache/disk_tier.py) below, `match` looks on disk when the host tier has nothing deeper. What moves between the
pools and those tiers (demotion, promotion, write-behind, disk hits, peer fetches' exports and imports) is
`TierMoves` (app/cache/tier_moves.py), which this class is built on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from app.cache.checkpoint import CheckpointPool
from app.cache.host_tier import HostTier
from app.cache.policy import SecondHitFilter, lru_select
from app.cache.pools import KVSlots
from app.cache.radix import InsertResult, MatchResult, Node, RadixTree
from app.cache.tier_moves import TierMoves


@dataclass
class CacheCounters:
    stores: int = 0
    loads: int = 0
    checkpoint_evictions: int = 0
    kv_evicted_tokens: int = 0
    skipped_stores: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    reused_by_kind: dict[str, int] = field(default_factory=dict)  # checkpoints loaded at least once
    unused_drops_by_kind: dict[str, int] = field(default_factory=dict)  # left the pool never loaded
    # of them, evicted (for room, or with their KV) rather than discarded by a layout change (`drop_checkpoints`)
    unused_evictions_by_kind: dict[str, int] = field(default_factory=dict)

    def reuse(self, live: list) -> dict[str, dict[str, int]]:
        """Per kind of checkpoint: stored, reused (loaded at least once), never reused (left the pool without a
        load; of those, `evicted_unused` were evicted rather than discarded by a layout change), and unloaded in
        the pool now (`live`: the tree's checkpointed nodes)."""
        out = {}
        for kind, stored in self.by_kind.items():
            waiting = sum(1 for n in live if n.ckpt_kind == kind and n.ckpt_loads == 0)
            out[kind] = {"stored": stored, "reused": self.reused_by_kind.get(kind, 0),
                         "never_reused": self.unused_drops_by_kind.get(kind, 0),
                         "evicted_unused": self.unused_evictions_by_kind.get(kind, 0), "unused_in_pool": waiting}
        return out


class PrefixCache(TierMoves):
    def __init__(self, kv: KVSlots, checkpoints: CheckpointPool, admission: str = "always", select=lru_select,
                 host: HostTier | None = None, io=None, layout: tuple = ()):
        self.tree = RadixTree(on_drop=self._dropped)
        self.kv = kv
        self.checkpoints = checkpoints
        self.admission = admission
        self.select = select
        self.second_hit = SecondHitFilter()
        self.counters = CacheCounters()
        self.host, self.io, self.layout = host, io, layout
        self.disk = None  # the disk tier below the host tier (app/cache/disk_tier.py), set by the engine
        self.staging = False  # True: no host tier of its own: `host` only stages disk hits and peer fetches

    # ------------------------------------------------------------------ lookup and sharing
    def match(self, tokens: list[int], limit: int | None = None, salt: str | None = None) -> MatchResult:
        res = self.tree.match(tokens, limit, salt=salt)
        if self.host is not None:
            limit = len(tokens) if limit is None else limit
            entry = self.host.find(tokens, limit, salt, self.layout) if self.host.entries else None
            if (entry is None or entry.depth <= res.checkpoint_len) and self.disk is not None:
                entry = self._from_disk(tokens, limit, salt, res.checkpoint_len) or entry
            if entry is not None and entry.depth > res.checkpoint_len:
                res = res._replace(host_len=entry.depth, host_bytes=entry.nbytes)
        return res

    def root(self, salt: str | None = None) -> Node:
        """Where a sequence with no cache hit stands (and locks): its salt's root."""
        return self.tree.root_of(salt)

    def lock(self, node: Node) -> None:
        self.tree.lock(node)

    def unlock(self, node: Node) -> None:
        self.tree.unlock(node)

    def insert(self, tokens: list[int], slots: torch.Tensor, salt: str | None = None) -> InsertResult:
        """Hand a request's KV for `tokens` to the tree (under `salt`); slots the tree already had are freed here."""
        res = self.tree.insert(tokens, slots, salt)
        dup = res.duplicates[res.duplicates != res.slots[: len(res.duplicates)]]
        if len(dup):
            self.kv.free_tensor(dup)
        return res

    def admit_prompt_end(self, tokens: list[int], salt: str | None = None) -> bool:
        """Whether a prompt-end checkpoint for this prefix should be stored (admission policy)."""
        seen = self.second_hit.seen_before(tokens, salt)
        return self.admission == "always" or seen

    # ------------------------------------------------------------------ KV slots
    def alloc_kv(self, n: int) -> torch.Tensor | None:
        """n free KV slots, evicting unlocked tree leaves (LRU) if needed; None if even that is not enough."""
        if n > self.kv.num_free:
            freed, ckpts = self.tree.evict_kv(n - self.kv.num_free)
            self.kv.free_tensor(freed)
            self.counters.kv_evicted_tokens += len(freed)
            for slot in ckpts:
                self.checkpoints.free(slot)
                self.counters.checkpoint_evictions += 1
        return self.kv.alloc_tensor(n)

    def free_kv(self, slots: torch.Tensor) -> None:
        self.kv.free_tensor(slots)

    # ------------------------------------------------------------------ checkpoints
    def store_checkpoint(self, node: Node, write: Callable[[int], None], kind: str) -> bool:
        """Give `node` a checkpoint: pick a slot (evicting by policy when the pool is full) and call
        `write(slot)` to fill it. Returns False (and stores nothing) when no slot can be freed."""
        if node.checkpoint is not None:
            self.tree.set_checkpoint(node, node.checkpoint)  # already there: refresh it
            return True
        slot = self.checkpoints.alloc()
        if slot is None:
            node.pins += 1  # never evict the node we are storing at
            try:
                freed = self.tree.evict_checkpoint(self._victim)
            finally:
                node.pins -= 1
            if freed is None:
                self.counters.skipped_stores += 1
                return False
            self.counters.checkpoint_evictions += 1
            slot = freed
        try:
            write(slot)
        except BaseException:  # the worker failed to write it: the slot goes back, the node stays without one
            self.checkpoints.free(slot)
            raise
        self.tree.set_checkpoint(node, slot, kind)
        self.counters.stores += 1
        self.counters.by_kind[kind] = self.counters.by_kind.get(kind, 0) + 1
        return True

    def _victim(self, candidates: list[Node]) -> Node:
        """The eviction policy's pick, except that a lookback checkpoint with a reused checkpoint below it goes
        first (least recently used of those): the prompts that come back resume below it (a repeat at its prompt
        end, a header's later queries at its branch), so it saves nothing more; it held its slot in case the next
        prompt parted within its last tokens. Keeps lookback checkpoints from costing workloads of repeats."""
        dominated = [n for n in candidates if n.ckpt_kind == "lookback" and _reused_below(n)]
        return lru_select(dominated) if dominated else self.select(candidates)

    def load_checkpoint(self, node: Node) -> int:
        """The slot of `node`'s checkpoint, for a worker to copy into a fresh active state (copy-on-write:
        the stored one never changes). Its first load also writes it behind to the disk tier, if any."""
        self.counters.loads += 1
        if node.ckpt_loads == 0 and node.ckpt_kind is not None:
            kinds = self.counters.reused_by_kind
            kinds[node.ckpt_kind] = kinds.get(node.ckpt_kind, 0) + 1
            self._write_reused(node)
        node.ckpt_loads += 1
        return node.checkpoint

    def dispensable(self) -> int:
        """Lookback checkpoints with a reused checkpoint below them: the ones eviction takes first (`_victim`),
        so a pool that holds everything else has room enough. What the controller's fit test leaves out."""
        return sum(1 for n in self.tree.nodes() if n.ckpt_kind == "lookback" and n.checkpoint is not None
                   and _reused_below(n))

    def branch_back(self, match: MatchResult, within: int) -> int | None:
        """How far before a stored prompt's end a request left that prompt's path: tokens from where its KV match
        ends (`match`) to the shallowest prompt-end checkpoint below that point, if one lies within `within`
        tokens of it (else None: the request shares no nearby prompt end, e.g. a repeat or an unrelated prompt).
        A lookback of at least this many tokens would have given the request a checkpoint at its branch."""
        node, start = match.kv_node, match.kv_len
        if node is None:
            return None
        stack = [node] if node.depth > start else list(node.children.values())
        best = None
        while stack:
            n = stack.pop()
            if n.depth - len(n.tokens) >= start + within:  # this edge starts beyond reach
                continue
            if n.ckpt_kind == "prompt_end" and n.checkpoint is not None and n.depth - start <= within:
                best = n.depth - start if best is None else min(best, n.depth - start)
                continue  # anything below is deeper
            stack.extend(n.children.values())
        return best

    def _dropped(self, node: Node) -> None:
        """A checkpoint leaves the pool: count it if it never served a load (as evicted unused too, unless a layout
        change discarded it: its placement did not fail); demote it to the host tier unless it was discarded."""
        if node.ckpt_loads == 0 and node.ckpt_kind is not None:
            for drops in (self.counters.unused_drops_by_kind,
                          *(() if node.discarded else (self.counters.unused_evictions_by_kind,))):
                drops[node.ckpt_kind] = drops.get(node.ckpt_kind, 0) + 1
        if self.staging and self.disk is not None and not node.discarded:  # no host tier of its own: to disk
            salt, tokens = self.tree.path(node)
            self.disk.put(salt, tokens, node.ckpt_kind, self._pool_entry(node))
        elif self.host is not None and not self.staging and not node.discarded:
            self._demote(node)

    # ------------------------------------------------------------------ integrity
    def check_integrity(self, private: list[torch.Tensor] = ()) -> None:
        """Tree invariants, plus: every KV slot is in the tree, private to one request, or free, exactly
        once; tree checkpoints and used checkpoint slots agree and fit the pool."""
        self.tree.check_integrity()
        owned = [n.kv for n in self.tree.nodes()] + list(private)
        ids = torch.cat(owned).tolist() if owned else []
        free = self.kv.free_ids()
        assert len(ids) == len(set(ids)), "KV slot owned twice"
        assert not set(ids) & set(free), "KV slot both owned and free"
        assert len(ids) + len(free) == self.kv.capacity, "KV slot leaked"
        ckpts = [n.checkpoint for n in self.tree.nodes() if n.checkpoint is not None]
        assert len(ckpts) == self.checkpoints.num_used <= self.checkpoints.num_slots, "checkpoint slots leaked"
        assert not set(ckpts) & set(self.checkpoints.allocator.free_ids()), "checkpoint slot both used and free"
        if self.host is not None:
            store = getattr(self.io, "host", None)
            self.host.check_integrity(self.layout, *((set(store.entries), set(store.blocks)) if store is not None
                                                     else (None, None)))


def _reused_below(node: Node) -> bool:
    """Whether a checkpoint under `node` (not its own) has been loaded since it was stored."""
    stack = list(node.children.values())
    while stack:
        n = stack.pop()
        if n.checkpoint is not None and n.ckpt_loads:
            return True
        stack.extend(n.children.values())
    return False

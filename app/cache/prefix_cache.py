"""The hybrid prefix cache: radix tree + KV slot pool + checkpoint pool + admission and eviction.

The engine talks to this class only, through a few verbs: `match`, `insert`, `lock`/`unlock`,
`alloc_kv`/`free_kv`, `store_checkpoint`/`load_checkpoint`, `check_integrity`. It does the bookkeeping
(which slot holds what); the bytes move in the workers, through the `write` callback of a store and the
slot id a load returns. KV slots are owned either
by the tree or by one running request (its private, not yet inserted tokens); `check_integrity(private)`
verifies that every slot is owned exactly once or free. A full KV pool evicts unlocked tree leaves; a full
checkpoint pool evicts a checkpoint by policy; when nothing is evictable the caller waits or preempts,
and a checkpoint that cannot be stored is skipped: no request ever fails because the cache is full.

With a host tier (`host`, app/cache/host_tier.py), a checkpoint leaving the pool for room (or with its KV) is
demoted there with its prefix's KV instead of lost, and `match` reports a deeper host entry the prompt starts
with (`host_len`, `host_bytes`), which `promote` loads back into the pools before the request is admitted. `io`
moves the bytes (the worker's `demote`, `promote_kv`, `promote_state`, `host_drop`); `layout` names the codec
layout stored checkpoints are in, so that no entry of another layout is ever loaded.

With a disk tier (`disk`, app/cache/disk_tier.py) below, entries the host tier evicts are written behind, and
`match` looks on disk when the host tier has nothing deeper: a disk entry is filed into the host tier, then promoted
like any other. With the host tier off (`staging`), a checkpoint leaving the pools is copied from them and queued
for the disk at once (if any), and the host tier only stages disk hits and peer fetches on their way in.

Peer fetches (issue 40): `export_entry` gives a peer the deepest checkpoint of a prompt (pools or host tier) with its
prefix's KV, as host tensors; `file_entry` files one that came in (or a disk hit) into the host tier.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from app.cache.checkpoint import CheckpointPool
from app.cache.host_tier import HostEntry, HostTier
from app.cache.policy import SecondHitFilter, lru_select
from app.cache.pools import KVSlots
from app.cache.radix import InsertResult, MatchResult, Node, RadixTree


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


class PrefixCache:
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

    def disk_wanted(self, tokens: list[int], limit: int, salt: str | None) -> int | None:
        """Where a disk-tier read for this prompt would have to start to pay (the deepest the pools and the host
        tier hold already), or None when it cannot pay (no disk tier, nothing a block deeper to find)."""
        if self.disk is None or self.host is None:
            return None
        held = self.tree.match(tokens, limit, salt=salt, touch=False).checkpoint_len
        entry = self.host.find(tokens, limit, salt, self.layout) if self.host.entries else None
        held = max(held, entry.depth if entry is not None else 0)
        return held if limit - held >= self.host.block else None

    def file_found(self, found: tuple[dict, dict[str, torch.Tensor]], salt: str | None) -> HostEntry | None:
        """File a disk entry read ahead of its request (`DiskTier.find`'s answer) into the host tier."""
        if not self._fits(*found):
            return None
        header, tensors = found
        return self.file_entry(salt, header["tokens"], header.get("kind"), tensors)

    def _from_disk(self, tokens: list[int], limit: int, salt: str | None, below: int) -> HostEntry | None:
        """File the deepest disk-tier entry the prompt starts with, if deeper than `below` by a block at least, into
        the host tier (where `promote` takes it from); None if there is none or its tensors do not fit this engine."""
        if limit - below < self.host.block:
            return None
        found = self.disk.find(tokens, limit, salt, above=below)
        if found is None or not self._fits(*found):
            return None
        header, tensors = found
        return self.file_entry(salt, header["tokens"], header.get("kind"), tensors)

    def file_entry(self, salt: str | None, tokens: list[int], kind: str | None, tensors: dict[str, torch.Tensor]
                   ) -> HostEntry | None:
        """File an entry that came from outside the pools (a disk hit, a peer's export: `HostStore.export`'s names,
        host tensors, shapes already checked) into the host tier, where `match` and `promote` find it; None if it
        does not fit the tier."""
        d = self.host.admit(salt, tokens, self.layout, self.checkpoints.bytes_per_slot, kind)
        self._let_go(d)
        if d.entry is None:
            return None
        self.io.host.adopt(d.entry.id, tensors, list(d.entry.blocks), d.new_blocks, self.host.block)
        return d.entry

    def export_entry(self, tokens: list[int], limit: int, salt: str | None
                     ) -> tuple[list[int], str | None, dict[str, torch.Tensor]] | None:
        """The deepest checkpoint of `salt` that `tokens` starts with, at most `limit` deep, from the pools, the host
        tier or the disk tier (read, not filed), as (its tokens, its kind, host tensors in `HostStore.export`'s
        names): what a peer fetches. None when none holds one."""
        res = self.tree.match(tokens, limit, salt=salt)
        entry = self.host.find(tokens, limit, salt, self.layout) if self.host is not None else None
        held = max(res.checkpoint_len, entry.depth if entry is not None else 0)
        if self.disk is not None and limit - held >= self.host.block:
            found = self.disk.find(tokens, limit, salt, above=held)
            if found is not None and self._fits(*found):
                header, tensors = found
                return header["tokens"], header.get("kind"), tensors
        if entry is not None and entry.depth > res.checkpoint_len:
            return list(entry.tokens), entry.kind, self.io.host.export(entry.id)
        node = res.checkpoint_node
        if node is None:
            return None
        return self.tree.path(node)[1], node.ckpt_kind, self._pool_entry(node)

    def _fits(self, header: dict, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether a disk entry's tensors have this engine's shapes and dtypes (the fingerprints say they should)."""
        ok = self.fits(len(header["tokens"]), tensors)
        if not ok:
            self.disk.refused("shape")
        return ok

    def fits(self, depth: int, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether an entry's tensors of `depth` tokens have this engine's names, shapes and dtypes."""
        rows = self.io.codec.export(0)
        want = {f"state.{i}": (r.shape, r.dtype) for i, r in enumerate(rows)}
        want |= {f"kv.{layer}": (torch.Size([depth, t.shape[1]]), t.dtype) for layer, t in self.io.kv.storage.items()}
        return {n: (t.shape, t.dtype) for n, t in tensors.items()} == want

    def _let_go(self, d) -> None:
        """The entries a host-tier admission evicted: written behind to the disk tier (if any), then dropped."""
        if d.evicted or d.dropped:
            if self.disk is not None:
                for e in d.evicted:
                    self.disk.put(e.salt, list(e.tokens), e.kind, self.io.host.export(e.id))
            self.io.host_drop([e.id for e in d.evicted], d.dropped)

    def promote(self, tokens: list[int], limit: int, salt: str | None, match: MatchResult) -> MatchResult:
        """Load the host entry `match` reports back into the pools (its missing KV into fresh slots of the tree,
        its checkpoint into the pool) and match again; `match` itself if it reports none or there is no room."""
        if not match.host_len:
            return match
        entry = self.host.find(tokens, limit, salt, self.layout)
        if entry is None:
            return match
        self.host.take(entry)
        start = time.perf_counter()
        try:
            loaded = self._load_entry(entry, match)
        finally:
            self.io.host_drop([entry.id], self.host.release(entry))
        self.host.settle(entry, loaded)
        if loaded:
            self.host.timed(entry, time.perf_counter() - start)
        return self.match(tokens, limit, salt) if loaded else match

    def _load_entry(self, entry: HostEntry, match: MatchResult) -> bool:
        tokens, salt = list(entry.tokens), entry.salt
        shared = min(match.kv_len, entry.depth)  # tokens whose KV the tree holds already
        # making room must not evict the shared KV, and only that: lock a node ending where the sharing ends
        holder = self.tree.split_at(tokens, shared, salt) if shared else None
        if holder is not None:
            self.tree.lock(holder)
        try:
            new = self.alloc_kv(entry.depth - shared)
        finally:
            if holder is not None:
                self.tree.unlock(holder)
        if new is None:
            return False
        if len(new):
            self.io.promote_kv(entry.id, shared, new)
        res = self.insert(tokens, torch.cat([self.tree.kv_along(tokens, shared, salt), new]), salt)
        return self.store_checkpoint(res.node, lambda slot: self.io.promote_state(entry.id, slot),
                                     entry.kind or "host")

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
        the stored one never changes)."""
        self.counters.loads += 1
        if node.ckpt_loads == 0 and node.ckpt_kind is not None:
            kinds = self.counters.reused_by_kind
            kinds[node.ckpt_kind] = kinds.get(node.ckpt_kind, 0) + 1
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

    def _demote(self, node: Node) -> None:
        """Copy `node`'s checkpoint and its prefix's KV to the host tier (while both are still in the pools)."""
        salt, tokens = self.tree.path(node)
        d = self.host.admit(salt, tokens, self.layout, self.checkpoints.bytes_per_slot, node.ckpt_kind)
        self._let_go(d)
        if d.entry is not None:
            try:
                self.io.demote(d.entry.id, node.checkpoint, self.tree.path_kv(node), list(d.entry.blocks),
                               d.new_blocks, self.host.block)
            except BaseException:
                self.host.take(d.entry)  # never filed without its bytes
                self.io.host_drop([d.entry.id], self.host.release(d.entry))
                raise

    def persist(self, deadline: float) -> int:
        """Write every checkpoint the host tier and the pool hold to the disk tier (a graceful stop: they would be
        lost with the process), the host tier's first, until `deadline` (time.monotonic()); returns how many were
        queued. Runs between steps."""
        if self.disk is None:
            return 0
        queued = 0
        for entry in list(self.host.entries.values()):
            wait = deadline - time.monotonic()
            if wait <= 0:
                return queued
            queued += self.disk.put(entry.salt, list(entry.tokens), entry.kind, self.io.host.export(entry.id), wait)
        for node in [n for n in self.tree.nodes() if n.checkpoint is not None]:
            wait = deadline - time.monotonic()
            if wait <= 0:
                return queued
            salt, tokens = self.tree.path(node)
            queued += self.disk.put(salt, tokens, node.ckpt_kind, self._pool_entry(node), wait)
        return queued

    def _pool_entry(self, node: Node) -> dict[str, torch.Tensor]:
        """`node`'s checkpoint and its prefix's KV, copied from the pools to host tensors as the disk tier writes
        them (`HostStore.export`'s names)."""
        kv = self.tree.path_kv(node).to(self.io.device)
        rows = self.io.codec.export(node.checkpoint)
        tensors = {f"state.{i}": r.to("cpu", copy=True) for i, r in enumerate(rows)}
        return tensors | {f"kv.{layer}": t.index_select(0, kv).cpu() for layer, t in self.io.kv.storage.items()}

    def set_layout(self, layout: tuple) -> None:
        """Stored checkpoints are in `layout` from now on: host entries of any other go (their bytes too)."""
        self.layout = layout
        if self.host is not None:
            stale, dropped = self.host.drop_layouts(layout)
            if stale:
                self.io.host_drop([e.id for e in stale], dropped)

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

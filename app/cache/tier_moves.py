"""What moves between the prefix cache's pools and the tiers below them (`TierMoves`, which `PrefixCache` in
app/cache/prefix_cache.py is built on; it uses the cache's tree, pools, `host`, `disk`, `io` and `layout`).

- Host tier (app/cache/host_tier.py): a checkpoint leaving the pool for room (or with its KV) is demoted there with
  its prefix's KV (`_demote`), and `promote` loads a deeper host entry back into the pools before the request is
  admitted. `io` moves the bytes (the worker's `demote`, `promote_kv`, `promote_state`, `host_drop`); `layout`
  names the codec layout stored checkpoints are in, so that no entry of another layout is ever loaded
  (`set_layout`).
- Disk tier (app/cache/disk_tier.py): entries the host tier evicts are written behind (`_let_go`), and so is a
  checkpoint at its first reuse (`_write_reused`: what a crash would otherwise lose first); a disk entry
  found for a prompt (at admission, `_from_disk`, or read ahead of it, `disk_wanted` and `file_found`) is filed
  into the host tier, then promoted like any other; `persist` writes what the pools and the host tier hold on a
  graceful stop.
- Peer fetches (issue 40): `export_entry` gives a peer the deepest checkpoint of a prompt (pools, host or disk
  tier) with its prefix's KV, as host tensors; `file_entry` files one that came in (or a disk hit) into the host
  tier, once `fits` has checked its names, shapes and dtypes.
"""

from __future__ import annotations

import time

import torch

from app.cache.host_tier import HostEntry
from app.cache.radix import MatchResult, Node


class TierMoves:
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
        """File a disk entry (`DiskTier.find`'s answer: at admission, or read ahead of the request) into the host
        tier, if its tensors fit this engine."""
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
        return None if found is None else self.file_found(found, salt)

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

    def _write_reused(self, node: Node) -> None:
        """A pool checkpoint loaded for the first time: written behind to the disk tier (unless it is there already, or
        the tier's rate for reused entries is spent), so that a crash does not lose it."""
        if self.disk is None:
            return
        salt, tokens = self.tree.path(node)
        nbytes = self.checkpoints.bytes_per_slot + len(tokens) * self.io.kv.bytes_per_token
        if not self.disk.holds(salt, tokens) and self.disk.may_write_reused(nbytes):
            self.disk.put(salt, tokens, node.ckpt_kind, self._pool_entry(node))

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

"""The host tier: checkpoints the engine's pools let go of, kept in host memory with the KV of the tokens they
follow, so that a later prompt resumes from them instead of computing the prefix again.

This is the bookkeeping (which entries exist, for which salt, prefix and codec layout, how many bytes, which go
first); each worker holds the bytes of its own shard under the same entry ids (`app/cache/host_store.py`).

- An entry is a checkpoint's state, in the bytes the codec stored (a round trip through the tier is bit-exact),
  plus the attention KV of every token of its prefix: a state without its KV is useless to a hybrid model. The KV
  of whole `block`-token blocks is shared between entries on one path (a conversation's turns, a prompt's end and
  its generation end): blocks are keyed by their chained hash (salt-seeded) and counted by the entries that use
  them, so a path's KV is held once; only the tokens past an entry's last full block are its own.
- One budget (`EngineConfig.host_mb`) holds states and KV alike. Eviction is by cost, not by fixed shares: an
  entry's value is the prefill a hit saves per byte it holds (its depth over its bytes), aged by greedy-dual
  (GDSF): priority = clock + value, the clock rising to each evicted entry's priority, so that an entry nobody
  asks for again gives way in time to newer ones however long its prefix.
- `find` gives the deepest entry of the request's salt and of the current codec layout whose tokens start the
  prompt: salts never share, and an entry of a superseded layout (W_max, quant, layout or selector changed) is
  never loaded; `drop_layouts` removes those when the layout changes.
- Lookups go through chained hashes of `block`-token blocks (`app/cache/digest.py`), then the entry's exact
  tokens are compared: a hash collision can cost a lookup, never a wrong load.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from app.cache.digest import block_hashes, chain_seed, checkpoint_mark


@dataclass(eq=False)
class HostEntry:
    id: int
    salt: str | None
    tokens: tuple[int, ...]  # the prefix its state follows
    layout: tuple  # the codec layout its state was stored in
    state_bytes: int
    kv_bytes: int  # of its whole prefix (blocks shared with other entries included)
    blocks: tuple[int, ...] = ()  # chained hashes of its prefix's full blocks, whose KV the tier shares
    kind: str | None = None  # why its checkpoint was stored (prompt_end, branch, ...)
    priority: float = 0.0
    key: tuple = ()  # where the index files it
    mark: tuple | None = None  # (block, its `checkpoint_mark` at that block), computed once for the router

    @property
    def depth(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.state_bytes + self.kv_bytes


@dataclass
class Demotion:
    """What `admit` decided: the new entry (None: it does not fit), the entries evicted for room and the blocks
    they alone held (their bytes to drop), and the entry's blocks the tier did not hold yet, as (hash, first token),
    whose KV the caller copies with the state (the rest it shares)."""

    entry: HostEntry | None
    evicted: list[HostEntry] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    new_blocks: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class TierCounters:
    demotions: int = 0  # entries taken in
    promotions: int = 0  # entries loaded back (hits)
    promoted_tokens: int = 0  # prefill those hits saved
    evictions: int = 0  # entries evicted for room
    layout_drops: int = 0  # entries of a superseded layout dropped
    skipped: int = 0  # checkpoints too large for the whole budget
    failed: int = 0  # hits that could not be loaded (no room in the pools)
    load_s: float = 0.0  # time promotions took (copies and bookkeeping)
    loaded_bytes: int = 0  # bytes they moved
    by_kind: dict[str, int] = field(default_factory=dict)  # demotions per checkpoint kind


class HostTier:
    def __init__(self, budget_bytes: int, kv_bytes_per_token: int, block: int = 64) -> None:
        self.budget_bytes, self.kv_bytes_per_token, self.block = budget_bytes, kv_bytes_per_token, block
        self.entries: dict[int, HostEntry] = {}
        self.blocks: dict[int, int] = {}  # block hash -> entries using its KV
        self._index: dict[tuple, list[HostEntry]] = {}  # (chain key, tail length) -> entries
        self._ids = itertools.count(1)
        self._clock = 0.0
        self.state_bytes = self.kv_bytes = 0
        self.counters = TierCounters()

    @property
    def used_bytes(self) -> int:
        return self.state_bytes + self.kv_bytes

    # ------------------------------------------------------------------ lookups
    def _key(self, salt: str | None, tokens: tuple[int, ...] | list[int], chain: list[int]) -> tuple:
        """Where an entry of `len(tokens)` tokens is filed: the chained hash of its last full block (the salt's
        seed when it has none) and how many tokens follow that block."""
        k = len(tokens) // self.block
        return (chain[k - 1] if k else chain_seed(salt), len(tokens) - k * self.block)

    def find(self, tokens: list[int], limit: int, salt: str | None, layout: tuple) -> HostEntry | None:
        """The deepest entry of `salt` and `layout` whose tokens start `tokens`, at most `limit` deep."""
        if not self.entries or limit <= 0:
            return None
        prompt = tokens[:limit]
        chain = block_hashes(prompt, self.block, salt)
        for k in range(len(chain), -1, -1):
            base = chain[k - 1] if k else chain_seed(salt)
            best = None
            for r in range(min(self.block - 1, limit - k * self.block), -1, -1):
                for entry in self._index.get((base, r), ()):
                    if entry.salt == salt and entry.layout == layout and entry.tokens == tuple(prompt[:entry.depth]):
                        best = entry
                        break
                if best is not None:
                    return best
        return None

    # ------------------------------------------------------------------ updates
    def admit(self, salt: str | None, tokens: list[int], layout: tuple, state_bytes: int,
              kind: str | None) -> Demotion:
        """File a demoted checkpoint (`Demotion`). The caller drops the evicted entries' bytes, then writes the new
        one's state, its new blocks' KV and the KV of its tokens past its last full block."""
        tokens = tuple(tokens)
        chain = block_hashes(list(tokens), self.block, salt)
        block_bytes, own = self.block * self.kv_bytes_per_token, (len(tokens) % self.block) * self.kv_bytes_per_token

        def needed() -> int:
            return state_bytes + own + block_bytes * sum(1 for h in chain if h not in self.blocks)

        if state_bytes + own + block_bytes * len(chain) > self.budget_bytes or not tokens:
            self.counters.skipped += 1
            return Demotion(None)
        out = Demotion(None)
        while self.used_bytes + needed() > self.budget_bytes:
            if not self.entries:  # what is left is an entry being loaded: no room until it is released
                self.counters.skipped += 1
                return out
            victim = min(self.entries.values(), key=lambda e: (e.priority, e.id))
            self._clock = max(self._clock, victim.priority)
            out.dropped += self._remove(victim)
            self.counters.evictions += 1
            out.evicted.append(victim)
        out.new_blocks = [(h, i * self.block) for i, h in enumerate(chain) if h not in self.blocks]
        for h in chain:
            self.blocks[h] = self.blocks.get(h, 0) + 1
        kv_bytes = len(tokens) * self.kv_bytes_per_token
        entry = HostEntry(next(self._ids), salt, tokens, layout, state_bytes, kv_bytes, tuple(chain), kind,
                          key=self._key(salt, tokens, chain))
        entry.priority = self._clock + entry.depth / entry.nbytes
        self.entries[entry.id] = entry
        self._index.setdefault(entry.key, []).append(entry)
        self.state_bytes += state_bytes
        self.kv_bytes += own + block_bytes * len(out.new_blocks)
        self.counters.demotions += 1
        if kind is not None:
            self.counters.by_kind[kind] = self.counters.by_kind.get(kind, 0) + 1
        out.entry = entry
        return out

    def take(self, entry: HostEntry) -> None:
        """A hit: the entry is unfiled before it is loaded back (nothing finds or evicts it meanwhile), its bytes
        and blocks still held (a demotion while it loads may evict the entries it shares blocks with); `release`
        them once it is loaded, and `settle` says how that went."""
        self._unfile(entry)

    def release(self, entry: HostEntry) -> list[int]:
        """A taken entry's bytes are no longer needed: returns the blocks no entry uses now (drop their bytes)."""
        return self._release(entry)

    def settle(self, entry: HostEntry, loaded: bool) -> None:
        """A taken entry is back in the pools (`loaded`), or loading it failed (no room): it is gone either way."""
        if loaded:
            self.counters.promotions += 1
            self.counters.promoted_tokens += entry.depth
        else:
            self.counters.failed += 1

    def drop_layouts(self, keep: tuple) -> tuple[list[HostEntry], list[int]]:
        """Remove every entry stored in another layout than `keep`: (them, the blocks only they held)."""
        stale, dropped = [e for e in self.entries.values() if e.layout != keep], []
        for entry in stale:
            dropped += self._remove(entry)
        self.counters.layout_drops += len(stale)
        return stale, dropped

    def _remove(self, entry: HostEntry) -> list[int]:
        """Unfile `entry` and release its bytes; returns the blocks no other entry uses (gone from the books)."""
        self._unfile(entry)
        return self._release(entry)

    def _unfile(self, entry: HostEntry) -> None:
        del self.entries[entry.id]
        bucket = self._index[entry.key]
        bucket.remove(entry)
        if not bucket:
            del self._index[entry.key]

    def _release(self, entry: HostEntry) -> list[int]:
        freed = []
        for h in entry.blocks:
            self.blocks[h] -= 1
            if not self.blocks[h]:
                del self.blocks[h]
                freed.append(h)
        self.state_bytes -= entry.state_bytes
        self.kv_bytes -= (entry.depth % self.block) * self.kv_bytes_per_token + len(freed) * self.block * \
            self.kv_bytes_per_token
        return freed

    def timed(self, entry: HostEntry, seconds: float) -> None:
        """A promotion of `entry` took `seconds`: what the router prices a host hit's load at."""
        self.counters.load_s += seconds
        self.counters.loaded_bytes += entry.nbytes

    # ------------------------------------------------------------------ inspection
    def marks(self, block: int) -> list[tuple[int, int, int, int]]:
        """Per entry at least one block deep, its `checkpoint_mark` at `block` and its bytes: what a replica
        publishes for the router (each mark computed once per entry)."""
        out = []
        for entry in self.entries.values():
            if entry.mark is None or entry.mark[0] != block:
                entry.mark = (block, checkpoint_mark(list(entry.tokens), block, entry.salt))
            if entry.mark[1] is not None:
                out.append((*entry.mark[1], entry.nbytes))
        return out

    @property
    def load_s_per_byte(self) -> float | None:
        """Measured seconds per byte of the promotions so far (None before the first)."""
        c = self.counters
        return c.load_s / c.loaded_bytes if c.loaded_bytes else None

    def stats(self) -> dict:
        c = self.counters
        return {"entries": len(self.entries), "state_bytes": self.state_bytes, "kv_bytes": self.kv_bytes,
                "kv_blocks": len(self.blocks),
                "budget_bytes": self.budget_bytes, "demotions": c.demotions, "promotions": c.promotions,
                "promoted_tokens": c.promoted_tokens, "evictions": c.evictions, "layout_drops": c.layout_drops,
                "skipped": c.skipped, "failed": c.failed,
                "load_s_per_byte": self.load_s_per_byte, "demotions_by_kind": dict(c.by_kind)}

    def check_integrity(self, layout: tuple, held: set[int] | None = None, held_blocks: set[int] | None = None
                        ) -> None:
        """Bytes add up and fit the budget, every block is counted by the entries using it, every entry is filed
        where `find` looks and is of `layout` (the current one), and (`held`, `held_blocks`: the entry ids and
        blocks a worker holds bytes for) bookkeeping and bytes agree."""
        assert self.state_bytes == sum(e.state_bytes for e in self.entries.values()), "host state bytes"
        uses: dict[int, int] = {}
        for e in self.entries.values():
            for h in e.blocks:
                uses[h] = uses.get(h, 0) + 1
        assert uses == self.blocks, "host block counts"
        own = sum((e.depth % self.block) * self.kv_bytes_per_token for e in self.entries.values())
        assert self.kv_bytes == own + len(self.blocks) * self.block * self.kv_bytes_per_token, "host KV bytes"
        assert self.used_bytes <= self.budget_bytes, "host tier over its budget"
        filed = [e.id for bucket in self._index.values() for e in bucket]
        assert sorted(filed) == sorted(self.entries), "host index and entries disagree"
        assert all(e.layout == layout for e in self.entries.values()), "host entry of a superseded layout"
        if held is not None:
            assert held == set(self.entries), f"host bytes held for {sorted(held ^ set(self.entries))}"
        if held_blocks is not None:
            assert held_blocks == set(self.blocks), "host block bytes held other than the bookkeeping's"

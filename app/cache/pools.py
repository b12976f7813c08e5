"""Slot allocators and the storage behind them: attention KV (one token per slot) and active states.

Allocation (which ids are free) lives with the scheduler and the cache; storage (the tensors) lives with
the worker of each tensor-parallel rank, which may hold only its heads. KV uses one slot per token (a page
size of one, as SGLang's radix cache does), so prefix sharing never splits a page. Slot ids are handed out
lowest first, which keeps tests deterministic.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from app.models.batch import LinearStates, host_to_device


class SlotAllocator:
    """Integer ids in [first, first + n); alloc takes the lowest free ids."""

    def __init__(self, n: int, first: int = 0) -> None:
        self._free = list(range(first, first + n))
        heapq.heapify(self._free)
        self.capacity = n

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, ids) -> None:
        for i in ids:
            heapq.heappush(self._free, int(i))

    def free_ids(self) -> list[int]:
        return list(self._free)


class KVSlots(SlotAllocator):
    """KV token slots as int64 tensors."""

    def alloc_tensor(self, n: int) -> torch.Tensor | None:
        ids = self.alloc(n)
        return None if ids is None else torch.from_numpy(np.array(ids, dtype=np.int64))

    def free_tensor(self, slots: torch.Tensor) -> None:
        self.free(slots.tolist())


class KVStorage:
    """Per attention layer a tensor [num_slots, W_layer] of per-token KV entries, on `device`."""

    def __init__(self, widths: dict[int, int], num_slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.storage = {layer: torch.zeros(num_slots, w, dtype=dtype, device=self.device)
                        for layer, w in widths.items()}
        self.bytes_per_token = sum(w for w in widths.values()) * dtype.itemsize


def padded_rows(rows: list[list[torch.Tensor]], width: int, fill: int) -> torch.Tensor:
    """[len(rows), width] int64 on the host: row i holds its (host) tensors end to end, then `fill`. Built in
    numpy, one slice copy per tensor: a step of several pieces builds one such table, and torch ops on this many
    tiny tensors cost more in dispatch than in copying."""
    out = np.full((len(rows), width), fill, dtype=np.int64)
    for row, parts in zip(out, rows):
        at = 0
        for t in parts:
            row[at : at + t.numel()] = t.numpy()
            at += t.numel()
    return torch.from_numpy(out)


class PagedKV:
    """`AttentionKV` for one step: batch sequence i reads slots `history[i]` and writes `new[i]`.

    The slot tables arrive from the host. Each index a step needs (one sequence's slots, or the decode
    batch's padded table with its new slots) is built there and moved to the storage's device in one copy
    without blocking (`host_to_device`), once per step however many attention layers read it. Reads use
    index_select (faster on the CPU than advanced indexing with the same 1-D index)."""

    def __init__(self, pool: KVStorage, history: list[torch.Tensor], new: list[torch.Tensor]) -> None:
        self.pool, self.history, self.new = pool, history, new
        self._index: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (read index, write index)

    @classmethod
    def decode(cls, pool: KVStorage, read: torch.Tensor, write: torch.Tensor) -> "PagedKV":
        """A decode step of read.shape[0] sequences whose tables are device tensors already (a captured
        graph's input buffers): row i reads `read[i]` (padded; the model masks by position) after writing
        its new entry to `write[i]`."""
        kv = cls(pool, [], [])
        kv._index[("padded", *range(read.shape[0]))] = (read, write)
        return kv

    def extend(self, layer: int, seq: int, entries: torch.Tensor) -> torch.Tensor:
        key = (seq,)
        if key not in self._index:
            full = host_to_device(torch.cat([self.history[seq], self.new[seq]]), self.pool.device)
            self._index[key] = (full, full[self.history[seq].numel() :])
        full, write = self._index[key]
        store = self.pool.storage[layer]
        store.index_copy_(0, write, entries.to(store.dtype))
        return store.index_select(0, full)

    def extend_padded(self, layer: int, seqs: list[int], entries: torch.Tensor,
                      counts: list[int] | None = None) -> torch.Tensor:
        """(`counts` needs no use here: each sequence's new slots say how many entries it writes.)"""
        key = ("padded", *seqs)
        if key not in self._index:
            rows = [[self.history[s], self.new[s]] for s in seqs]
            padded = padded_rows(rows, max(h.numel() + n.numel() for h, n in rows), 0)
            both = host_to_device(torch.cat([padded.view(-1)] + [self.new[s] for s in seqs]), self.pool.device)
            self._index[key] = (both[: padded.numel()].view(padded.shape), both[padded.numel() :])
        index, write = self._index[key]
        store = self.pool.storage[layer]
        store.index_copy_(0, write, entries.to(store.dtype))
        return store.index_select(0, index.view(-1)).view(*index.shape, store.shape[-1])


class StateStorage:
    """Recurrent state of running sequences: per linear layer conv [S, C, W-1] and ssm [S, H, K, V] fp32, on
    the template's device."""

    def __init__(self, template: LinearStates, num_slots: int) -> None:
        self.conv = [c.new_zeros(num_slots, *c.shape[1:]) for c in template.conv]
        self.ssm = [s.new_zeros(num_slots, *s.shape[1:]) for s in template.ssm]
        self.device = (self.conv + self.ssm)[0].device if template.ssm else torch.device("cpu")

    def template(self) -> LinearStates:
        """Zero state of one sequence, shaped like the stored ones."""
        return LinearStates([torch.zeros_like(c[:1]) for c in self.conv], [torch.zeros_like(s[:1]) for s in self.ssm])

    def gather(self, slots: list[int] | torch.Tensor) -> LinearStates:
        idx = host_to_device(slots, self.device)
        return LinearStates([c.index_select(0, idx) for c in self.conv], [s.index_select(0, idx) for s in self.ssm])

    def scatter(self, slots: list[int] | torch.Tensor, states: LinearStates) -> None:
        idx = host_to_device(slots, self.device)
        for dst, src in zip(self.conv + self.ssm, states.conv + states.ssm):
            dst.index_copy_(0, idx, src.to(dst.dtype))

    def view(self, slot: int) -> LinearStates:
        """The slot's state as batch-1 views, no copy: for readers that copy it themselves (a checkpoint store)."""
        return LinearStates([c[slot : slot + 1] for c in self.conv], [s[slot : slot + 1] for s in self.ssm])

    def write(self, slot: int, state: LinearStates) -> None:
        """Copy a single-sequence state (batch 1) into `slot`: loading a checkpoint or forking. One foreach
        copy for all layers (one launch on a GPU rather than one per tensor)."""
        torch._foreach_copy_([t[slot] for t in self.conv + self.ssm], [s[0] for s in state.conv + state.ssm])

    def zero(self, slot: int) -> None:
        for t in self.conv + self.ssm:
            t[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        for t in self.conv + self.ssm:
            t[dst] = t[src]

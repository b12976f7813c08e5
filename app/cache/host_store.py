"""The bytes of the host tier on one worker (`app/cache/host_tier.py` keeps the bookkeeping): per entry id, the
codec's storage rows of one checkpoint slot and the KV rows of its tokens past its last full block, and per shared
block (by its chained hash) the KV rows of its tokens, per attention layer, copied as they are (bit-exact). On CUDA
they live in pinned host memory: a demotion clones its rows on the compute stream and copies them to the host on a
side stream, overlapping the compute that follows; a promotion waits for that copy and copies back asynchronously
(the caching host allocator keeps pinned memory until its copies finish). On CPU a copy is a memcpy.
"""

from __future__ import annotations

import torch


class HostStore:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.pinned else None
        # entry id -> (state rows, the KV rows of its tokens past its last full block, its blocks' hashes)
        self.entries: dict[int, tuple[list[torch.Tensor], dict[int, torch.Tensor], list[int]]] = {}
        self.blocks: dict[int, dict[int, torch.Tensor]] = {}  # block hash -> per layer, its KV rows

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of `t` (pinned and filled asynchronously on CUDA)."""
        if not self.pinned:
            return t.to("cpu", copy=True)
        src = t.clone()  # on the compute stream: the slot it came from may be reused at once
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out.copy_(src, non_blocking=True)
        src.record_stream(self.stream)  # its memory is not reused before the copy has read it
        return out

    def put(self, entry_id: int, state_rows: list[torch.Tensor], own_kv: dict[int, torch.Tensor], blocks: list[int],
            new_blocks: dict[int, dict[int, torch.Tensor]]) -> None:
        """Keep copies of one checkpoint slot's storage rows, of the KV rows of its tokens past its last full block,
        and of the KV of its blocks the store did not hold (device tensors); `blocks`: all of its blocks."""
        for h, rows in new_blocks.items():
            self.blocks[h] = {layer: self._host(r) for layer, r in rows.items()}
        self.entries[entry_id] = ([self._host(r) for r in state_rows],
                                  {layer: self._host(r) for layer, r in own_kv.items()}, list(blocks))

    def _ready(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)  # its copies to host are done

    def state(self, entry_id: int) -> list[torch.Tensor]:
        self._ready()
        return self.entries[entry_id][0]

    def kv_rows(self, entry_id: int, start: int) -> dict[int, torch.Tensor]:
        """Per layer, the KV rows of the entry's tokens from `start` on: its blocks', then its own."""
        self._ready()
        _, own, blocks = self.entries[entry_id]
        return {layer: torch.cat([self.blocks[h][layer] for h in blocks] + [rows])[start:]
                for layer, rows in own.items()}

    def export(self, entry_id: int) -> dict[str, torch.Tensor]:
        """The entry as named host tensors (`state.<i>`, and `kv.<layer>` for its whole prefix): what the disk tier
        writes."""
        out = {f"state.{i}": r for i, r in enumerate(self.state(entry_id))}
        return out | {f"kv.{layer}": rows for layer, rows in self.kv_rows(entry_id, 0).items()}

    def adopt(self, entry_id: int, tensors: dict[str, torch.Tensor], blocks: list[int],
              new_blocks: list[tuple[int, int]], block: int) -> None:
        """File an entry read back from the disk tier (`export`'s names), its KV split into the blocks the store
        lacks (`new_blocks`: (hash, first token)) and its own tail."""
        state = [tensors[f"state.{i}"] for i in range(sum(n.startswith("state.") for n in tensors))]
        kv = {int(n[3:]): t for n, t in tensors.items() if n.startswith("kv.")}
        for h, at in new_blocks:
            self.blocks[h] = {layer: rows[at:at + block].clone() for layer, rows in kv.items()}
        self.entries[entry_id] = (state, {layer: rows[len(blocks) * block:].clone() for layer, rows in kv.items()},
                                  list(blocks))

    def drop(self, entry_ids: list[int], blocks: list[int] = ()) -> None:
        for i in entry_ids:
            self.entries.pop(i, None)
        for h in blocks:
            self.blocks.pop(h, None)

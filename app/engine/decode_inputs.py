"""`DecodeInputs`: the host side of a padded decode step's inputs (app/engine/graphs.py), written each step.

Kept apart from graphs.py so that the compile cache's source digest (app/engine/aot.py), which covers the traced
code, does not change when only the way the buffers are filled does.
"""

from __future__ import annotations

import numpy as np
import torch

from app.engine.step_batch import StepBatch


class DecodeInputs:
    """The input buffers of one (b, s) bucket: `head` [4, b] rows ids, positions, state slots, KV write slots;
    `kv_read` [b, s]. Two tensors, not views of one: a compiled step pays per call for inputs that alias. A step's
    values are written in numpy (`write`): straight into the buffers on the CPU, into pinned host twins copied
    without blocking to a GPU.

    Rows persist across steps, like vLLM's persistent input batch: a row that held the same sequence's KV slot
    ids at the previous step of this bucket already holds its history but the newest slot, so it gets one id,
    not its whole history again. "The same": the step batch's `history_keys` entry is the very object the row
    was written from (`Sequence.kv_key`, the buffer of its slot ids, which only ever grows at its end and is
    replaced when anything else changes; the row keeps a reference, so no other sequence can own that
    object)."""

    def __init__(self, b: int, s: int, fill: int, scratch_state: int, device: torch.device) -> None:
        self.head = torch.zeros((4, b), dtype=torch.long, device=device)
        self.head[2].fill_(scratch_state)
        self.head[3].fill_(fill)
        self.kv_read = torch.full((b, s), fill, dtype=torch.long, device=device)
        self.pad = np.array([0, 0, scratch_state, fill], dtype=np.int64)[:, None]
        self.fill_value = fill
        host = (self.head, self.kv_read) if device.type == "cpu" else \
            (self.head.cpu().pin_memory(), self.kv_read.cpu().pin_memory())
        self._host = host
        self._np = tuple(t.numpy() for t in host)
        self._rows: list[tuple[object, int]] = [(None, -1)] * b  # per row: (history key, its length) written
        self._n = b  # rows written with sequences at the last step (all of them hold padding first)

    def write(self, batch: StepBatch) -> None:
        """A step's values (`DecodeGraphs.handles` accepts the batch): row i is sequence i, its KV history and
        then its new slot; the rows past the batch and each row's tail read and write the scratch slots."""
        head, kv = self._np
        n = len(batch.extend_lens)
        head[0, :n], head[1, :n], head[2, :n] = batch.token_ids, batch.cached_lens, batch.state_slots
        new = batch.new_slots[0].numpy() if n == 1 else torch.cat(batch.new_slots).numpy()
        head[3, :n] = new
        head[:, n:] = self.pad
        rows, keys = self._rows, batch.history_keys or (None,) * n
        for i, (hist, at, key) in enumerate(zip(batch.history, batch.cached_lens, keys)):
            row, (held, held_at) = kv[i], rows[i]
            if key is None or held is not key or held_at != at - 1:
                row[:at] = hist.numpy()
                row[at + 1 :] = self.fill_value
            row[at] = new[i]
            rows[i] = (key, at)
        if self._n > n:
            kv[n : self._n] = self.fill_value
            rows[n : self._n] = [(None, -1)] * (self._n - n)
        self._n = n
        if self.head.is_cuda:
            for dst, src in zip((self.head, self.kv_read), self._host):
                dst.copy_(src, non_blocking=True)

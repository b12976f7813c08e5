"""The dasc `CheckpointCodec`: stores only the retained rows of every layer's state, ragged or padded,
fp32 or INT8, and restores a full active state with the omitted units zero-filled (nr). The wr policy then
refreshes those zeros (app/dasc/policy.py).

Storage of one slot (rows of length d_v; a KDA unit is 1 row, a GDN unit d_k rows):
    ragged:  values [sum_l m_l, d_v]      layer l at row offset sum_{j<l} m_j
    padded:  values [L, max_l m_l, d_v]   layer l in rows [0, m_l) of its block, the rest padding
    INT8:    values int8 plus scales [rows] fp32;   conv windows [C_l, W-1] in the model dtype, uncompressed
`bytes_per_slot` equals the storage really allocated per slot and `layout.slot_bytes(...)` (tested).
"""

from __future__ import annotations

import torch

from app.cache.checkpoint import CheckpointCodec
from app.dasc.layout import slot_bytes
from app.dasc.plan import SelectionPlan
from app.models.batch import LinearStates
from kernels import pack


class DascCodec(CheckpointCodec):
    def __init__(self, template: LinearStates, plan: SelectionPlan, layout: str = "ragged", quant: str = "none"):
        if len(plan.layers) != len(template.ssm):
            raise ValueError("plan and model disagree on the number of recurrent layers")
        self.plan, self.layout, self.quant = plan, layout, quant
        self._conv_meta = [(c.shape[1:], c.dtype) for c in template.conv]
        self._ssm_shape = [s.shape[1:] for s in template.ssm]  # [H, K, V]
        self.rows = [retained_rows(lp) for lp in plan.layers]
        self.d_v = self._ssm_shape[0][-1]
        self._max_rows = max(len(r) for r in self.rows)
        self._offsets = [0]
        for r in self.rows:
            self._offsets.append(self._offsets[-1] + len(r))
        conv_bytes = sum(torch.Size(s).numel() * torch.tensor([], dtype=d).element_size() for s, d in self._conv_meta)
        self.accounting = slot_bytes(plan, layout, quant, conv_bytes)
        self.values = self.scales = None
        self.conv: list[torch.Tensor] = []

    @property
    def bytes_per_slot(self) -> int:
        return self.accounting.total

    @property
    def allocated_bytes_per_slot(self) -> int:
        """Measured from the tensors themselves (after `allocate`)."""
        tensors = [self.values, self.scales] + self.conv
        return sum(t.shape[1:].numel() * t.element_size() for t in tensors if t is not None)

    def allocate(self, num_slots: int) -> None:
        dtype = torch.int8 if self.quant == "int8" else torch.float32
        rows_shape = (self._offsets[-1],) if self.layout == "ragged" else (len(self.rows), self._max_rows)
        self.values = torch.zeros(num_slots, *rows_shape, self.d_v, dtype=dtype)
        self.scales = torch.zeros(num_slots, *rows_shape, dtype=torch.float32) if self.quant == "int8" else None
        self.conv = [torch.zeros(num_slots, *s, dtype=d) for s, d in self._conv_meta]

    def _block(self, t: torch.Tensor, slot: int, layer: int) -> torch.Tensor:
        """The storage rows of `layer` in `slot` (a view)."""
        if self.layout == "ragged":
            return t[slot, self._offsets[layer] : self._offsets[layer + 1]]
        return t[slot, layer, : len(self.rows[layer])]

    def store(self, slot: int, state: LinearStates) -> None:
        for j, rows in enumerate(self.rows):
            src = state.ssm[j][0].reshape(-1, self.d_v)
            values, scales = pack.pack_rows(src, rows.to(src.device), self.quant == "int8")
            self._block(self.values, slot, j).copy_(values)
            if scales is not None:
                self._block(self.scales, slot, j).copy_(scales)
        for dst, src in zip(self.conv, state.conv):
            dst[slot] = src[0]

    def load(self, slot: int) -> LinearStates:
        ssm = []
        for j, rows in enumerate(self.rows):
            h, k, v = self._ssm_shape[j]
            scales = None if self.scales is None else self._block(self.scales, slot, j)
            full = pack.unpack_rows(self._block(self.values, slot, j), scales, rows, h * k)
            ssm.append(full.view(1, h, k, v))
        return LinearStates([c[slot : slot + 1].clone() for c in self.conv], ssm)


def retained_rows(lp) -> torch.Tensor:
    """Row ids (of the [H * d_k, d_v] view) holding the layer's retained units."""
    if lp.kind == "kda":
        return torch.tensor(lp.keep, dtype=torch.long)
    return torch.tensor([h * lp.d_k + k for h in lp.keep for k in range(lp.d_k)], dtype=torch.long)

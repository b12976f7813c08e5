"""The dasc `CheckpointCodec`: stores only the retained rows of every layer's state, ragged or padded,
fp32 or INT8, and restores a full active state with the omitted units zero-filled (nr). The wr policy then
refreshes those zeros (app/dasc/policy.py).

Storage of one slot (rows of length d_v; a KDA unit is 1 row, a GDN unit d_k rows):
    ragged:  values [sum_l m_l, d_v]      layer l at row offset sum_{j<l} m_j
    padded:  values [L, max_l m_l, d_v]   layer l in rows [0, m_l) of its block, the rest padding
    INT8:    values int8 plus scales [rows] fp32;   conv windows: one flat row in the model dtype, uncompressed
`bytes_per_slot` equals the storage really allocated per slot and `layout.slot_bytes(...)` (tested).

On a GPU, where kernel launches rather than bytes bound a checkpoint copy, a store packs every layer in one
call (from the layers' states concatenated) and a load unpacks them in one call into one zero-filled
[sum_l R_l, d_v] buffer whose per-layer views form the state. On the CPU both go layer by layer: a store then
reads only the retained rows, and a load allocates per-layer buffers the allocator reuses. The two paths
write and restore the same bytes (tested).
"""

from __future__ import annotations

import torch

from app.cache.checkpoint import CheckpointCodec, FlatLayout
from app.dasc.layout import slot_bytes
from app.dasc.selection import SelectionPlan
from app.models.batch import LinearStates
from kernels import pack


class DascCodec(CheckpointCodec):
    def __init__(self, template: LinearStates, plan: SelectionPlan, layout: str = "ragged", quant: str = "none"):
        if len(plan.layers) != len(template.ssm):
            raise ValueError("plan and model disagree on the number of recurrent layers")
        self.plan, self.layout, self.quant = plan, layout, quant
        self.conv_layout = FlatLayout.of(template.conv)
        self._ssm_shape = [s.shape[1:] for s in template.ssm]  # [H, K, V]
        self.device = template.ssm[0].device
        self.d_v = self._ssm_shape[0][-1]
        if any(shape[-1] != self.d_v for shape in self._ssm_shape):
            raise ValueError("every recurrent layer must share d_v")
        # per layer, in its [H * K, d_v] view; index tensors live beside the storage
        self.rows = [retained_rows(lp, self.device) for lp in plan.layers]
        self._max_rows = max(len(r) for r in self.rows)
        self._offsets, self._state_offsets = [0], [0]  # packed rows and state rows before layer l
        for r, shape in zip(self.rows, self._ssm_shape):
            self._offsets.append(self._offsets[-1] + len(r))
            self._state_offsets.append(self._state_offsets[-1] + shape[:-1].numel())
        # the retained rows of the concatenated state, in packed order; for padded, where each sits in L * max_m
        self._all_rows = torch.cat([r + base for r, base in zip(self.rows, self._state_offsets)])
        self._padded_at = torch.cat([torch.arange(len(r), device=self.device) + j * self._max_rows
                                     for j, r in enumerate(self.rows)])
        self.accounting = slot_bytes(plan, layout, quant, self.conv_layout.nbytes)
        self.values = self.scales = self.conv = None

    @property
    def bytes_per_slot(self) -> int:
        return self.accounting.total

    @property
    def allocated_bytes_per_slot(self) -> int:
        """Measured from the tensors themselves (after `allocate`)."""
        tensors = [self.values, self.scales, self.conv]
        return sum(t.shape[1:].numel() * t.element_size() for t in tensors if t is not None)

    def allocate(self, num_slots: int) -> None:
        dtype = torch.int8 if self.quant == "int8" else torch.float32
        rows_shape = (self._offsets[-1],) if self.layout == "ragged" else (len(self.rows), self._max_rows)
        self.values = torch.zeros(num_slots, *rows_shape, self.d_v, dtype=dtype, device=self.device)
        self.scales = torch.zeros(num_slots, *rows_shape, dtype=torch.float32, device=self.device) \
            if self.quant == "int8" else None
        self.conv = self.conv_layout.zeros(num_slots)

    def slot_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.values, self.scales, self.conv) if t is not None]

    def _block(self, t: torch.Tensor, slot: int, layer: int) -> torch.Tensor:
        """The storage rows of `layer` in `slot` (a view)."""
        if self.layout == "ragged":
            return t[slot, self._offsets[layer] : self._offsets[layer + 1]]
        return t[slot, layer, : len(self.rows[layer])]

    def store(self, slot: int, state: LinearStates) -> None:
        if state.ssm[0].is_cuda:
            self._store_fused(slot, state)
        else:
            self._store_layers(slot, state)
        self.conv_layout.write(self.conv[slot], state.conv)

    def _store_layers(self, slot: int, state: LinearStates) -> None:
        for j, rows in enumerate(self.rows):
            src = state.ssm[j][0].reshape(-1, self.d_v)
            values, scales = pack.pack_rows(src, rows, self.quant == "int8")
            self._block(self.values, slot, j).copy_(values)
            if scales is not None:
                self._block(self.scales, slot, j).copy_(scales)

    def _store_fused(self, slot: int, state: LinearStates) -> None:
        src = torch.cat([s[0].reshape(-1, self.d_v) for s in state.ssm])
        values, scales = pack.pack_rows(src, self._all_rows, self.quant == "int8")
        self._put(self.values[slot], values)
        if scales is not None:
            self._put(self.scales[slot], scales)

    def _put(self, dst: torch.Tensor, packed: torch.Tensor) -> None:
        """Packed rows (ragged order) into one slot's storage."""
        if self.layout == "ragged":
            dst.copy_(packed)
        else:
            dst.flatten(0, 1).index_copy_(0, self._padded_at, packed)

    def _take(self, src: torch.Tensor) -> torch.Tensor:
        """One slot's storage as packed rows (ragged order)."""
        if self.layout == "ragged":
            return src
        return src.flatten(0, 1).index_select(0, self._padded_at)

    def load(self, slot: int) -> LinearStates:
        ssm = self._load_fused(slot) if self.values.is_cuda else self._load_layers(slot)
        return LinearStates(self.conv_layout.read(self.conv[slot]), ssm)

    def _load_layers(self, slot: int) -> list[torch.Tensor]:
        ssm = []
        for j, rows in enumerate(self.rows):
            h, k, v = self._ssm_shape[j]
            scales = None if self.scales is None else self._block(self.scales, slot, j)
            full = pack.unpack_rows(self._block(self.values, slot, j), scales, rows, h * k)
            ssm.append(full.view(1, h, k, v))
        return ssm

    def _load_fused(self, slot: int) -> list[torch.Tensor]:
        values = self._take(self.values[slot])
        scales = None if self.scales is None else self._take(self.scales[slot])
        full = pack.unpack_rows(values, scales, self._all_rows, self._state_offsets[-1])
        return [full[b:e].view(1, *shape)
                for b, e, shape in zip(self._state_offsets, self._state_offsets[1:], self._ssm_shape)]


def retained_rows(lp, device: torch.device | str = "cpu") -> torch.Tensor:
    """Row ids (of the [H * d_k, d_v] view) holding the layer's retained units."""
    rows = lp.keep if lp.kind == "kda" else [h * lp.d_k + k for h in lp.keep for k in range(lp.d_k)]
    return torch.tensor(rows, dtype=torch.long, device=device)

"""The dasc codec of one tensor-parallel rank, with stage 2 of TP-balanced placement (paper section 4.3).

Rank r holds the heads of its block of `placement.head_order` (the model was sharded with that order). On
store it packs its retained units [U_r, E] (E = d_v for a KDA channel, d_k * d_v for a GDN head), keeps the
first min(U_r, C) and sends the rest to the ranks `placement.moves` names, with one variable-split
`all_to_all_single`; every rank's slot then holds exactly C = `placement.width` units (zero padded). Load
runs the inverse transfer and restores the compute-local layout with omitted units zero-filled. With
placement `off`, nothing moves and C = max_r U_r. Conv windows stay local and uncompressed; INT8 (one scale
per stored row of d_v values) is applied to the slot after the move.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from app.cache.checkpoint import CheckpointCodec
from app.dasc.placement import Placement, split_sizes
from app.dasc.selection import SelectionPlan
from app.models.batch import LinearStates
from kernels.quant import dequantize_rows, quantize_rows


class PlacedDascCodec(CheckpointCodec):
    def __init__(self, template: LinearStates, plan: SelectionPlan, placement: Placement, rank: int,
                 quant: str = "none") -> None:
        self.plan, self.placement, self.rank, self.quant = plan, placement, rank, quant
        self._conv_meta = [(c.shape[1:], c.dtype) for c in template.conv]
        self._ssm_shape = [s.shape[1:] for s in template.ssm]  # local [H_r, K, V]
        self.device = template.ssm[0].device
        lp = plan.layers[0]
        self.d_v = lp.d_v
        self.unit_elems = lp.unit_elems
        self.rows_per_unit = 1 if lp.kind == "kda" else lp.d_k
        self.local_rows = [self._local_rows(j) for j in range(len(plan.layers))]
        self.units = sum(len(r) for r in self.local_rows) // self.rows_per_unit
        sizes = split_sizes(placement)  # units [src][dst]
        self.send = [sizes[rank][d] * self.unit_elems for d in range(placement.tp)]
        self.recv = [sizes[s][rank] * self.unit_elems for s in range(placement.tp)]
        self.keep = min(self.units, placement.width)
        self.values = self.scales = None
        self.conv: list[torch.Tensor] = []

    def _local_rows(self, j: int) -> torch.Tensor:
        """Rows of the local [H_r * d_k, d_v] state view holding this rank's retained units, in packed order."""
        lp = self.plan.layers[j]
        block = lp.heads // self.placement.tp
        heads = self.placement.head_order[j][self.rank * block : (self.rank + 1) * block]
        keep = set(lp.keep)
        rows = []
        for local, h in enumerate(heads):
            if lp.kind == "kda":
                rows += [local * lp.d_k + k for k in range(lp.d_k) if h * lp.d_k + k in keep]
            elif h in keep:
                rows += [local * lp.d_k + k for k in range(lp.d_k)]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def omitted_rows(self) -> list[torch.Tensor]:
        """Per layer, the rows of the local state that this rank does not store (what wr refreshes)."""
        out = []
        for j, kept in enumerate(self.local_rows):
            h, k, _ = self._ssm_shape[j]
            mask = torch.ones(h * k, dtype=torch.bool, device=self.device)
            mask[kept] = False
            out.append(torch.nonzero(mask).flatten())
        return out

    @property
    def bytes_per_slot(self) -> int:
        width = self.placement.width * self.unit_elems
        values = width * (1 if self.quant == "int8" else 4)
        scales = 4 * self.placement.width * self.rows_per_unit if self.quant == "int8" else 0
        conv = sum(torch.Size(s).numel() * torch.tensor([], dtype=d).element_size() for s, d in self._conv_meta)
        return values + scales + conv

    def allocate(self, num_slots: int) -> None:
        rows = self.placement.width * self.rows_per_unit
        dtype = torch.int8 if self.quant == "int8" else torch.float32
        self.values = torch.zeros(num_slots, rows, self.d_v, dtype=dtype, device=self.device)
        self.scales = torch.zeros(num_slots, rows, dtype=torch.float32, device=self.device) \
            if self.quant == "int8" else None
        self.conv = [torch.zeros(num_slots, *s, dtype=d, device=self.device) for s, d in self._conv_meta]

    def slot_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.values, self.scales) if t is not None] + list(self.conv)

    def store(self, slot: int, state: LinearStates) -> None:
        units = torch.cat([state.ssm[j][0].reshape(-1, self.d_v)[rows] for j, rows in enumerate(self.local_rows)])
        units = units.float().reshape(self.units, self.unit_elems)
        received = self._exchange(units[self.keep :].reshape(-1), self.send, self.recv)
        rows = units.new_zeros(self.placement.width, self.unit_elems)
        rows[: self.keep] = units[: self.keep]
        rows[self.keep : self.keep + received.numel() // self.unit_elems] = received.view(-1, self.unit_elems)
        rows = rows.view(-1, self.d_v)
        if self.quant == "int8":
            self.values[slot], self.scales[slot] = quantize_rows(rows)
        else:
            self.values[slot] = rows
        for dst, src in zip(self.conv, state.conv):
            dst[slot] = src[0]

    def load(self, slot: int) -> LinearStates:
        values = self.values[slot]
        rows = values.float() if self.scales is None else dequantize_rows(values, self.scales[slot])
        units = rows.reshape(self.placement.width, self.unit_elems)
        n_recv = sum(self.recv) // self.unit_elems
        back = self._exchange(units[self.keep : self.keep + n_recv].reshape(-1), self.recv, self.send)
        mine = torch.cat([units[: self.keep], back.view(-1, self.unit_elems)]).reshape(-1, self.d_v)
        ssm, lo = [], 0
        for j, local in enumerate(self.local_rows):
            h, k, v = self._ssm_shape[j]
            full = mine.new_zeros(h * k, v)
            full[local] = mine[lo : lo + len(local)]
            lo += len(local)
            ssm.append(full.view(1, h, k, v))
        return LinearStates([c[slot : slot + 1].clone() for c in self.conv], ssm)

    def _exchange(self, payload: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Variable-split all_to_all of a flat fp32 payload (no-op when nothing moves anywhere)."""
        if not self.placement.moves:
            return payload.new_zeros(0)
        out = payload.new_zeros(sum(recv))
        dist.all_to_all_single(out, payload.contiguous(), output_split_sizes=recv, input_split_sizes=send)
        return out

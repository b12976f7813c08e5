"""Slot layouts and exact byte accounting of one checkpoint (paper section 4.1, appendices B and C.1).

Temporal payload per unit: fp32 values (unit_elems * 4 bytes), or INT8 values plus one fp32 scale per
(head, k) (unit_elems + scales_per_unit * 4 bytes).
- ragged: layer l occupies r_l units at offset o_l; temporal = sum_l r_l units.
- padded: every layer reserves R_max = max_l r_l units; temporal = L * R_max units (padding counted).
Conv state is stored uncompressed (the paper: BF16; in our engine the model dtype) and split over TP ranks.
Under TP the bottleneck rank's bytes set the slot count: slots = floor(budget / bottleneck) - 1 (Eq. 8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.dasc.placement import Placement, plan_placement
from app.dasc.selection import SelectionPlan

LAYOUTS = ("ragged", "padded")
QUANTS = ("none", "int8")


def unit_bytes(plan: SelectionPlan, quant: str) -> int:
    """Bytes of one stored unit (all recurrent layers of a model share the unit kind)."""
    lp = plan.layers[0]
    if quant == "int8":
        return lp.unit_elems + 4 * lp.scales_per_unit
    if quant == "none":
        return 4 * lp.unit_elems
    raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")


@dataclass(frozen=True)
class SlotBytes:
    """Bytes of one checkpoint slot on the bottleneck rank: temporal (values + padding), scales, conv."""

    values: int
    padding: int
    scales: int
    conv: int

    @property
    def temporal(self) -> int:
        return self.values + self.padding + self.scales

    @property
    def total(self) -> int:
        return self.temporal + self.conv


def slot_units(plan: SelectionPlan, layout: str, tp: int = 1, placement: str = "off") -> tuple[int, int]:
    """(stored units incl. padding, padding units) per slot on the bottleneck rank."""
    if layout == "ragged":
        if tp == 1:
            return plan.retained_units, 0
        width = plan_placement(plan, tp, placement).width
        return width, 0
    if layout == "padded":
        if tp == 1:
            r_max = max(lp.r for lp in plan.layers)
            return len(plan.layers) * r_max, len(plan.layers) * r_max - plan.retained_units
        p = plan_placement(plan, tp, "off")
        per_rank_max = _per_rank_layer_max(plan, p)
        stored = len(plan.layers) * per_rank_max
        return stored, stored - max(p.local_units)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _per_rank_layer_max(plan: SelectionPlan, p: Placement) -> int:
    """Padded under TP: the widest (layer, rank) block pins every (layer, rank)."""
    best = 0
    for lp, order in zip(plan.layers, p.head_order):
        per_head = lp.retained_per_head()
        block = lp.heads // p.tp
        for r in range(p.tp):
            best = max(best, sum(per_head[h] for h in order[r * block : (r + 1) * block]))
    return best


def slot_bytes(plan: SelectionPlan, layout: str = "ragged", quant: str = "none", conv_bytes: int = 0,
               tp: int = 1, placement: str = "off") -> SlotBytes:
    """Exact bytes of one slot on the bottleneck rank. conv_bytes: the whole model's conv state (all ranks)."""
    if quant not in QUANTS:  # anything else would silently be accounted (and stored) as fp32
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    stored, pad = slot_units(plan, layout, tp, placement)
    lp = plan.layers[0]
    per_value = 1 if quant == "int8" else 4
    scales = 4 * lp.scales_per_unit * stored if quant == "int8" else 0
    values = (stored - pad) * lp.unit_elems * per_value
    return SlotBytes(values, pad * lp.unit_elems * per_value, scales, math.ceil(conv_bytes / tp))


def slots_for_budget(budget_bytes: int, bottleneck_bytes: int) -> int:
    """Paper Eq. 8: floor(budget / bottleneck) - 1 (slot 0 reserved)."""
    return max(budget_bytes // bottleneck_bytes - 1, 0)

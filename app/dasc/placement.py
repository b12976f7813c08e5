"""TP placement of compressed checkpoints (paper section 4.3).

Heads of every recurrent layer split evenly over T ranks in bundles (a KDA head, or a GDN key head with its
value heads). U_r = retained units on rank r. Every rank's checkpoint slot has the same width, so the
bottleneck rank decides how many slots fit.

- off:       no movement; width = max_r U_r.
- storage:   stage 2 only: width C = ceil(sum_r U_r / T); ranks above C send their last packed units to ranks
             below C (variable-split all_to_all on store, its inverse on load).
- balanced:  stage 1 first permutes head bundles across ranks at load time (exact reindexing of every coupled
             tensor, no per-token communication) to even out U_r, then stage 2 as above: same width C, fewer
             units moved.

Per-rank packed order (compute-local): layers in order, within a layer the owned heads in rank order, within
a head its retained units ascending.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.dasc.plan import SelectionPlan

MODES = ("off", "storage", "balanced")


@dataclass(frozen=True)
class Placement:
    mode: str
    tp: int
    head_order: tuple[tuple[int, ...], ...]  # per layer: heads in rank-major order (rank r owns a contiguous block)
    local_units: tuple[int, ...]  # U_r after stage 1
    width: int  # units per rank per slot
    moves: tuple[tuple[int, int, int], ...]  # (src rank, dst rank, units) of stage 2

    @property
    def bottleneck_units(self) -> int:
        return self.width

    def units_moved(self) -> int:
        return sum(n for _, _, n in self.moves)

    def sent_by_rank(self) -> list[int]:
        out = [0] * self.tp
        for src, _, n in self.moves:
            out[src] += n
        return out

    def received_by_rank(self) -> list[int]:
        out = [0] * self.tp
        for _, dst, n in self.moves:
            out[dst] += n
        return out


def plan_placement(plan: SelectionPlan, tp: int, mode: str) -> Placement:
    if mode not in MODES:
        raise ValueError(f"placement must be one of {MODES}, got {mode!r}")
    for lp in plan.layers:
        bundles = lp.heads // lp.bundle
        if lp.heads % lp.bundle or bundles % tp:
            raise ValueError(f"layer {lp.layer}: {bundles} head bundles ({lp.heads} heads in bundles of "
                             f"{lp.bundle}) do not divide over TP size {tp}")
    orders = _balanced_orders(plan, tp) if mode == "balanced" else tuple(tuple(range(lp.heads)) for lp in plan.layers)
    local = _local_units(plan, orders, tp)
    if mode == "off":
        return Placement(mode, tp, orders, local, max(local), ())
    width = math.ceil(sum(local) / tp)
    return Placement(mode, tp, orders, local, width, _stage2_moves(local, width))


def _local_units(plan: SelectionPlan, orders, tp: int) -> tuple[int, ...]:
    units = [0] * tp
    for lp, order in zip(plan.layers, orders):
        per_head = lp.retained_per_head()
        block = lp.heads // tp
        for pos, head in enumerate(order):
            units[pos // block] += per_head[head]
    return tuple(units)


def _balanced_orders(plan: SelectionPlan, tp: int) -> tuple[tuple[int, ...], ...]:
    """Stage 1: per layer, assign bundles (heaviest first) to the lightest rank with room in that layer."""
    totals = [0] * tp
    orders = []
    for lp in plan.layers:
        per_head = lp.retained_per_head()
        bundles = [list(range(b * lp.bundle, (b + 1) * lp.bundle)) for b in range(lp.heads // lp.bundle)]
        weight = {b: sum(per_head[h] for h in heads) for b, heads in enumerate(bundles)}
        room = [len(bundles) // tp] * tp
        owned: list[list[int]] = [[] for _ in range(tp)]
        for b in sorted(weight, key=lambda b: (-weight[b], b)):
            r = min((r for r in range(tp) if room[r]), key=lambda r: (totals[r], r))
            owned[r].append(b)
            room[r] -= 1
            totals[r] += weight[b]
        orders.append(tuple(h for r in range(tp) for b in sorted(owned[r]) for h in bundles[b]))
    return tuple(orders)


def _stage2_moves(local: tuple[int, ...], width: int) -> tuple[tuple[int, int, int], ...]:
    """Surplus of ranks above `width` fills ranks below it, both in rank order."""
    surplus = [(r, u - width) for r, u in enumerate(local) if u > width]
    deficit = [[r, width - u] for r, u in enumerate(local) if u < width]
    moves = []
    d = 0
    for src, extra in surplus:
        while extra:
            dst, room = deficit[d]
            n = min(extra, room)
            moves.append((src, dst, n))
            extra -= n
            deficit[d][1] -= n
            if deficit[d][1] == 0:
                d += 1
    return tuple(moves)

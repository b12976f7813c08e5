"""TP placement of compressed checkpoints (paper section 4.3).

Heads of every recurrent layer split evenly over T ranks in bundles (a KDA head, or a GDN key head with its
value heads). U_r = retained units on rank r. Every rank's checkpoint slot has the same width, so the
bottleneck rank decides how many slots fit.

- off:       no movement; width = max_r U_r.
- storage:   stage 2 only: width C = ceil(sum_r U_r / T); ranks above C send their last packed units to ranks
             below C (variable-split all_to_all on store, its inverse on load).
- balanced:  stage 1 first permutes head bundles across ranks at load time (exact reindexing of every coupled
             tensor, no per-token communication) to even out U_r, then stage 2 as above: same width C, never
             more units moved than `storage` (the greedy permutation is kept only when it moves fewer).

Per-rank packed order (compute-local): layers in order, within a layer the owned heads in rank order, within
a head its retained units ascending.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from app.dasc.selection import SelectionPlan

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


def plan_placement(plan: SelectionPlan, tp: int, mode: str,
                   head_order: tuple[tuple[int, ...], ...] | None = None) -> Placement:
    """`head_order` fixes stage 1 (the permutation a loaded model was sharded with); stage 2 still balances."""
    if mode not in MODES:
        raise ValueError(f"placement must be one of {MODES}, got {mode!r}")
    for lp in plan.layers:
        bundles = lp.heads // lp.bundle
        if lp.heads % lp.bundle or bundles % tp:
            raise ValueError(f"layer {lp.layer}: {bundles} head bundles ({lp.heads} heads in bundles of "
                             f"{lp.bundle}) do not divide over TP size {tp}")
    orders = head_order or tuple(tuple(range(lp.heads)) for lp in plan.layers)
    local = _local_units(plan, orders, tp)
    if mode == "off":
        return Placement(mode, tp, orders, local, max(local), ())
    width = math.ceil(sum(local) / tp)  # stage 1 permutes heads, so sum(U_r) and the width do not change
    if mode == "balanced" and head_order is None:  # greedy stage 1 can lose to identity: keep what moves less
        greedy = _balanced_orders(plan, tp)
        greedy_local = _local_units(plan, greedy, tp)
        if _surplus(greedy_local, width) < _surplus(local, width):
            orders, local = greedy, greedy_local
    return Placement(mode, tp, orders, local, width, _stage2_moves(local, width))


def _surplus(local: tuple[int, ...], width: int) -> int:
    """Units stage 2 must move: everything above the width."""
    return sum(max(u - width, 0) for u in local)


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


# ---------------------------------------------------------------------------------------------------------
# Single-process simulation of stage 2 (what the TP workers do with a variable-split all_to_all).
#
#   rank r, compute-local buffer [U_r, E]:  | kept: first min(U_r, C) units | surplus: U_r - C units (if any) |
#   rank r, slot [C, E]:                    | kept | received, in `moves` order | zero padding up to C |
#
# A sender's surplus goes out in consecutive chunks, one per move of that sender, in `moves` order; a receiver
# appends what it gets in the same order. `moves` is sorted by (src, dst) with one entry per pair, so this is
# exactly the rank-ordered concatenation of `all_to_all_single(input_split_sizes=split_sizes(p)[src])`.
# Load is the inverse: every receiver returns each chunk to its sender, which appends it after its kept units.
# E = unit_elems: a KDA unit is one row [d_v], a GDN unit is one head [d_k * d_v].
# ---------------------------------------------------------------------------------------------------------


class RankTraffic(NamedTuple):
    """Bytes each rank sends and receives on store (load swaps the two)."""

    sent: list[int]
    received: list[int]


def split_sizes(placement: Placement) -> list[list[int]]:
    """[src][dst] units sent on store: the all_to_all split sizes (zero on the diagonal)."""
    out = [[0] * placement.tp for _ in range(placement.tp)]
    for src, dst, n in placement.moves:
        out[src][dst] += n
    return out


def traffic_bytes(placement: Placement, unit_bytes: int) -> RankTraffic:
    """Per-rank store traffic for units of `unit_bytes` (layout.unit_bytes: fp32 or INT8 with scales)."""
    return RankTraffic([n * unit_bytes for n in placement.sent_by_rank()],
                       [n * unit_bytes for n in placement.received_by_rank()])


def _rank_units(plan: SelectionPlan, placement: Placement, layer: int, rank: int) -> list[int]:
    """Retained unit ids of `layer` owned by `rank`, in packed order (heads in head_order, units ascending)."""
    lp = plan.layers[layer]
    block = lp.heads // placement.tp
    heads = placement.head_order[layer][rank * block : (rank + 1) * block]
    per = lp.units_per_head
    keep = set(lp.keep)
    return [u for h in heads for u in range(h * per, (h + 1) * per) if u in keep]


def _unit_elems(plan: SelectionPlan) -> int:
    sizes = {lp.unit_elems for lp in plan.layers}
    if len(sizes) != 1:
        raise ValueError(f"all recurrent layers must share one unit size, got {sorted(sizes)}")
    return sizes.pop()


def pack_per_rank(plan: SelectionPlan, placement: Placement, state_rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """state_rows[l]: layer l's state as rows [H * d_k, d_v] -> per rank its packed retained units [U_r, E]."""
    elems = _unit_elems(plan)
    out = []
    for r in range(placement.tp):
        parts = []
        for j, (lp, rows) in enumerate(zip(plan.layers, state_rows)):
            units = rows.reshape(lp.n, lp.unit_elems)  # a GDN head's d_k rows are contiguous
            parts.append(units[_rank_units(plan, placement, j, r)])
        out.append(torch.cat(parts) if parts else state_rows[0].new_zeros(0, elems))
    return out


def unpack_per_rank(plan: SelectionPlan, placement: Placement, per_rank: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of `pack_per_rank`: full per-layer rows [H * d_k, d_v], omitted units zero-filled."""
    cursor = [0] * placement.tp
    out = []
    for j, lp in enumerate(plan.layers):
        units = per_rank[0].new_zeros(lp.n, lp.unit_elems)
        for r in range(placement.tp):
            ids = _rank_units(plan, placement, j, r)
            units[ids] = per_rank[r][cursor[r] : cursor[r] + len(ids)]
            cursor[r] += len(ids)
        out.append(units.reshape(lp.heads * lp.d_k, lp.d_v))
    return out


def store_move(placement: Placement, per_rank: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stage 2 on store: compute-local buffers [U_r, E] -> slot buffers [width, E] on every rank."""
    width = placement.width
    for r, (buf, u) in enumerate(zip(per_rank, placement.local_units)):
        if buf.shape[0] != u:
            raise ValueError(f"rank {r}: buffer holds {buf.shape[0]} units, placement expects {u}")
    slots = [[buf[:width]] for buf in per_rank]
    cursor = [width] * placement.tp  # next surplus unit of each sender
    for src, dst, n in placement.moves:
        slots[dst].append(per_rank[src][cursor[src] : cursor[src] + n])
        cursor[src] += n
    for r, u in enumerate(placement.local_units):
        if u > width and cursor[r] != u:
            raise ValueError(f"rank {r}: moves send {cursor[r] - width} of its {u - width} surplus units")
    out = []
    for parts in slots:
        filled = torch.cat(parts)
        if filled.shape[0] > width:
            raise ValueError(f"moves overfill a rank: {filled.shape[0]} units for width {width}")
        out.append(torch.cat([filled, filled.new_zeros(width - filled.shape[0], filled.shape[1])]))
    return out


def load_move(placement: Placement, slots: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of `store_move`: slot buffers [width, E] -> compute-local buffers [U_r, E]."""
    width = placement.width
    kept = [min(u, width) for u in placement.local_units]
    parts = [[s[:k]] for s, k in zip(slots, kept)]
    cursor = list(kept)  # next received unit on each receiver
    for src, dst, n in placement.moves:
        parts[src].append(slots[dst][cursor[dst] : cursor[dst] + n])
        cursor[dst] += n
    return [torch.cat(p) for p in parts]

"""TP placement: slot widths, moves, and an exact pack -> store_move -> load_move -> unpack round trip."""

from __future__ import annotations

import math

import pytest
import torch

from app.dasc.codec import retained_rows
from app.dasc.placement import (
    MODES,
    load_move,
    pack_per_rank,
    plan_placement,
    split_sizes,
    store_move,
    traffic_bytes,
    unpack_per_rank,
)
from app.dasc.selection import LayerPlan, SelectionPlan, decay_plan
from app.models.geometry import UnitGeometry
from tests.dasc.common import GDN, KDA, random_horizons, sample_plans

KDA8 = [UnitGeometry(i, "kda", 8, 4, 4) for i in range(4)]
GDN8 = [UnitGeometry(i, "gdn", 16, 4, 4, bundle=2) for i in range(3)]


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("geometry", [KDA8, GDN8], ids=["kda", "gdn"])
def test_placement_widths_and_moves(geometry, tp):
    fewer = 0  # plans where stage 1 really helps
    for plan in sample_plans(geometry, seeds=range(6)):
        placements = {m: plan_placement(plan, tp, m) for m in MODES}
        storage_local = tuple(sum(sum(lp.retained_per_head()[r * lp.heads // tp : (r + 1) * lp.heads // tp])
                                  for lp in plan.layers) for r in range(tp))
        c = math.ceil(plan.retained_units / tp)
        assert placements["off"].local_units == placements["storage"].local_units == storage_local
        assert placements["off"].width == max(storage_local) and placements["off"].moves == ()
        for m in ("storage", "balanced"):
            p = placements[m]
            assert p.width == c and sum(p.local_units) == plan.retained_units
            assert p.units_moved() == sum(max(u - c, 0) for u in p.local_units)
            assert all(p.local_units[s] > c > p.local_units[d] for s, d, _ in p.moves)  # only surplus moves
            assert [(s, d) for s, d, _ in p.moves] == sorted({(s, d) for s, d, _ in p.moves})  # all_to_all order
            after = [u - s + r for u, s, r in zip(p.local_units, p.sent_by_rank(), p.received_by_rank())]
            assert max(after) <= c and all(a == c for a, u in zip(after, p.local_units) if u >= c)
            sizes = split_sizes(p)
            assert [sum(row) for row in sizes] == p.sent_by_rank() and all(sizes[r][r] == 0 for r in range(tp))
        assert placements["balanced"].units_moved() <= placements["storage"].units_moved()
        fewer += placements["balanced"].units_moved() < placements["storage"].units_moved()
        for lp, order in zip(plan.layers, placements["balanced"].head_order):
            assert sorted(order) == list(range(lp.heads))
            block = lp.heads // tp
            for r in range(tp):  # bundles stay whole on one rank
                owned = set(order[r * block : (r + 1) * block])
                assert all({b - b % lp.bundle + i for i in range(lp.bundle)} <= owned for b in owned)
        for m, p in placements.items():
            t = traffic_bytes(p, 136)
            assert t.sent == [136 * n for n in p.sent_by_rank()] and sum(t.sent) == sum(t.received)
            assert sum(t.sent) == 136 * p.units_moved() and (m != "off" or sum(t.sent) == 0)
    assert fewer > 0


def test_balanced_never_moves_more_than_storage_when_greedy_loses():
    """Retained units per head [0, 0, 0, 1] and [2, 2, 0, 3] at TP 2: the identity split is already even
    (4, 4), while heaviest-first greedy over the layers ends at (5, 3); balanced must keep the identity."""
    counts = [(0, 0, 0, 1), (2, 2, 0, 3)]
    layers = tuple(LayerPlan(i, "kda", 4, 4, 4, tuple(h * 4 + k for h, n in enumerate(c) for k in range(n)),
                             (1.0,) * 16) for i, c in enumerate(counts))
    plan = SelectionPlan(16.0, "decay", layers)
    storage, balanced = plan_placement(plan, 2, "storage"), plan_placement(plan, 2, "balanced")
    assert storage.local_units == (4, 4) and storage.units_moved() == 0
    assert balanced.width == 4 and balanced.units_moved() == 0


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("geometry", [KDA8, GDN8], ids=["kda", "gdn"])
def test_placement_round_trip_is_exact(geometry, tp):
    for plan in sample_plans(geometry, seeds=range(3)):
        # every row a distinct nonzero value per element, so a misplaced unit cannot go unnoticed
        full, start = [], 1
        for lp in plan.layers:
            full.append(torch.arange(start, start + lp.heads * lp.d_k * lp.d_v, dtype=torch.float32)
                        .reshape(lp.heads * lp.d_k, lp.d_v))
            start += full[-1].numel()
        for mode in MODES:
            p = plan_placement(plan, tp, mode)
            local = pack_per_rank(plan, p, full)
            assert [b.shape[0] for b in local] == list(p.local_units)
            slots = store_move(p, local)
            assert all(s.shape == (p.width, plan.layers[0].unit_elems) for s in slots)
            stored = torch.cat(slots)
            real = stored[stored.abs().sum(-1) > 0]
            assert real.shape[0] == plan.retained_units  # every retained unit once, the rest zero padding
            assert torch.equal(real[:, 0].sort().values, torch.cat(local)[:, 0].sort().values)
            back = load_move(p, slots)
            assert all(torch.equal(a, b) for a, b in zip(back, local))
            rows = unpack_per_rank(plan, p, back)
            for lp, got, want in zip(plan.layers, rows, full):
                keep = retained_rows(lp)
                omitted = torch.ones(got.shape[0], dtype=torch.bool)
                omitted[keep] = False
                assert torch.equal(got[keep], want[keep]) and torch.count_nonzero(got[omitted]) == 0


def test_placement_rejects_head_counts_that_do_not_divide():
    kda = decay_plan(KDA, random_horizons(KDA, 0), 16)
    with pytest.raises(ValueError, match=r"4 head bundles \(4 heads in bundles of 1\).*TP size 8"):
        plan_placement(kda, 8, "balanced")
    gdn = decay_plan(GDN, random_horizons(GDN, 0), 16)  # 4 value heads in 2 bundles: TP 2 works, TP 4 does not
    assert plan_placement(gdn, 2, "storage").tp == 2
    with pytest.raises(ValueError, match=r"2 head bundles \(4 heads in bundles of 2\).*TP size 4"):
        plan_placement(gdn, 4, "off")
    odd = decay_plan([UnitGeometry(0, "kda", 6, 4, 4)], [torch.rand(6, 4) * 100], 16)
    with pytest.raises(ValueError, match=r"6 head bundles.*TP size 4"):
        plan_placement(odd, 4, "storage")
    with pytest.raises(ValueError, match="placement must be one of"):
        plan_placement(kda, 2, "greedy")

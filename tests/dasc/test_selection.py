"""Selection plans keep exactly the units whose static horizon exceeds W_max; the random selector is
count-matched."""

from __future__ import annotations

import json
import math

import pytest
import torch

from app.dasc.selection import SelectionPlan, decay_plan, make_plan, random_plan
from tests.dasc.common import GDN, KDA, random_horizons, sample_plans


def test_decay_plan_keeps_exactly_the_units_above_w_max():
    for geometry in (KDA, GDN):
        horizons = random_horizons(geometry, 0)
        horizons[0].view(-1)[:3] = torch.tensor([16.0, math.nextafter(16.0, math.inf), 15.999],
                                                   dtype=torch.float64)  # the boundary
        for w in (16, 64, 512):
            plan = decay_plan(geometry, horizons, w)
            assert plan.w_max == w and plan.selector == "decay"
            for lp, h in zip(plan.layers, horizons):
                assert list(lp.keep) == torch.nonzero(h.reshape(-1) > w).flatten().tolist()
                assert lp.keep_mask().sum().item() == lp.r and lp.n == h.numel()
                assert sum(lp.retained_per_head()) == lp.r
            if w == 16:  # 16 itself is local, the next float above it global
                assert plan.layers[0].keep[0] == 1 and plan.layers[0].horizons[0] == 16.0
        dense = decay_plan(geometry, horizons, 0)
        assert dense.is_dense and dense.retained_fraction == 1.0
        assert all(lp.keep == tuple(range(lp.n)) for lp in dense.layers)
        assert dense.offsets == tuple(sum(lp.n for lp in dense.layers[:i]) for i in range(len(geometry) + 1))


def test_random_plan_is_count_matched_and_seeded():
    for geometry in (KDA, GDN):
        plan = decay_plan(geometry, random_horizons(geometry, 1), 64)
        a, b, c = random_plan(plan, 7), random_plan(plan, 7), random_plan(plan, 8)
        assert a == b and a.selector == "random:7"
        assert a != c, "a different seed should draw different units"
        for lp, ra in zip(plan.layers, a.layers):
            assert ra.r == lp.r and ra.n == lp.n and ra.horizons == lp.horizons
            assert list(ra.keep) == sorted(set(ra.keep)) and all(0 <= u < ra.n for u in ra.keep)
        assert make_plan(geometry, random_horizons(geometry, 1), 64, "random:7") == a
        with pytest.raises(ValueError, match="selector"):
            make_plan(geometry, random_horizons(geometry, 1), 64, "topk")


def test_plan_dict_and_json_round_trip():
    for geometry in (KDA, GDN):
        for plan in sample_plans(geometry, seeds=[2]):
            d = plan.to_dict()
            assert d["n"] == [lp.n for lp in plan.layers] and d["r"] == [lp.r for lp in plan.layers]
            assert SelectionPlan.from_dict(d) == plan
            assert SelectionPlan.from_dict(json.loads(plan.to_json())) == plan

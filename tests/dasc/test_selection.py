"""Selection plans keep exactly the units whose static horizon exceeds W_max; the random selector is
count-matched."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from app.cache.checkpoint import CheckpointPool, DenseCodec, physical_slots
from app.dasc.codec import DascCodec, retained_rows
from app.dasc.horizons import EPS, STATIC_A, model_geometry, model_horizons
from app.dasc.layout import slot_bytes, slots_for_budget
from app.dasc.placement import (MODES, load_move, pack_per_rank, plan_placement, split_sizes, store_move,
                                traffic_bytes, unpack_per_rank)
from app.dasc.selection import LayerPlan, SelectionPlan, UnitGeometry, decay_plan, make_plan, random_plan
from app.dasc.policy import local_rows, refresh_local_units, unit_window, wr_window
from kernels.quant import dequantize_rows, quantize_rows
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.models.batch import BatchLayout, ContiguousKV, LinearStates
from app.models.loader import ZOO_DIR, load_model
from app.models.tokenizer import Tokenizer
from tests.dasc.common import KDA, GDN, random_horizons, sample_plans


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

"""Static horizons of a zoo model follow the static gate (paper Eq. 2-3)."""

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


def test_model_horizons_follow_the_static_gate():
    model = load_model(ZOO_DIR / "kda-tiny")
    mixer = model.model.layers[model.linear_layers[0]].mixer.forget_gate
    A, dt = mixer.A_log.detach().double().exp().flatten(), mixer.dt_bias.detach().double().reshape(4, 32)
    want = math.log(EPS) / (-A[:, None] * torch.nn.functional.softplus(STATIC_A + dt))
    got = model_horizons(model)
    assert torch.allclose(got[0], want, rtol=1e-12) and len(got) == len(model.linear_layers)
    assert all(g.kind == "kda" and (g.heads, g.d_k, g.bundle) == (4, 32, 1) for g in model_geometry(model))

"""Static horizons of a zoo model follow the static gate (paper Eq. 2-3)."""

from __future__ import annotations

import math

import torch

from app.dasc.horizons import EPS, STATIC_A, model_geometry, model_horizons
from app.models.loader import ZOO_DIR, load_model


def test_model_horizons_follow_the_static_gate():
    model = load_model(ZOO_DIR / "kda-tiny")
    mixer = model.model.layers[model.linear_layers[0]].mixer.forget_gate
    A, dt = mixer.A_log.detach().double().exp().flatten(), mixer.dt_bias.detach().double().reshape(4, 32)
    want = math.log(EPS) / (-A[:, None] * torch.nn.functional.softplus(STATIC_A + dt))
    got = model_horizons(model)
    assert torch.allclose(got[0], want, rtol=1e-12) and len(got) == len(model.linear_layers)
    assert all(g.kind == "kda" and (g.heads, g.d_k, g.bundle) == (4, 32, 1) for g in model_geometry(model))

"""Static horizons follow the paper's static gate (Eq. 2-3): g = -exp(A_log) * softplus(a + dt_bias) with the
input logit fixed at a = -0.3, and H_s = ln(eps) / g with eps = 1e-3. The expected values come from those
constants written here, not from the module under test."""

from __future__ import annotations

import math

import torch

from app.dasc.horizons import model_geometry, model_horizons, static_horizons
from app.models.loader import ZOO_DIR, load_model

PAPER_A = -0.3
PAPER_EPS = 1e-3


def test_static_horizons_by_hand():
    """A_log = 0, dt_bias = 0.3: g = -softplus(0) = -ln 2, H_s = ln(1e-3) / -ln 2 = 9.9658...;
    A_log = ln 2, dt_bias = 0.3 + ln(e - 1): g = -2 * softplus(ln(e - 1)) = -2, H_s = ln(1000) / 2 = 3.4538...;
    A_log = 0, dt_bias = -0.7: g = -softplus(-1) = -0.31326..., H_s = 22.0510..."""
    gdn = static_horizons(torch.tensor([0.0, math.log(2.0)]), torch.tensor([0.3, 0.3 + math.log(math.e - 1)]))
    assert gdn.shape == (2,) and gdn.dtype == torch.float64
    assert torch.allclose(gdn, torch.tensor([9.965784284662087, 3.4538776394910684], dtype=torch.float64))
    kda = static_horizons(torch.zeros(1), torch.tensor([0.3, -0.7]))  # one head, two key channels
    assert kda.shape == (1, 2)
    assert torch.allclose(kda, torch.tensor([[9.965784284662087, 22.051069614378882]], dtype=torch.float64))


def test_model_horizons_follow_the_static_gate():
    model = load_model(ZOO_DIR / "kda-tiny")
    mixer = model.model.layers[model.linear_layers[0]].mixer.forget_gate
    A, dt = mixer.A_log.detach().double().exp().flatten(), mixer.dt_bias.detach().double().reshape(4, 32)
    want = math.log(PAPER_EPS) / (-A[:, None] * torch.nn.functional.softplus(PAPER_A + dt))
    got = model_horizons(model)
    assert torch.allclose(got[0], want, rtol=1e-12) and len(got) == len(model.linear_layers)
    assert all(g.kind == "kda" and (g.heads, g.d_k, g.bundle) == (4, 32, 1) for g in model_geometry(model))

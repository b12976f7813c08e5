"""Retention horizons of recurrent state units (paper section 3.3, Eq. 2-3).

Static gate:   g = -exp(A_log) * softplus(a + dt_bias), with the input logit fixed at a = -0.3
Static horizon: H_s = ln(eps) / g, eps = 1e-3: the tokens it takes the decay factor e^(g * eta) to reach eps.
Units: GDN one head (A_log, dt_bias per value head); KDA one key channel of one head (A_log per head,
dt_bias per (head, channel)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from app.models.geometry import UnitGeometry

STATIC_A = -0.3
EPS = 1e-3


def static_horizons(A_log: torch.Tensor, dt_bias: torch.Tensor, a: float = STATIC_A, eps: float = EPS) -> torch.Tensor:
    """A_log: H values (any shape); dt_bias: H (GDN) or H * K (KDA) values -> horizons [H] or [H, K] (fp64)."""
    A = A_log.detach().double().exp().flatten()
    dt = dt_bias.detach().double().reshape(A.numel(), -1)
    g = -A[:, None] * F.softplus(a + dt)
    h = math.log(eps) / g
    return h[:, 0] if h.shape[1] == 1 else h


def model_geometry(model) -> list[UnitGeometry]:
    """UnitGeometry of every linear-attention layer of one of our models (KDA: per channel, GDN: per head): the
    geometry its family config derived, as the mixers hold it (a TP shard's mixers hold their rank's share)."""
    return [model.model.layers[i].mixer.geometry.units for i in model.linear_layers]


def model_horizons(model) -> list[torch.Tensor]:
    """Static horizons of every linear layer's units: [H, K] for KDA, [H] for GDN."""
    out = []
    for i in model.linear_layers:
        mixer = model.model.layers[i].mixer
        holder = getattr(mixer, "forget_gate", mixer)  # KDA keeps its decay parameters on the forget gate
        out.append(static_horizons(holder.A_log, holder.dt_bias))
    return out

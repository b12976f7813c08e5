"""Weight initialisation for training from scratch, with decay parameters that give dasc something to do.

Static horizon of a recurrent unit (docs/design.md): g = -exp(A_log) * softplus(a + dt_bias) at a = -0.3 and
H_s = ln(1e-3) / g. The paper's trained models show (section 3.3):
  KDA channels: per-token decay alpha = exp(g) median 0.471, IQR [0.170, 0.774]  -> H_s ~ 9 tokens, IQR [4, 27]
  GDN heads:    alpha median 0.969, IQR [0.894, 0.997]                          -> H_s ~ 220, IQR [62, 2300]
`init_decay` draws ln(-g) from a normal with that median and IQR per unit, keeps A in U(1, 16) per head as
flash-linear-attention does, and solves dt_bias = softplus^-1(-g / A) + 0.3 so the static gate hits the draw.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from app.dasc.horizons import STATIC_A
from app.models.hybrid import HybridForCausalLM
from app.models.kimi_linear import KimiTopkRouter
from app.models.layers import Experts, RMSNorm, RMSNormGated
from app.models.qwen3_next import TopKRouter

# (median, IQR low, IQR high) of the per-token decay alpha = exp(g), paper section 3.3
DECAY_PROFILES = {"kimi_linear": (0.471, 0.170, 0.774), "qwen3_next": (0.969, 0.894, 0.997)}
DECAY_PROFILES["qwen3_5"] = DECAY_PROFILES["qwen3_next"]  # the same Gated DeltaNet


def init_weights(model: HybridForCausalLM, std: float = 0.02, seed: int = 0) -> None:
    """Normal(0, std) linear and embedding weights, identity norms, scaled residual output projections, and routers
    whose logits spread over a few units (std 4 / sqrt(hidden): a confident choice, as trained routers make; one
    left at zero would score every expert alike, its top-k ties broken by index)."""
    gen = torch.Generator().manual_seed(seed)
    n_layers = len(model.model.layers)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                s = std / math.sqrt(2 * n_layers) if name.endswith(("o_proj", "out_proj", "down_proj")) else std
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * s)
            elif isinstance(module, nn.Conv1d):
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[-1]))
            elif isinstance(module, Experts):
                module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=gen) * std)
                scale = std / math.sqrt(2 * n_layers)
                module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=gen) * scale)
            elif isinstance(module, (TopKRouter, KimiTopkRouter)):
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=gen) * 4 / math.sqrt(w.shape[1]))
            elif isinstance(module, RMSNorm):
                module.weight.fill_(0.0 if module.unit_offset else 1.0)
            elif isinstance(module, RMSNormGated):
                module.weight.fill_(1.0)
    init_decay(model, seed=seed)


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def init_decay(model: HybridForCausalLM, seed: int = 0) -> None:
    """Set every linear layer's A_log and dt_bias so static horizons follow the family's paper profile."""
    median, lo, hi = DECAY_PROFILES[model.config.model_type]
    mu = math.log(-math.log(median))
    sigma = (math.log(-math.log(lo)) - math.log(-math.log(hi))) / 1.349  # IQR of a normal is 1.349 sigma
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for i in model.linear_layers:
            mixer = model.model.layers[i].mixer
            holder = getattr(mixer, "forget_gate", mixer)  # KDA keeps them on its forget gate
            a_log, dt_bias = holder.A_log, holder.dt_bias
            heads = a_log.numel()
            per_head = dt_bias.numel() // heads
            A = torch.empty(heads).uniform_(1.0, 16.0, generator=gen)
            neg_g = torch.exp(mu + sigma * torch.randn(heads, per_head, generator=gen)).clamp(1e-5, 30.0)
            dt = _inverse_softplus((neg_g / A[:, None]).clamp_min(1e-6)) - STATIC_A
            a_log.copy_(A.log().view(a_log.shape))
            dt_bias.copy_(dt.reshape(dt_bias.shape))

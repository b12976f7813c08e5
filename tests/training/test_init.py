"""Weight initialisation (app/training/init.py): every parameter a random model's forward reads is drawn."""

from __future__ import annotations

import torch

from app.models.loader import build_model
from app.training.init import init_weights
from loadtest.synth_model import qwen3_5_config


def test_routers_are_drawn_so_that_experts_do_not_tie():
    """A router left at zero scored every expert alike, its top-k ties broken by index (a random MoE checkpoint
    then agreed with llama-server on 0 of 32 tokens): drawn, with logits spread over a few units."""
    model = build_model(qwen3_5_config(64, 2, 4, 2, 16, 2, 4, 16, 32, experts=8))
    init_weights(model, seed=0)
    router = model.model.layers[0].mlp.gate.weight
    logits = torch.randn(256, 64) @ router.T  # unit-variance inputs, as after the norm
    assert 2 < logits.std().item() < 6
    top = logits.topk(3, dim=-1).values
    assert (top[:, 1] - top[:, 2]).min().item() > 1e-4  # no ties among the top choices

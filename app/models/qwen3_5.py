"""The `qwen3_5` family (Qwen3.5 dense and MoE): Qwen3-Next's layer stack with Gated DeltaNet's input
projections split, every MLP of an MoE model sparse, and the text model of a vision-language checkpoint.

Parameter names and config.json keys follow `transformers`' `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`
(`model_type` `qwen3_5_text` / `qwen3_5_moe_text`) and the hub's `Qwen3_5ForConditionalGeneration` /
`Qwen3_5MoeForConditionalGeneration` (`qwen3_5` / `qwen3_5_moe`: the text model's keys under `text_config`, its
weights under `model.language_model.`, a vision tower under `model.visual.` that text serving does not load).

What differs from `qwen3_next` (app/models/qwen3_next.py), read from transformers' modeling_qwen3_5*.py:

    GDN projections   in_proj_qkv [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)], in_proj_z [Hv*dv], in_proj_b [Hv],
                      in_proj_a [Hv]: flat by head, where Qwen3-Next groups [q | k | v | z] and [b | a] by key
                      head. qkv comes out in the conv's channel order, so nothing is regrouped. Value head h
                      reads key head h // (Hv / Hk), as in Qwen3-Next.
    MLP               dense: every layer an MLP of intermediate_size; MoE: every layer sparse (no
                      decoder_sparse_step / mlp_only_layers), top-k renormalised, a sigmoid-gated shared expert.
    rotary            MRoPE (rope_parameters.mrope_section, mrope_interleaved) over the partial rotary dims; for
                      text the temporal, height and width positions are the same position, so every section
                      turns by it and this is plain partial RoPE.
    unchanged         gated attention (q_proj carries the sigmoid output gate, q/k RMSNorm), (1 + w) RMSNorms,
                      the gated RMSNorm of the GDN output, tie_word_embeddings (the small models tie).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from app.models.geometry import RecurrentGeometry
from app.models.layers import stacked_linear
from app.models.qwen3_next import GatedDeltaNet, Qwen3NextConfig, Qwen3NextForCausalLM

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
TEXT_PREFIX = "model.language_model."  # the text model's weights in a ConditionalGeneration checkpoint
NOT_TEXT = ("model.visual.", "mtp.")  # vision tower and multi-token-prediction head: no place in the text model


@dataclass(frozen=True)
class Qwen3_5Config(Qwen3NextConfig):
    model_type = "qwen3_5"

    def recurrent_geometry(self) -> tuple[RecurrentGeometry, ...]:
        """Qwen3-Next's geometry; the decay tensors are also looked for under the ConditionalGeneration prefix."""
        return tuple(
            RecurrentGeometry(g.units, g.conv_channels, g.conv_kernel,
                              g.decay_prefixes + (f"{TEXT_PREFIX}layers.{g.layer}.linear_attn.",))
            for g in super().recurrent_geometry()
        )

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen3_5Config":
        """Either form: the text model's keys at the top (`qwen3_5_text`, `qwen3_5_moe_text`) or under
        `text_config` (`qwen3_5`, `qwen3_5_moe`, where a top-level tie_word_embeddings applies as transformers
        reads it). An MoE config has no intermediate_size and routes every layer."""
        text = dict(d.get("text_config") or d)
        if "text_config" in d and "tie_word_embeddings" in d:
            text["tie_word_embeddings"] = d["tie_word_embeddings"]
        moe = text.get("num_experts", 0) > 0
        if moe:
            text.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
            text.setdefault("intermediate_size", 0)
        return cls(**{f: getattr(Qwen3NextConfig.from_dict(text), f) for f in cls.__dataclass_fields__})


class SplitGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's Gated DeltaNet: the gated delta rule of Qwen3-Next behind four flat input projections."""

    def _make_projections(self, hidden: int) -> None:
        self.in_proj_qkv = nn.Linear(hidden, 2 * self.key_dim + self.value_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.nv, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.nv, bias=False)

    def _project(self, x: torch.Tensor):
        projections = [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        return stacked_linear(x, projections).split([p.weight.shape[0] for p in projections], dim=-1)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    linear_mixer = SplitGatedDeltaNet


def text_name(name: str) -> str | None:
    """A checkpoint tensor's name in the text model (the ConditionalGeneration prefix taken off), or None for
    a tensor with no place in it (vision tower, MTP head)."""
    if name.startswith(NOT_TEXT):
        return None
    return "model." + name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name

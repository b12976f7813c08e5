"""The `qwen3_next` family: Gated DeltaNet (head-wise gated delta rule) + gated full attention with partial RoPE.

Parameter names and config.json keys follow `transformers.Qwen3NextForCausalLM`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from app.models.batch import AttentionKV, BatchLayout
from app.models.geometry import RecurrentGeometry, UnitGeometry
from app.models.hybrid import DecoderLayer, HybridForCausalLM
from app.models.layers import MLP, Experts, RMSNorm, RMSNormGated, apply_rotary, attend, rotary_cos_sin, stacked_linear
from app.models.recurrent import recurrent_mix
from app.ops import l2norm


@dataclass(frozen=True)
class Qwen3NextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    norm_topk_prob: bool
    rope_theta: float
    partial_rotary_factor: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int

    model_type = "qwen3_next"

    def __post_init__(self) -> None:
        hk, hv = self.linear_num_key_heads, self.linear_num_value_heads
        if hv % hk:
            raise ValueError(f"linear_num_value_heads {hv} is not a multiple of linear_num_key_heads {hk}")

    def recurrent_geometry(self) -> tuple[RecurrentGeometry, ...]:
        """Every GDN layer: Hv value heads of [d_k, d_v] state (unit: one value head), bundled Hv / Hk per key
        head; a short conv over q, k (Hk heads) and v (Hv heads); decay tensors on linear_attn."""
        hk, hv = self.linear_num_key_heads, self.linear_num_value_heads
        dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
        return tuple(
            RecurrentGeometry(UnitGeometry(i, "gdn", hv, dk, dv, hv // hk), 2 * hk * dk + hv * dv,
                              self.linear_conv_kernel_dim, (f"model.layers.{i}.linear_attn.",))
            for i, kind in enumerate(self.layer_types) if kind == "linear_attention"
        )

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen3NextConfig":
        n = d["num_hidden_layers"]
        rope = d.get("rope_parameters") or {}
        layer_types = d.get("layer_types") or [
            "full_attention" if (i + 1) % d.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(n)
        ]
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=n, num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d["num_key_value_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            linear_num_key_heads=d["linear_num_key_heads"], linear_num_value_heads=d["linear_num_value_heads"],
            linear_key_head_dim=d["linear_key_head_dim"], linear_value_head_dim=d["linear_value_head_dim"],
            linear_conv_kernel_dim=d.get("linear_conv_kernel_dim", 4), layer_types=tuple(layer_types),
            num_experts=d.get("num_experts", 0), num_experts_per_tok=d.get("num_experts_per_tok", 1),
            moe_intermediate_size=d.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0),
            decoder_sparse_step=d.get("decoder_sparse_step", 1), mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            norm_topk_prob=d.get("norm_topk_prob", True),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
        )


class GatedDeltaNet(nn.Module):
    """Head-wise gated delta rule. in_proj_qkvz is grouped by key head: [q | k | v (r heads) | z (r heads)] with
    r = value heads per key head; in_proj_ba likewise [b (r) | a (r)]."""

    is_linear = True

    def __init__(self, cfg: Qwen3NextConfig, geo: RecurrentGeometry) -> None:
        super().__init__()
        self.geometry = geo
        self.nv, self.dk, self.dv, self.r = geo.units.heads, geo.units.d_k, geo.units.d_v, geo.units.bundle
        self.nk = geo.bundles
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        c = geo.conv_channels
        self.conv1d = nn.Conv1d(c, c, geo.conv_kernel, groups=c, bias=False)
        self._make_projections(cfg.hidden_size)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = RMSNormGated(self.dv, cfg.rms_norm_eps, "silu")
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv state [C, W-1], delta-rule state [Hv, d_k, d_v]) of one sequence (this rank's heads under TP)."""
        return self.geometry.state_shapes()

    def _split(self, y: torch.Tensor):
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        g, t = y.shape[:2]
        q = l2norm(q.reshape(g, t, self.nk, self.dk).float()).repeat_interleave(self.r, dim=2)
        k = l2norm(k.reshape(g, t, self.nk, self.dk).float()).repeat_interleave(self.r, dim=2)
        return q, k, v.reshape(g, t, self.nv, self.dv)

    def _make_projections(self, hidden: int) -> None:
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.nv, bias=False)

    def _project(self, x: torch.Tensor):
        """x: [N, D] -> mixed [N, C] (q | k | v, the conv's channel order), z [N, Hv * dv], b, a [N, Hv]."""
        n = x.shape[0]
        qkvz, ba = stacked_linear(x, [self.in_proj_qkvz, self.in_proj_ba]).split(
            [self.in_proj_qkvz.weight.shape[0], self.in_proj_ba.weight.shape[0]], dim=-1)
        q, k, v, z = qkvz.reshape(n, self.nk, -1).split([self.dk, self.dk, self.r * self.dv, self.r * self.dv], dim=-1)
        b, a = ba.reshape(n, self.nk, 2 * self.r).split([self.r, self.r], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.reshape(n, -1), b.reshape(n, self.nv), a.reshape(n, self.nv)

    def forward(self, x: torch.Tensor, layout: BatchLayout, conv_state, ssm_state, chunk_size: int):
        n = x.shape[0]
        mixed, z, b, a = self._project(x)
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out, conv, ssm, snaps = recurrent_mix(mixed, g, beta, layout, self.conv1d.weight.squeeze(1), conv_state,
                                              ssm_state, self._split, False, chunk_size)
        out = self.norm(out.to(x.dtype), z.reshape(n, self.nv, self.dv)).reshape(n, -1)
        return self.out_proj(out), conv, ssm, snaps


class GatedAttention(nn.Module):
    """GQA with q/k RMSNorm, partial RoPE and a sigmoid output gate from q_proj. KV entry: k | v, post-norm and
    post-rotary."""

    is_linear = False

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.d * 2, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.d, bias=False)
        self.o_proj = nn.Linear(self.heads * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, unit_offset=True)
        self.rotary_dim = int(self.d * cfg.partial_rotary_factor)
        self.theta = cfg.rope_theta
        self.kv_entry_width = 2 * self.kv_heads * self.d
        self.score_dim = 2 * self.heads * self.d  # multiply-adds per (query, key) pair: QK^T and PV

    def _expand(self, entries: torch.Tensor):
        k, v = entries.split(self.kv_heads * self.d, dim=-1)
        return k.view(-1, self.kv_heads, self.d), v.view(-1, self.kv_heads, self.d)

    def forward(self, x: torch.Tensor, layout: BatchLayout, kv: AttentionKV | None, layer_idx: int):
        n = x.shape[0]
        qg, k, v = stacked_linear(x, [self.q_proj, self.k_proj, self.v_proj]).split(
            [self.q_proj.weight.shape[0], self.k_proj.weight.shape[0], self.v_proj.weight.shape[0]], dim=-1)
        q, gate = qg.reshape(n, self.heads, 2 * self.d).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(n, self.kv_heads, self.d))
        cos, sin = layout.memo(("rotary", self.rotary_dim, self.theta),
                               lambda: rotary_cos_sin(layout.positions, self.rotary_dim, self.theta))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        entries = torch.cat([k.reshape(n, -1), v], dim=-1)
        out = attend(layer_idx, q, entries, layout, kv, self._expand, self.d ** -0.5)
        out = out.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(out)


class TopKRouter(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        self.k, self.norm = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float)
        top_w, top_idx = probs.topk(self.k, dim=-1)
        if self.norm:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        return top_idx, top_w.to(x.dtype)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_idx, top_w = self.gate(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, top_idx, top_w) + shared


class Qwen3NextForCausalLM(HybridForCausalLM):
    chunk_size = 64
    linear_mixer = GatedDeltaNet

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)  # noqa: E731
        geometry = {geo.layer: geo for geo in cfg.recurrent_geometry()}
        layers = []
        for i in range(len(cfg.layer_types)):
            if i in geometry:
                mixer, name = self.linear_mixer(cfg, geometry[i]), "linear_attn"
            else:
                mixer, name = GatedAttention(cfg), "self_attn"
            mlp = SparseMoeBlock(cfg) if cfg.is_sparse(i) else MLP(cfg.hidden_size, cfg.intermediate_size)
            layers.append(DecoderLayer(name, mixer, mlp, norm))
        self._build(cfg, layers, norm())

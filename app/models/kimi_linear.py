"""The `kimi_linear` family: Kimi Delta Attention (channel-wise gated delta rule) + MLA full attention.

Parameter names and config.json keys follow `transformers.KimiLinearForCausalLM`; `app.models.loader` also
reads the hub checkpoint layout (q/k/v_conv1d, block_sparse_moe.experts.N.w1/w2/w3, gate params on self_attn).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from app.models.batch import AttentionKV, BatchLayout
from app.models.geometry import RecurrentGeometry, UnitGeometry
from app.models.hybrid import DecoderLayer, HybridForCausalLM
from app.models.layers import MLP, Experts, RMSNorm, RMSNormGated, attend, stacked_linear
from app.models.recurrent import recurrent_mix
from app.ops import l2norm


def _pick(d: dict, *names, default=None):
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def _hub_layer_types(lin: dict, n: int) -> list[str]:
    """Layer types from a hub `linear_attn_config` (1-indexed `kda_layers` or `full_attn_layers`), else the
    transformers default: full attention at layers 4, 8, ... (0-indexed)."""
    if lin.get("kda_layers") is not None:
        bad = [j for j in lin["kda_layers"] if not 1 <= j <= n]
        if bad:
            raise ValueError(f"linear_attn_config.kda_layers is 1-indexed over {n} layers; out of range: {bad}")
        kda = set(lin["kda_layers"])
        return ["linear_attention" if i + 1 in kda else "full_attention" for i in range(n)]
    if lin.get("full_attn_layers") is not None:
        full = set(lin["full_attn_layers"])
        return ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]


@dataclass(frozen=True)
class KimiLinearConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int

    model_type = "kimi_linear"

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers or len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError("layer_types and mlp_layer_types need one entry per layer")

    def recurrent_geometry(self) -> tuple[RecurrentGeometry, ...]:
        """Every KDA layer: H heads of [d_k, d_k] state (unit: one key channel of one head), a short conv over
        q, k and v (3 * H * d_k channels); decay tensors on self_attn (hub) or self_attn.forget_gate (runtime)."""
        h, k = self.linear_num_heads, self.linear_head_dim
        return tuple(
            RecurrentGeometry(UnitGeometry(i, "kda", h, k, k), 3 * h * k, self.linear_conv_kernel_dim,
                              (f"model.layers.{i}.self_attn.", f"model.layers.{i}.self_attn.forget_gate."))
            for i, kind in enumerate(self.layer_types) if kind == "linear_attention"
        )

    @classmethod
    def from_dict(cls, d: dict) -> "KimiLinearConfig":
        """Reads both the transformers layout and the hub layout (`linear_attn_config`, `first_k_dense_replace`).
        Layer types: `layer_types`, else the 1-indexed `kda_layers`, else `full_attn_layers`, else every 4th."""
        n = d["num_hidden_layers"]
        lin = d.get("linear_attn_config") or {}
        layer_types = d.get("layer_types")
        if layer_types is None:
            layer_types = _hub_layer_types(lin, n)
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            k = d.get("first_k_dense_replace", 1)
            mlp_types = ["dense" if i < k else "sparse" for i in range(n)]
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=n, num_attention_heads=d["num_attention_heads"], kv_lora_rank=d["kv_lora_rank"],
            q_lora_rank=d.get("q_lora_rank"), qk_nope_head_dim=d["qk_nope_head_dim"],
            qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
            linear_num_heads=_pick(lin, "num_heads", default=_pick(d, "linear_num_heads", default=32)),
            linear_head_dim=_pick(lin, "head_dim", default=_pick(d, "linear_head_dim", default=128)),
            linear_conv_kernel_dim=_pick(lin, "short_conv_kernel_size",
                                         default=_pick(d, "linear_conv_kernel_dim", default=4)),
            layer_types=tuple(layer_types), mlp_layer_types=tuple(mlp_types),
            moe_intermediate_size=_pick(d, "moe_intermediate_size", default=1024),
            num_experts=_pick(d, "num_experts", "num_local_experts", default=0),
            num_experts_per_tok=_pick(d, "num_experts_per_token", "num_experts_per_tok", default=1),
            num_shared_experts=_pick(d, "num_shared_experts", "n_shared_experts", default=1),
            n_group=_pick(d, "num_expert_group", "n_group", default=1), topk_group=_pick(d, "topk_group", default=1),
            norm_topk_prob=_pick(d, "moe_renormalize", "norm_topk_prob", default=True),
            routed_scaling_factor=_pick(d, "routed_scaling_factor", default=1.0),
            rms_norm_eps=_pick(d, "rms_norm_eps", default=1e-5),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=_pick(d, "model_max_length", "max_position_embeddings", default=1 << 20),
        )


class KimiForgetGate(nn.Module):
    """Per-channel log decay g = -exp(A_log[h]) * softplus(f_b(f_a(x))[h, k] + dt_bias[h, k])."""

    def __init__(self, cfg: KimiLinearConfig, geo: RecurrentGeometry) -> None:
        super().__init__()
        h, k = geo.units.heads, geo.units.d_k
        self.f_a_proj = nn.Linear(cfg.hidden_size, k, bias=False)
        self.f_b_proj = nn.Linear(k, h * k, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(h * k))
        self.A_log = nn.Parameter(torch.zeros(1, 1, h, 1))
        self.heads, self.head_dim = h, k

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        """f_b_proj's output [N, H * K] -> g: [N, H, K] fp32."""
        a = f.float() + self.dt_bias.float()
        return -self.A_log.float().exp().view(1, -1, 1) * F.softplus(a.view(-1, self.heads, self.head_dim))


class KimiDeltaAttention(nn.Module):
    """Channel-wise gated delta rule over q, k, v of H heads of dimension K (`geo.units`: d_k = d_v = K)."""

    is_linear = True

    def __init__(self, cfg: KimiLinearConfig, geo: RecurrentGeometry) -> None:
        super().__init__()
        self.geometry = geo
        self.heads, self.head_dim = geo.units.heads, geo.units.d_k
        dim = self.heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, dim, bias=False)
        c = geo.conv_channels
        self.conv1d = nn.Conv1d(c, c, geo.conv_kernel, groups=c, bias=False)
        self.forget_gate = KimiForgetGate(cfg, geo)
        self.b_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)
        self.g_a_proj = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, dim, bias=False)
        self.o_norm = RMSNormGated(self.head_dim, cfg.rms_norm_eps, "sigmoid")
        self.o_proj = nn.Linear(dim, cfg.hidden_size, bias=False)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv state [C, W-1], delta-rule state [H, K, V]) of one sequence (of this rank's heads under TP)."""
        return self.geometry.state_shapes()

    def _split(self, y: torch.Tensor):
        q, k, v = y.split(self.heads * self.head_dim, dim=-1)
        shape = (*y.shape[:2], self.heads, self.head_dim)
        return l2norm(q.reshape(shape).float()), l2norm(k.reshape(shape).float()), v.reshape(shape)

    def forward(self, x: torch.Tensor, layout: BatchLayout, conv_state, ssm_state, chunk_size: int):
        fg = self.forget_gate
        dim = self.heads * self.head_dim
        mixed, f_low, g_low, b = stacked_linear(
            x, [self.q_proj, self.k_proj, self.v_proj, fg.f_a_proj, self.g_a_proj, self.b_proj]
        ).split([3 * dim, fg.f_a_proj.weight.shape[0], self.g_a_proj.weight.shape[0], self.heads], dim=-1)
        g = fg.decay(fg.f_b_proj(f_low))
        beta = torch.sigmoid(b.float())
        out, conv, ssm, snaps = recurrent_mix(mixed, g, beta, layout, self.conv1d.weight.squeeze(1), conv_state,
                                              ssm_state, self._split, True, chunk_size)
        gate = self.g_b_proj(g_low).view(-1, self.heads, self.head_dim)
        out = self.o_norm(out.to(x.dtype), gate).reshape(x.shape[0], -1)
        return self.o_proj(out), conv, ssm, snaps


class KimiMLA(nn.Module):
    """Multi-head latent attention without rotary embedding (NoPE). KV entry per token: the normalised latent
    [kv_lora_rank] followed by the shared key part [qk_rope_head_dim]."""

    is_linear = False

    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, self.heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # transformers uses the default eps here
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, cfg.hidden_size, bias=False)
        self.scale = qk ** -0.5
        self.kv_entry_width = self.rank + self.rope
        self.score_dim = self.heads * (qk + self.v_dim)  # multiply-adds per (query, key) pair: QK^T and PV

    def _expand(self, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """entries [S, rank + rope] -> k [S, H, nope + rope], v [S, H, v_dim]."""
        latent, k_rot = entries.split([self.rank, self.rope], dim=-1)
        kv = self.kv_b_proj(latent).view(-1, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot[:, None, :].expand(-1, self.heads, -1)], dim=-1)
        return k, v

    def _absorbed_decode(self, q: torch.Tensor, history: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Decode attention on the latent entries (MLA weight absorption): q [B, H, nope + rope], history
        [B, S, rank + rope], mask [B, S] -> [B, H, v_dim]; or, for verify pieces, q [B, T, H, .] and mask
        [B, T, S] -> [B, T, H, v_dim]. kv_b_proj's key half is folded into the query and its value half applied
        once to the attended latent, so cached entries are never expanded per head."""
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        w_k, w_v = w[:, : self.nope], w[:, self.nope :]  # [H, nope, rank], [H, v_dim, rank]
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = history.split([self.rank, self.rope], dim=-1)  # [B, S, rank], [B, S, rope]
        if q.dim() == 4:  # blocks of T queries (speculative verify): q [B, T, H, Dq], mask [B, T, S]
            b, t = q.shape[:2]
            q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_k).flatten(1, 2)  # [B, T*H, rank]
            scores = (q_lat @ latent.transpose(1, 2) + q_rot.flatten(1, 2) @ k_rot.transpose(1, 2)) * self.scale
            probs = scores.view(b, t, self.heads, -1).masked_fill(~mask[:, :, None, :], float("-inf")).softmax(-1)
            return torch.einsum("bthr,hvr->bthv", (probs.flatten(1, 2) @ latent).view(b, t, self.heads, -1), w_v)
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_k)
        scores = (q_lat @ latent.transpose(1, 2) + q_rot @ k_rot.transpose(1, 2)) * self.scale  # [B, H, S]
        probs = scores.masked_fill(~mask[:, None, :], float("-inf")).softmax(dim=-1)
        return torch.einsum("bhr,hvr->bhv", probs @ latent, w_v)

    def forward(self, x: torch.Tensor, layout: BatchLayout, kv: AttentionKV | None, layer_idx: int):
        if hasattr(self, "q_proj"):
            q, latent, k_rot = stacked_linear(x, [self.q_proj, self.kv_a_proj_with_mqa]).split(
                [self.q_proj.weight.shape[0], self.rank, self.rope], dim=-1)
        else:
            q_low, latent, k_rot = stacked_linear(x, [self.q_a_proj, self.kv_a_proj_with_mqa]).split(
                [self.q_a_proj.weight.shape[0], self.rank, self.rope], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_low))
        q = q.reshape(-1, self.heads, self.nope + self.rope)
        entries = torch.cat([self.kv_a_layernorm(latent), k_rot], dim=-1)
        out = attend(layer_idx, q, entries, layout, kv, self._expand, self.scale, self._absorbed_decode)
        return self.o_proj(out.reshape(x.shape[0], -1))


class KimiTopkRouter(nn.Module):
    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D] -> (top_idx [N, k], top_w [N, k]): sigmoid scores, group-limited top-k on biased scores."""
        c = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        groups = choice.view(-1, c.n_group, c.num_experts // c.n_group)
        group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group_scores).scatter(1, group_scores.topk(c.topk_group, dim=-1)[1], 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(c.num_experts // c.n_group, dim=1), float("-inf"))
        top_idx = choice.topk(c.num_experts_per_tok, dim=-1)[1]
        top_w = scores.gather(1, top_idx)
        if c.norm_topk_prob:
            top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
        return top_idx, top_w * c.routed_scaling_factor


class KimiMoE(nn.Module):
    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.gate = KimiTopkRouter(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_idx, top_w = self.gate(x)
        return self.experts(x, top_idx, top_w) + self.shared_experts(x)


class KimiLinearForCausalLM(HybridForCausalLM):
    chunk_size = 16  # KDA's pairwise per-channel decay tensor is [C, C, K] per chunk: 16 is fastest on CPU

    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        geometry = {geo.layer: geo for geo in cfg.recurrent_geometry()}
        layers = []
        for i, mlp_kind in enumerate(cfg.mlp_layer_types):
            mixer = KimiDeltaAttention(cfg, geometry[i]) if i in geometry else KimiMLA(cfg)
            mlp = KimiMoE(cfg) if mlp_kind == "sparse" else MLP(cfg.hidden_size, cfg.intermediate_size)
            layers.append(DecoderLayer("self_attn", mixer, mlp, norm))
        self._build(cfg, layers, norm())

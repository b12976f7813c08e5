"""Tensor-parallel sharding of a loaded model, in place: rank r of T keeps its heads and MLP columns.

- Attention: query heads split (MLA: q / kv_b rows per head, the shared latent KV replicated; Qwen: q rows per
  head, KV heads split or, when fewer than T, replicated), o_proj columns: partial sums, all_reduce after.
- Linear attention: head bundles split (KDA: one head; GDN: a key head with its value heads): q/k/v rows (GDN:
  Qwen3-Next's grouped qkvz/ba, Qwen3.5's flat qkv/z/b/a), conv channels, gate projections, A_log, dt_bias, the
  rows of the gate up-projection and the columns of the output projection; the per-head output norm and low-rank
  down-projections are replicated.
  The mixer's `geometry` becomes the rank's share (`RecurrentGeometry.shard`), so its state shapes follow.
  `head_orders[j]` (stage 1 of TP-balanced placement) permutes linear layer j's heads first: rank r owns the
  contiguous block r of that order — an exact reindexing of every coupled tensor.
- MLP / experts: column-parallel gate and up, row-parallel down, all_reduce after; routers replicated.
- Embeddings, norms and the LM head are replicated, so every rank computes the full logits.
"""

from __future__ import annotations

import torch
from torch import nn

from app.models.hybrid import HybridForCausalLM
from app.models.kimi_linear import KimiDeltaAttention, KimiMLA, KimiMoE
from app.models.layers import MLP, Experts
from app.models.qwen3_5 import SplitGatedDeltaNet
from app.models.qwen3_next import GatedAttention, GatedDeltaNet, SparseMoeBlock


def _head_counts(mixer) -> list[tuple[str, int]]:
    """The head counts of a mixer that TP splits, named as an error message names them."""
    if isinstance(mixer, KimiDeltaAttention):
        return [("KDA heads", mixer.heads)]
    if isinstance(mixer, KimiMLA):
        return [("MLA heads", mixer.heads)]
    if isinstance(mixer, GatedDeltaNet):
        return [("GDN key heads", mixer.nk)]
    return [("attention heads", mixer.heads)]


def check_divisible(model: HybridForCausalLM, tp: int) -> None:
    """Raise ValueError naming the numbers when a head count or MLP width does not split over `tp` ranks."""
    for i, layer in enumerate(model.model.layers):
        m = layer.mixer
        counts = _head_counts(m)
        if isinstance(m, GatedAttention) and m.kv_heads % tp and tp % m.kv_heads:
            counts.append(("KV heads", m.kv_heads))
        for name, n in counts:
            if n % tp:
                raise ValueError(f"layer {i}: {n} {name} do not divide over tp_size {tp}")
        for name, width in _mlp_widths(layer.mlp):
            if width % tp:
                raise ValueError(f"layer {i}: {name} width {width} does not divide over tp_size {tp}")


def shard_model(model: HybridForCausalLM, rank: int, tp: int, head_orders: list[list[int]] | None = None) -> None:
    check_divisible(model, tp)
    j = 0
    with torch.no_grad():
        for layer in model.model.layers:
            m = layer.mixer
            if layer.is_linear:
                order = head_orders[j] if head_orders else None
                (_shard_kda if isinstance(m, KimiDeltaAttention) else _shard_gdn)(m, rank, tp, order)
                j += 1
            else:
                (_shard_mla if isinstance(m, KimiMLA) else _shard_gqa)(m, rank, tp)
            _shard_mlp_module(layer.mlp, rank, tp)
    model.tp_size, model.tp_rank = tp, rank


def _rows(linear: nn.Linear, idx: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight[idx].clone())
    linear.out_features = len(idx)


def _cols(linear: nn.Linear, idx: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight[:, idx].clone())
    linear.in_features = len(idx)


def _block(n: int, rank: int, tp: int, order: list[int] | None = None) -> list[int]:
    ids = order if order is not None else list(range(n))
    per = n // tp
    return ids[rank * per : (rank + 1) * per]


def _expand(heads: list[int], size: int) -> torch.Tensor:
    return torch.tensor([h * size + i for h in heads for i in range(size)], dtype=torch.long)


def _shard_kda(m: KimiDeltaAttention, rank: int, tp: int, order) -> None:
    heads, k = _block(m.heads, rank, tp, order), m.head_dim
    idx = _expand(heads, k)
    dim = m.heads * k
    for proj in (m.q_proj, m.k_proj, m.v_proj, m.g_b_proj, m.forget_gate.f_b_proj):
        _rows(proj, idx)
    m.conv1d.weight = nn.Parameter(m.conv1d.weight[torch.cat([idx, idx + dim, idx + 2 * dim])].clone())
    m.forget_gate.dt_bias = nn.Parameter(m.forget_gate.dt_bias[idx].clone())
    m.forget_gate.A_log = nn.Parameter(m.forget_gate.A_log[:, :, heads].clone())
    _rows(m.b_proj, torch.tensor(heads))
    _cols(m.o_proj, idx)
    m.heads = m.forget_gate.heads = len(heads)
    m.geometry = m.geometry.shard(tp)


def _shard_gdn(m: GatedDeltaNet, rank: int, tp: int, order) -> None:
    """`order` lists value heads with bundles contiguous; rank r gets whole key heads."""
    if order is None:
        keys = _block(m.nk, rank, tp)
    else:
        keys = sorted({v // m.r for v in _block(m.nv, rank, tp, order)})
    values = [g * m.r + i for g in keys for i in range(m.r)]
    q, v = _expand(keys, m.dk), _expand(values, m.dv)
    if isinstance(m, SplitGatedDeltaNet):  # flat projections: q | k | v rows, z by value head, b / a per head
        _rows(m.in_proj_qkv, torch.cat([q, m.key_dim + q, 2 * m.key_dim + v]))
        _rows(m.in_proj_z, v)
        _rows(m.in_proj_b, torch.tensor(values))
        _rows(m.in_proj_a, torch.tensor(values))
    else:  # grouped by key head: [q | k | v (r heads) | z (r heads)] and [b (r) | a (r)]
        _rows(m.in_proj_qkvz, _expand(keys, 2 * m.dk + 2 * m.r * m.dv))
        _rows(m.in_proj_ba, _expand(keys, 2 * m.r))
    conv = m.conv1d.weight
    m.conv1d.weight = nn.Parameter(torch.cat([conv[q], conv[m.key_dim + q], conv[2 * m.key_dim + v]]).clone())
    m.dt_bias = nn.Parameter(m.dt_bias[values].clone())
    m.A_log = nn.Parameter(m.A_log[values].clone())
    _cols(m.out_proj, v)
    m.nk, m.nv = len(keys), len(values)
    m.key_dim, m.value_dim = m.nk * m.dk, m.nv * m.dv
    m.geometry = m.geometry.shard(tp)


def _shard_mla(m: KimiMLA, rank: int, tp: int) -> None:
    heads = _block(m.heads, rank, tp)
    qk = m.nope + m.rope
    _rows(m.q_proj if hasattr(m, "q_proj") else m.q_b_proj, _expand(heads, qk))
    _rows(m.kv_b_proj, _expand(heads, m.nope + m.v_dim))
    _cols(m.o_proj, _expand(heads, m.v_dim))
    m.heads = len(heads)


def _shard_gqa(m: GatedAttention, rank: int, tp: int) -> None:
    heads = _block(m.heads, rank, tp)
    _rows(m.q_proj, _expand(heads, 2 * m.d))
    _cols(m.o_proj, _expand(heads, m.d))
    if m.kv_heads % tp == 0:
        kv = _block(m.kv_heads, rank, tp)
    else:  # fewer KV heads than ranks: each rank keeps the one its query heads use
        kv = [heads[0] // (m.heads // m.kv_heads)]
    _rows(m.k_proj, _expand(kv, m.d))
    _rows(m.v_proj, _expand(kv, m.d))
    m.heads, m.kv_heads = len(heads), len(kv)
    m.kv_entry_width = 2 * m.kv_heads * m.d


def _shard_mlp_module(mlp: nn.Module, rank: int, tp: int) -> None:
    if isinstance(mlp, MLP):
        _shard_mlp(mlp, rank, tp)
    elif isinstance(mlp, KimiMoE):
        _shard_experts(mlp.experts, rank, tp)
        _shard_mlp(mlp.shared_experts, rank, tp)
    elif isinstance(mlp, SparseMoeBlock):
        _shard_experts(mlp.experts, rank, tp)
        _shard_mlp(mlp.shared_expert, rank, tp)  # its sigmoid gate stays replicated: gate * sum = sum of gated


def _shard_mlp(mlp: MLP, rank: int, tp: int) -> None:
    idx = torch.tensor(_block(mlp.gate_proj.out_features, rank, tp))
    _rows(mlp.gate_proj, idx)
    _rows(mlp.up_proj, idx)
    _cols(mlp.down_proj, idx)


def _shard_experts(e: Experts, rank: int, tp: int) -> None:
    inter = e.down_proj.shape[-1]
    idx = torch.tensor(_block(inter, rank, tp))
    e.gate_up_proj = nn.Parameter(torch.cat([e.gate_up_proj[:, idx], e.gate_up_proj[:, inter + idx]], dim=1).clone())
    e.down_proj = nn.Parameter(e.down_proj[:, :, idx].clone())


def _mlp_widths(mlp: nn.Module) -> list[tuple[str, int]]:
    if isinstance(mlp, MLP):
        return [("MLP intermediate", mlp.gate_proj.out_features)]
    shared = mlp.shared_experts if isinstance(mlp, KimiMoE) else mlp.shared_expert
    return [("expert intermediate", mlp.experts.down_proj.shape[-1]),
            ("shared expert intermediate", shared.gate_proj.out_features)]

"""Naive recurrent gated delta rules in fp32: the slow twins that read like the equations.

Shared notation (state S is k-major, [K, V]: row S[k, :] is the d_v-vector the papers call column S[:, k]):

    S   = S * exp(g_t)                      GDN: one scalar per head; KDA: row k scaled by exp(g_t[k])
    d_t = beta_t * (v_t - S^T k_t)          the delta-rule correction, [V]
    S   = S + k_t d_t^T                     rank-one write
    o_t = S^T (scale * q_t)                 read with the updated state

Semantics are those of transformers' `torch_recurrent_gated_delta_rule` (Qwen3-Next) and
`recurrent_kimi_delta_attention` (Kimi-Linear) with `use_qk_l2norm_in_kernel=False`: q and k are used as
given (the model l2-normalises them first). At T=1 they are the twins of the decode step in `step.py`.
"""

from __future__ import annotations

import torch


def naive_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet (per-head scalar gate), one token at a time.

    Args:
        q, k: [B, T, H, K]
        v: [B, T, H, V]
        g: [B, T, H] log-decay, <= 0
        beta: [B, T, H] write strength, usually in (0, 1)
        scale: query scale, defaults to K ** -0.5
        initial_state: [B, H, K, V] or None for zeros
    Returns:
        o: [B, T, H, V] in q's dtype; final_state: [B, H, K, V] fp32
    """
    return _naive_gated_delta(q, k, v, g.unsqueeze(-1), beta, scale, initial_state)


def naive_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi Delta Attention (per key-channel gate), one token at a time.

    Args:
        q, k: [B, T, H, K]
        v: [B, T, H, V]
        g: [B, T, H, K] log-decay per key channel, <= 0
        beta: [B, T, H]
        scale: query scale, defaults to K ** -0.5
        initial_state: [B, H, K, V] or None for zeros
    Returns:
        o: [B, T, H, V] in q's dtype; final_state: [B, H, K, V] fp32
    """
    return _naive_gated_delta(q, k, v, g, beta, scale, initial_state)


def _naive_gated_delta(q, k, v, g, beta, scale, initial_state):
    """g: [B, T, H, K] or [B, T, H, 1] (broadcast over key channels)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    out_dtype = q.dtype
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if initial_state is None:
        S = q.new_zeros(B, H, K, V)
    else:
        S = initial_state.float()
    outputs = []
    for t in range(T):
        q_t, k_t, v_t, beta_t = q[:, t] * scale, k[:, t], v[:, t], beta[:, t, :, None]  # [B, H, K|V|1]
        S = S * g[:, t].exp().unsqueeze(-1)  # decay rows: [B, H, K|1, 1]
        delta = beta_t * (v_t - torch.einsum("bhk,bhkv->bhv", k_t, S))
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_t, S))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), S

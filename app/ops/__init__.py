"""Linear-attention ops in fp32 torch: naive recurrent twins, chunked forms, the short causal conv.

All take q, k: [B, T, H, K], v: [B, T, H, V], beta: [B, T, H], g (log-decay <= 0): [B, T, H] for GDN,
[B, T, H, K] for KDA, and return (o [B, T, H, V] in q's dtype, final_state [B, H, K, V] fp32).
q/k and v share the head count H: Qwen3-Next's grouped value heads are expanded by the caller first
(repeat_interleave over heads, as transformers does). Single-token decode has its own few-op forms in
`step.py` (twins: the naive forms at T=1).
"""

import torch

from app.ops.chunk import chunk_gdn, chunk_kda, chunk_states_at, chunk_with_replay, state_after
from app.ops.conv import causal_conv1d, conv_states_at, naive_causal_conv1d
from app.ops.naive import naive_gdn, naive_kda
from app.ops.step import conv_step, conv_steps, gated_delta_step


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x * x) + eps) along dim, as FLA and transformers' Qwen3-Next compute it."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


__all__ = [
    "causal_conv1d",
    "chunk_gdn",
    "chunk_kda",
    "chunk_states_at",
    "chunk_with_replay",
    "conv_states_at",
    "conv_step",
    "conv_steps",
    "gated_delta_step",
    "l2norm",
    "naive_causal_conv1d",
    "naive_gdn",
    "naive_kda",
    "state_after",
]

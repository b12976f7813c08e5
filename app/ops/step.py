"""Single-token decode steps, written for few ops per call; twins of `naive.py` and `conv.py` at T = 1.

A decode step runs once per generated token for every linear-attention layer, on tiny tensors, so on a CPU
its cost is the number of ops dispatched, not their arithmetic. These forms take and return tensors
without the time axis and fold the naive loop body into batched matmuls:

    S = S * exp(g)                  [B, H, K, V] rows scaled (g: [B, H, K] per channel or [B, H, 1])
    d = beta * (v - k S)            k S: [B*H, 1, K] @ [B*H, K, V]
    S = S + k^T d                   one baddbmm: [B*H, K, 1] @ [B*H, 1, V]
    o = (scale * q) S

Traced by `torch.compile` (a compiled decode step) the same lines are written as broadcasts and sums over S,
which Inductor fuses into one loop over the state instead of calling a matmul per line.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for B sequences (KDA and GDN).

    Args:
        q, k: [B, H, K] fp32; v: [B, H, V] fp32
        g: [B, H, K] (KDA) or [B, H] (GDN) log-decay <= 0; beta: [B, H]
        state: [B, H, K, V] fp32, not modified
        scale: query scale, defaults to K ** -0.5
    Returns:
        o: [B, H, V] fp32; the new state [B, H, K, V] fp32
    """
    B, H, K = k.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    decay = g.exp().unsqueeze(-1) if g.dim() == 3 else g.exp()[..., None, None]
    if torch.compiler.is_compiling():  # as broadcasts and sums, which Inductor fuses into one loop over S
        S = state * decay
        delta = (v - (k[..., None] * S).sum(-2)) * beta[..., None]
        S = S + k[..., None] * delta[..., None, :]
        return ((q * scale)[..., None] * S).sum(-2), S
    S = (state * decay).view(B * H, K, V)
    k_col = k.reshape(B * H, K, 1)
    delta = (v.reshape(B * H, 1, V) - k_col.transpose(1, 2) @ S) * beta.reshape(B * H, 1, 1)
    S = torch.baddbmm(S, k_col, delta)
    o = (q.reshape(B * H, 1, K) * scale) @ S
    return o.view(B, H, V), S.view(B, H, K, V)


def conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One input of the causal depthwise conv with SiLU (the `causal_conv1d` contract at T = 1, fp32).

    Args:
        x: [B, C]; weight: [C, W]; state: [B, C, W-1], the W-1 previous inputs (oldest first)
    Returns:
        y: [B, C] in x's dtype, silu(sum_w weight[c, w] * concat(state, x)[b, c, w]) computed in fp32;
        the new state [B, C, W-1]
    """
    xs = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, W], the state keeps x's dtype
    return F.silu((xs.float() * weight.float()).sum(-1)).to(x.dtype), xs[:, :, 1:]


def conv_steps(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """T inputs at once with `conv_step`'s arithmetic per position (a speculative verify piece: a few tokens,
    where F.conv1d's setup costs more than the sum).

    Args:
        x: [B, T, C]; weight: [C, W]; state: [B, C, W-1]
    Returns:
        y: [B, T, C] in x's dtype; the new state [B, C, W-1], the last W-1 inputs
    """
    W = weight.shape[-1]
    xs = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, W-1+T]
    y = (xs.float().unfold(-1, W, 1) * weight.float()[:, None, :]).sum(-1)  # [B, C, T]
    return F.silu(y).transpose(1, 2).to(x.dtype), xs[:, :, xs.shape[-1] - (W - 1) :]

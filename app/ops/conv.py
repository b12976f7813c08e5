"""Causal depthwise conv1d with a carried state (the short conv in front of GDN / KDA), and its naive twin.

Tap orientation follows transformers' `causal_conv1d_fn` (and the causal_conv1d package): the last tap
weight[:, W-1] multiplies the current input, weight[:, 0] the input W-1 steps back.

    y[t, c] = act(bias[c] + sum_w weight[c, w] * xs[t + w, c]),    xs = concat(state, x) along time

Both compute in fp32 and return y in x's dtype; the state holds raw inputs and keeps x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv via one grouped F.conv1d over concat(state, x).

    Args:
        x: [B, T, C]
        weight: [C, W]
        bias: [C] or None
        initial_state: [B, C, W-1], the W-1 inputs before x (oldest first), or None for zeros
        activation: "silu" or None, applied after the conv
    Returns:
        y: [B, T, C] in x's dtype; final_state: [B, C, W-1], the last W-1 inputs of concat(state, x)
    """
    xs = _with_state(x, weight, initial_state)  # [B, C, W-1+T]
    C, W = weight.shape
    b = None if bias is None else bias.float()
    y = F.conv1d(xs.float(), weight.float().unsqueeze(1), b, groups=C)  # [B, C, T]; decode: app/ops/step.py
    return _finish(y, activation, x.dtype), xs[:, :, xs.shape[-1] - (W - 1) :]


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `causal_conv1d`, written as an explicit sum over the W taps."""
    xs = _with_state(x, weight, initial_state)
    C, W = weight.shape
    T = x.shape[1]
    xf, wf = xs.float(), weight.float()
    y = torch.zeros_like(xf[:, :, :T]) if bias is None else bias.float()[:, None].expand_as(xf[:, :, :T])
    for w in range(W):
        y = y + wf[:, w, None] * xf[:, :, w : w + T]
    return _finish(y, activation, x.dtype), xs[:, :, xs.shape[-1] - (W - 1) :]


def conv_states_at(
    x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None, at
) -> torch.Tensor:
    """The carried states after the first t inputs, for t in `at`: [len(at), B, C, W-1], each the W-1 raw
    inputs before position t of concat(state, x) (what `causal_conv1d` on x[:, :t] would return)."""
    w = weight.shape[-1] - 1
    if min(at) < w:  # a window reaching back into the carried state
        xs = _with_state(x, weight, initial_state)
        return torch.stack([xs[:, :, t : t + w] for t in at])
    return torch.stack([x[:, t - w : t] for t in at]).transpose(-1, -2)  # windows inside x: no concat


def _with_state(x, weight, initial_state):
    """[B, T, C] x and [B, C, W-1] state (zeros when None) -> [B, C, W-1+T]."""
    B, T, C = x.shape
    W = weight.shape[-1]
    if initial_state is None:
        initial_state = x.new_zeros(B, C, W - 1)
    return torch.cat([initial_state.to(x.dtype), x.transpose(1, 2)], dim=-1)


def _finish(y: torch.Tensor, activation: str | None, dtype: torch.dtype) -> torch.Tensor:
    """[B, C, T] fp32 -> activation -> [B, T, C] in dtype."""
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"activation must be 'silu', 'swish' or None, got {activation!r}")
    return y.transpose(1, 2).to(dtype)

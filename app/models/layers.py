"""Building blocks shared by both families: norms, MLP, causal attention over a flat batch, rotary embedding."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from app.models.batch import AttentionKV, BatchLayout


def stacked_linear(x: torch.Tensor, linears: Sequence[nn.Linear]) -> torch.Tensor:
    """[N, sum of out features]: the outputs of several bias-free linears of the same input x [N, D], side by side.

    Without autograd this is one matmul over the stacked weights (a decode step is dispatch-bound: one call
    instead of several), which costs one copy of those weights, kept on the first linear and rebuilt when any
    weight changes (in place, as loading does, or replaced, as sharding does). With autograd each linear runs
    on its own, so gradients reach the parameters as usual.
    """
    weights = [lin.weight for lin in linears]
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return torch.cat([F.linear(x, w) for w in weights], dim=-1)
    cached = getattr(linears[0], "_stacked", None)
    if torch.compiler.is_compiling():  # a compiled decode step bakes in the weights stacked by its eager warm-up
        return F.linear(x, cached[2]) if cached is not None else torch.cat([F.linear(x, w) for w in weights], -1)
    if cached is None or not _same_weights(cached[0], cached[1], weights):
        # `kept` holds the source storages, so no new tensor can reuse their addresses while cached
        kept = [w.detach() for w in weights]
        cached = (kept, [w._version for w in weights], torch.cat(kept))
        linears[0]._stacked = cached
    return F.linear(x, cached[2])


def _same_weights(kept: list[torch.Tensor], versions: list[int], weights: list[torch.Tensor]) -> bool:
    """Whether every weight is still the stored tensor (same storage) and unmodified since (same version)."""
    return len(kept) == len(weights) and all(
        w.data_ptr() == k.data_ptr() and w.shape == k.shape and w._version == v
        for k, v, w in zip(kept, versions, weights))


class RMSNorm(nn.Module):
    """weight * x / rms(x); `unit_offset` gives Qwen3-Next's (1 + weight) * x / rms(x) with zero-initialised weight."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        self.unit_offset = unit_offset
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float()
        y = F.rms_norm(x.float(), w.shape, (1.0 + w) if self.unit_offset else w, self.eps)
        return y.to(x.dtype)


class RMSNormGated(nn.Module):
    """Per-head output norm of the linear-attention layers: weight * x / rms(x) * act(gate)."""

    def __init__(self, dim: int, eps: float, activation: str) -> None:
        super().__init__()
        self.eps = eps
        self.act = torch.sigmoid if activation == "sigmoid" else F.silu
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps) * self.act(gate.float())
        return y.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = stacked_linear(x, [self.gate_proj, self.up_proj]).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    """Routed experts stored as 3D tensors, as in transformers: gate_up_proj [E, 2I, D], down_proj [E, D, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x: [N, D]; top_idx, top_w: [N, k] -> [N, D] weighted sum of the chosen experts."""
        out = torch.zeros_like(x)
        for e in top_idx.unique().tolist():
            tok, slot = torch.where(top_idx == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * top_w[tok, slot, None]
            out = out.index_add(0, tok, y.to(out.dtype))
        return out


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [N, rotary_dim] for the half-split (rotate_half) convention."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float, device=positions.device) / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, H, D]; rotates the first cos.shape[-1] dims of every head, passes the rest through."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    x1, x2 = rot[..., : rd // 2], rot[..., rd // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached_len: int, scale: float) -> torch.Tensor:
    """One sequence. q: [T, H, Dq]; k: [S, H or Hkv, Dq]; v: [S, Hkv, Dv] with S = cached_len + T -> [T, H, Dv].

    Query i sits at position cached_len + i and sees keys 0 .. cached_len + i.
    """
    t, h = q.shape[0], q.shape[1]
    s = k.shape[0]
    gqa = k.shape[1] != h  # grouped KV heads: sdpa shares them without materialising copies
    # [1, H, T, D]: with a batch dim torch's CPU sdpa takes its fused flash kernel (3-D inputs take the
    # unfused math path; bench_engine's cold prefill at 2048 tokens halved with this)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    dv = vh.shape[-1]
    if t > 1 and dv < qh.shape[-1]:  # MLA (v narrower than q/k): the fused kernel wants equal head dims, so
        vh = F.pad(vh, (0, qh.shape[-1] - dv))  # pad v with zero columns, which only add zero output columns
    if t == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=gqa)
    elif cached_len == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = torch.arange(s, device=q.device)[None, :] <= (torch.arange(t, device=q.device)[:, None] + cached_len)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0, ..., :dv].transpose(0, 1)


def batched_causal_attention(q, k, v, scale: float) -> torch.Tensor:
    """Training path, no cache. q: [B, T, H, Dq]; k: [B, T, Hkv, Dq]; v: [B, T, Hkv, Dv] -> [B, T, H, Dv]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2)


def attend(
    layer: int,
    q: torch.Tensor,
    entries: torch.Tensor,
    layout: BatchLayout,
    kv: AttentionKV | None,
    expand,
    scale: float,
    absorbed_decode=None,
) -> torch.Tensor:
    """Attention for a flat batch through the KV interface.

    q: [N, H, Dq]; entries: [N, W] this layer's per-token KV entries; expand(entries [S, W]) -> (k, v).
    absorbed_decode(q [B, H, Dq], history [B, S, W], mask [B, S]) -> [B, H, Dv], optional: attention of a
    batch of decode steps computed on the entries themselves (MLA's absorbed form), instead of expanding
    every cached entry. Without `kv` the layout must be uniform with nothing cached (training, reference runs).
    """
    if kv is None:
        b, t = layout.num_seqs, layout.extend_lens[0]
        if any(c for c in layout.cached_lens) or any(n != t for n in layout.extend_lens):
            raise ValueError("attention without a KV store needs a uniform layout with nothing cached")
        k, v = expand(entries)
        out = batched_causal_attention(
            q.view(b, t, *q.shape[1:]), k.view(b, t, *k.shape[1:]), v.view(b, t, *v.shape[1:]), scale
        )
        return out.reshape(b * t, *out.shape[2:])
    decode = [i for i, n in enumerate(layout.extend_lens) if n == 1]
    pieces = []  # (flat rows: an index tensor or a slice, their attention output)
    if layout.verify:  # decode rows and speculative verify pieces: one padded batch of short query blocks
        short = sorted(decode + list(layout.verify))
        pieces.append(_short_blocks(layer, q, entries, layout, kv, short, expand, scale, absorbed_decode))
        decode = short
    elif decode:  # one padded batch for every single-token sequence
        rows = slice(None) if layout.all_decode else layout.memo(
            ("decode_rows",), lambda: layout.tensor([layout.offsets[i + 1] - 1 for i in decode]))
        history = kv.extend_padded(layer, decode, entries[rows])  # [B, S_max, W]
        b, s_max = history.shape[:2]
        # sequence i sees its position + 1 entries; from positions, not host lengths (see BatchLayout.decode).
        # One mask per forward: every attention layer reads the same histories (s_max stays out of the key, so
        # a compiled step keeps the history length symbolic)
        mask = layout.memo(("decode_mask",), lambda: _length_mask(layout.positions[rows] + 1, s_max))
        if absorbed_decode is not None:
            pieces.append((rows, absorbed_decode(q[rows], history, mask)))
        else:
            k, v = expand(history.flatten(0, 1))
            k, v = k.view(b, s_max, *k.shape[1:]), v.view(b, s_max, *v.shape[1:])
            pieces.append((rows, _padded_decode_attention(q[rows], k, v, mask[:, None, None, :], scale)))
    done = set(decode)
    for i, (lo, hi) in enumerate(zip(layout.offsets[:-1], layout.offsets[1:])):
        if i not in done:
            k, v = expand(kv.extend(layer, i, entries[lo:hi]))
            pieces.append((slice(lo, hi), causal_attention(q[lo:hi], k, v, layout.cached_lens[i], scale)))
    if len(pieces) == 1:  # one piece covers the whole batch (a pure decode step, or one sequence), in row order
        return pieces[0][1]
    out = q.new_empty(q.shape[0], *pieces[0][1].shape[1:])
    for rows, o in pieces:
        out[rows] = o
    return out


def _short_blocks(layer, q, entries, layout: BatchLayout, kv: AttentionKV, seqs: list[int], expand, scale: float,
                  absorbed_decode) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of short pieces (decode rows and verify pieces of 1 + k tokens) as one padded batch: every
    piece's new entries are written first, then its T queries (padded to the longest piece, T_max) read the
    sequence's history, query j seeing the keys up to its own position. Returns (their flat rows, output)."""
    lens = [layout.extend_lens[i] for i in seqs]
    t_max = max(lens)

    def tables():
        rows = [r for i in seqs for r in range(layout.offsets[i], layout.offsets[i + 1])]
        # query block b, row j: flat row offsets[b] + min(j, T_b - 1) (padding repeats the last row); kept rows
        padded = [layout.offsets[i] + min(j, n - 1) for i, n in zip(seqs, lens) for j in range(t_max)]
        kept = [b * t_max + j for b, n in enumerate(lens) for j in range(n)]
        return layout.tensor(rows), layout.tensor(padded), layout.tensor(kept)

    # every row of the step, in order and unpadded (one verify piece alone, or all of equal length): no gathers
    whole = seqs == list(range(layout.num_seqs)) and t_max == min(lens)
    rows, padded, kept = (slice(None),) * 3 if whole else layout.memo(("short_rows", tuple(seqs)), tables)
    history = kv.extend_padded(layer, seqs, entries[rows], lens)  # [B, S_max, W]
    b, s_max = history.shape[:2]
    mask = layout.memo(("short_mask", s_max), lambda: _length_mask(layout.positions[padded] + 1, s_max).view(
        b, t_max, s_max))
    qb = q[padded].view(b, t_max, *q.shape[1:])  # [B, T_max, H, Dq]
    if absorbed_decode is not None:
        out = absorbed_decode(qb, history, mask)  # [B, T_max, H, Dv]
    else:
        k, v = expand(history.flatten(0, 1))
        k, v = k.view(b, s_max, *k.shape[1:]), v.view(b, s_max, *v.shape[1:])
        out = F.scaled_dot_product_attention(qb.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask[:, None], scale=scale,
                                             enable_gqa=k.shape[2] != q.shape[1]).transpose(1, 2)
    return rows, out.flatten(0, 1)[kept]


def _length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] bool: row b is True in its first lengths[b] columns."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


def _padded_decode_attention(q, k, v, mask, scale) -> torch.Tensor:
    """q: [B, H, Dq]; k: [B, S, Hkv, Dq]; v: [B, S, Hkv, Dv]; mask: [B, 1, 1, S] -> [B, H, Dv]."""
    out = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=k.shape[2] != q.shape[1])
    return out[:, :, 0, :]

"""The part KDA and GDN layers share: short convolution and delta rule over a flat batch with carried state.

Sequences of equal extend length run as one [G, T] batch: a decode step batches every decoding sequence,
a uniform training batch runs in one call, and each prefill chunk of a mixed step runs with its peers.
"""

from __future__ import annotations

from typing import Callable

import torch

from app.models.batch import BatchLayout
from app.ops import causal_conv1d, chunk_gdn, chunk_kda, chunk_states_at, conv_states_at, conv_step, gated_delta_step

# split(conv_out [G, T, C]) -> q [G, T, H, K], k [G, T, H, K], v [G, T, H, V] (q, k already l2-normalised)
SplitQKV = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def recurrent_mix(
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layout: BatchLayout,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor | None,
    ssm_state: torch.Tensor | None,
    split: SplitQKV,
    per_channel_gate: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run one linear-attention layer's token mixing for a flat batch.

    mixed: [N, C] pre-conv q|k|v projections; g: [N, H] (GDN) or [N, H, K] (KDA) log decay; beta: [N, H];
    conv_weight: [C, W]; conv_state: [B, C, W-1] or None (zeros); ssm_state: [B, H, K, V] fp32 or None.
    Returns out [N, H, V] and the new conv [B, C, W-1] and ssm [B, H, K, V] states; with
    `layout.snapshots`, also {(seq, k): (conv [C, W-1], ssm [H, K, V])} after the first k tokens of a piece
    (such a sequence runs alone, in one pass), else an empty dict.
    """
    if any(layout.snapshots):
        return _run_with_snapshots(mixed, g, beta, layout, conv_weight, conv_state, ssm_state, split,
                                   per_channel_gate, chunk_size)
    return (*_run_groups(mixed, g, beta, layout, conv_weight, conv_state, ssm_state, split, per_channel_gate,
                         chunk_size), {})


def _run_groups(mixed, g, beta, layout, conv_weight, conv_state, ssm_state, split, per_channel_gate, chunk_size):
    groups = layout.groups_by_extend_len()
    b = layout.num_seqs
    if len(groups) == 1:
        t = groups[0][0]
        return _run_group(mixed.view(b, t, -1), g.view(b, t, *g.shape[1:]), beta.view(b, t, -1), conv_weight,
                          conv_state, ssm_state, split, per_channel_gate, chunk_size)
    out = None
    new_conv, new_ssm = [None] * b, [None] * b
    for t, seqs in groups:
        tok = layout.tensor([p for i in seqs for p in range(layout.offsets[i], layout.offsets[i] + t)])
        idx = layout.tensor(seqs)
        o, c, s = _run_group(
            mixed[tok].view(len(seqs), t, -1), g[tok].view(len(seqs), t, *g.shape[1:]),
            beta[tok].view(len(seqs), t, -1), conv_weight,
            None if conv_state is None else conv_state[idx], None if ssm_state is None else ssm_state[idx],
            split, per_channel_gate, chunk_size,
        )
        if out is None:
            out = o.new_zeros(mixed.shape[0], *o.shape[1:])
        out = out.index_copy(0, tok, o)
        for j, i in enumerate(seqs):
            new_conv[i], new_ssm[i] = c[j], s[j]
    return out, torch.stack(new_conv), torch.stack(new_ssm)


def _run_with_snapshots(mixed, g, beta, layout, conv_weight, conv_state, ssm_state, split, per_channel_gate,
                        chunk_size):
    """Sequences without snapshots run in groups as usual; each one with snapshots runs alone in one pass
    that also returns its states at the cuts (see `chunk_states_at`): no extra pieces, no extra chunks."""
    plain = [i for i, ks in enumerate(layout.snapshots) if not ks]
    out = None
    new_conv, new_ssm = [None] * layout.num_seqs, [None] * layout.num_seqs
    snaps = {}
    if plain:
        tok = layout.tensor([p for i in plain for p in range(layout.offsets[i], layout.offsets[i + 1])])
        idx = layout.tensor(plain)
        sub = BatchLayout(tuple(layout.extend_lens[i] for i in plain), tuple(layout.cached_lens[i] for i in plain),
                          device=layout.device)
        o, c, s = _run_groups(mixed[tok], g[tok], beta[tok], sub, conv_weight,
                              None if conv_state is None else conv_state[idx],
                              None if ssm_state is None else ssm_state[idx], split, per_channel_gate, chunk_size)
        out = o.new_zeros(mixed.shape[0], *o.shape[1:]).index_copy(0, tok, o)
        for j, i in enumerate(plain):
            new_conv[i], new_ssm[i] = c[j], s[j]
    for i, ks in enumerate(layout.snapshots):
        if not ks:
            continue
        lo, hi = layout.offsets[i], layout.offsets[i + 1]
        c = None if conv_state is None else conv_state[i : i + 1]
        s = None if ssm_state is None else ssm_state[i : i + 1]
        o, c_new, s_new, conv_at, ssm_at = _run_group(mixed[None, lo:hi], g[None, lo:hi], beta[None, lo:hi],
                                                      conv_weight, c, s, split, per_channel_gate, chunk_size, ks)
        if layout.num_seqs == 1:  # the whole batch: no scatter, no stacking
            return o, c_new, s_new, {(0, k): (conv_k[0], ssm_k[0]) for k, conv_k, ssm_k in zip(ks, conv_at, ssm_at)}
        if out is None:
            out = o.new_zeros(mixed.shape[0], *o.shape[1:])
        out[lo:hi] = o
        for k, conv_k, ssm_k in zip(ks, conv_at, ssm_at):
            snaps[(i, k)] = (conv_k[0], ssm_k[0])
        new_conv[i], new_ssm[i] = c_new[0], s_new[0]
    return out, torch.stack(new_conv), torch.stack(new_ssm), snaps


def _run_group(x, g, beta, conv_weight, conv_state, ssm_state, split, per_channel_gate, chunk_size, at=()):
    """x: [G, T, C] -> out [G*T, H, V] and the group's new conv and ssm states; with cut offsets `at`
    (0 < t < T), also the conv states [len(at), G, C, W-1] and ssm states [len(at), G, H, K, V] after them."""
    if x.shape[1] == 1 and not at:
        return _decode_group(x, g, beta, conv_weight, conv_state, ssm_state, split)
    y, conv_new = causal_conv1d(x, conv_weight, None, conv_state, "silu")
    q, k, v = split(y)
    if at:
        o, s, ssm_at = chunk_states_at(at, q, k, v, g, beta, initial_state=ssm_state, chunk_size=chunk_size)
        return o.reshape(-1, *o.shape[2:]), conv_new, s, conv_states_at(x, conv_weight, conv_state, at), ssm_at
    chunk = chunk_kda if per_channel_gate else chunk_gdn
    o, s = chunk(q, k, v, g, beta, initial_state=ssm_state, chunk_size=chunk_size)
    return o.reshape(-1, *o.shape[2:]), conv_new, s


def _decode_group(x, g, beta, conv_weight, conv_state, ssm_state, split):
    """One token per sequence (x: [G, 1, C]) through the few-op decode steps of `app.ops.step`."""
    G, _, C = x.shape
    if conv_state is None:
        conv_state = x.new_zeros(G, C, conv_weight.shape[-1] - 1)
    y, conv_new = conv_step(x[:, 0], conv_weight, conv_state)
    q, k, v = (t[:, 0] for t in split(y[:, None]))
    if ssm_state is None:
        ssm_state = q.new_zeros(G, q.shape[1], q.shape[2], v.shape[-1], dtype=torch.float32)
    o, s = gated_delta_step(q.float(), k.float(), v.float(), g[:, 0].float(), beta[:, 0].float(), ssm_state)
    return o.to(q.dtype), conv_new, s

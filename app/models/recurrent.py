"""The part KDA and GDN layers share: short convolution and delta rule over a flat batch with carried state.

Sequences of equal extend length run as one [G, T] batch: a decode step batches every decoding sequence,
a uniform training batch runs in one call, and each prefill chunk of a mixed step runs with its peers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from app.models.batch import BatchLayout
from app.ops import (
    causal_conv1d,
    chunk_gdn,
    chunk_kda,
    chunk_states_at,
    chunk_with_replay,
    conv_states_at,
    conv_step,
    conv_steps,
    gated_delta_step,
    state_after,
)

# split(conv_out [G, T, C]) -> q [G, T, H, K], k [G, T, H, K], v [G, T, H, V] (q, k already l2-normalised)
SplitQKV = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class VerifyInputs:
    """One layer's rollback record of one speculative verify piece of n tokens, as row j of its group's tensors
    (sliced only when a rollback reads it): the state before the piece (conv0 [G, C, W-1], ssm0 [G, H, K, V]:
    the sequences' slots, untouched until the rollback), the raw conv inputs x [G, T, C], the replay inputs
    (k [G, H, T, K], G [G, H, T, D], delta [G, H, T, V]: see `chunk_with_replay`) and the states after each
    piece's own tokens (conv, ssm)."""

    j: int
    n: int
    conv0: torch.Tensor
    ssm0: torch.Tensor
    x: torch.Tensor
    k: torch.Tensor
    G: torch.Tensor
    delta: torch.Tensor
    conv: torch.Tensor
    ssm: torch.Tensor

    def state_at(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [C, W-1], ssm [H, K, V]) after the first t tokens (1 <= t <= n) of the piece: the pass's own
        final states at t = n (padding leaves the ssm state as it was, and the conv state is taken after the
        piece's own tokens), else replayed from the state before the piece."""
        j = self.j
        if t == self.n:
            return self.conv[j], self.ssm[j]
        w = self.conv0.shape[-1]
        xs = torch.cat([self.conv0[j], self.x[j, :t].transpose(0, 1).to(self.conv0.dtype)], dim=-1)
        return xs[:, t : t + w], state_after(self.ssm0[j], self.k[j, :, :t], self.G[j, :, :t], self.delta[j, :, :t])

    def replay_bytes(self) -> int:
        """Bytes a rollback can read beyond the two states (the slot's, and the final one): the per-token inputs
        of the piece's first n - 1 tokens (a state after all n is the final one), one token per draft."""
        per_token = (t[0].numel() // t.shape[-2] * t.element_size() for t in (self.x, self.k, self.G, self.delta))
        return (self.n - 1) * sum(per_token)


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
    (such a sequence runs alone, in one pass), else an empty dict. With `layout.verify`, that dict also holds
    {("verify", seq): VerifyInputs} for each verify piece.
    """
    if any(layout.snapshots):
        return _run_with_snapshots(mixed, g, beta, layout, conv_weight, conv_state, ssm_state, split,
                                   per_channel_gate, chunk_size)
    return _run_groups(mixed, g, beta, layout, conv_weight, conv_state, ssm_state, split, per_channel_gate,
                       chunk_size, layout.verify)


def _run_groups(mixed, g, beta, layout, conv_weight, conv_state, ssm_state, split, per_channel_gate, chunk_size,
                verify=()):
    """Every sequence in [G, T] groups of equal extend length, and the verify pieces `verify` lists in one group
    padded to the longest of them; returns out, conv, ssm and the verify records (keyed ("verify", index in this
    layout)). A verify piece's own slot is not written from `conv`/`ssm` (see `Worker.run`)."""
    b = layout.num_seqs
    if not verify:
        groups = layout.groups_by_extend_len()
        if len(groups) == 1:
            t = groups[0][0]
            return (*_run_group(mixed.view(b, t, -1), g.view(b, t, *g.shape[1:]), beta.view(b, t, -1), conv_weight,
                                conv_state, ssm_state, split, per_channel_gate, chunk_size), {})
    else:  # decode rows stay a group of their own: padded to a verify piece's length they would cost its compute
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(layout.extend_lens):
            if i not in verify:
                groups.setdefault(n, []).append(i)
        groups = sorted(groups.items())
    out = None
    new_conv, new_ssm = [None] * b, [None] * b
    records = {}
    for t, seqs in groups:
        if len(seqs) == b:
            x, gg, bb, c0, s0 = (mixed.view(b, t, -1), g.view(b, t, *g.shape[1:]), beta.view(b, t, -1), conv_state,
                                 ssm_state)
            o, c, s = _run_group(x, gg, bb, conv_weight, c0, s0, split, per_channel_gate, chunk_size)
            out = o
        else:
            tok = layout.tensor([p for i in seqs for p in range(layout.offsets[i], layout.offsets[i] + t)])
            idx = layout.tensor(seqs)
            o, c, s = _run_group(mixed[tok].view(len(seqs), t, -1), g[tok].view(len(seqs), t, *g.shape[1:]),
                                 beta[tok].view(len(seqs), t, -1), conv_weight,
                                 None if conv_state is None else conv_state[idx],
                                 None if ssm_state is None else ssm_state[idx], split, per_channel_gate, chunk_size)
            out = (o.new_zeros(mixed.shape[0], *o.shape[1:]) if out is None else out).index_copy(0, tok, o)
        for j, i in enumerate(seqs):
            new_conv[i], new_ssm[i] = c[j], s[j]
    if verify:
        out, records, conv, ssm = _verify_pieces(mixed, g, beta, layout, list(verify), out, new_conv, new_ssm,
                                                 conv_weight, conv_state, ssm_state, split)
        if conv is not None:  # every sequence verified, in one unpadded group
            return out, conv, ssm, records
    return out, torch.stack(new_conv), torch.stack(new_ssm), records


def _verify_pieces(mixed, g, beta, layout, seqs, out, new_conv, new_ssm, conv_weight, conv_state, ssm_state, split):
    """The verify pieces `seqs` as one [G, T_max] group: shorter pieces are padded (their padding rows repeat the
    piece's last row, with beta and g zeroed after the conv, so they leave the ssm state unchanged; each piece's
    conv state is taken after its own tokens) and the chunked pass runs with chunk size T_max. Fills `out` and
    the final states; returns out, the records and, when the pieces are the whole batch unpadded, the final conv
    and ssm states as they are (else None, None: filled in)."""
    lens = [layout.extend_lens[i] for i in seqs]
    t_max = max(lens)

    def tables():
        padded = [layout.offsets[i] + min(j, n - 1) for i, n in zip(seqs, lens) for j in range(t_max)]
        real = [b * t_max + j for b, n in enumerate(lens) for j in range(n)]
        rows = [r for i in seqs for r in range(layout.offsets[i], layout.offsets[i + 1])]
        pad = [[j >= n for j in range(t_max)] for n in lens]
        w = conv_weight.shape[-1] - 1  # piece b's conv state: columns n_b .. n_b + w - 1 of concat(state, x)
        after = [[n + c for c in range(w)] for n in lens]
        return (layout.tensor(padded), layout.tensor(real), layout.tensor(rows),
                torch.tensor(pad, device=layout.device), layout.tensor(seqs),
                layout.tensor(after).view(len(lens), 1, w))

    G_ = len(seqs)
    whole = seqs == list(range(layout.num_seqs)) and t_max == min(lens)  # all verify, unpadded: no gathers
    if whole:
        x, gg, bb = mixed.view(G_, t_max, -1), g.view(G_, t_max, *g.shape[1:]), beta.view(G_, t_max, -1)
        c0, s0 = conv_state, ssm_state
    else:
        padded, real, rows, pad, idx, after = layout.memo(("verify_rows", tuple(seqs)), tables)
        x = mixed[padded].view(G_, t_max, -1)
        gg = g[padded].view(G_, t_max, *g.shape[1:])
        bb = beta[padded].view(G_, t_max, -1)
        if t_max != min(lens):
            bb = bb.masked_fill(pad[..., None], 0.0)
            gg = gg.masked_fill(pad.view(G_, t_max, *(1,) * (gg.dim() - 2)), 0.0)
        c0 = None if conv_state is None else conv_state[idx]
        s0 = None if ssm_state is None else ssm_state[idx]
    if c0 is None:
        c0 = x.new_zeros(G_, x.shape[-1], conv_weight.shape[-1] - 1)
    y, conv_new = conv_steps(x, conv_weight, c0)
    if t_max != min(lens):  # a padded piece's conv state: after its own tokens, not the padding
        xs = torch.cat([c0.to(x.dtype), x.transpose(1, 2)], dim=-1)
        conv_new = xs.gather(-1, after.expand(-1, xs.shape[1], -1))
    q, k, v = split(y)
    if s0 is None:
        s0 = q.new_zeros(G_, q.shape[2], q.shape[3], v.shape[-1], dtype=torch.float32)
    o, s, (kk, GG, delta) = chunk_with_replay(q, k, v, gg, bb, initial_state=s0, chunk_size=t_max)
    o = o.reshape(-1, *o.shape[2:])
    if whole:
        out = o
    else:
        out = (o.new_zeros(mixed.shape[0], *o.shape[1:]) if out is None else out).index_copy(0, rows, o[real])
    records = {("verify", i): VerifyInputs(j, n, c0, s0, x, kk, GG, delta, conv_new, s)
               for j, (i, n) in enumerate(zip(seqs, lens))}
    if whole:
        return out, records, conv_new, s
    for j, i in enumerate(seqs):
        new_conv[i], new_ssm[i] = conv_new[j], s[j]
    return out, records, None, None


def _run_with_snapshots(mixed, g, beta, layout, conv_weight, conv_state, ssm_state, split, per_channel_gate,
                        chunk_size):
    """Sequences without snapshots run in groups as usual; each one with snapshots runs alone in one pass
    that also returns its states at the cuts (see `chunk_states_at`): no extra pieces, no extra chunks."""
    plain = [i for i, ks in enumerate(layout.snapshots) if not ks]
    out = None
    new_conv, new_ssm = [None] * layout.num_seqs, [None] * layout.num_seqs
    snaps: dict = {}
    if plain:
        tok = layout.tensor([p for i in plain for p in range(layout.offsets[i], layout.offsets[i + 1])])
        idx = layout.tensor(plain)
        sub = BatchLayout(tuple(layout.extend_lens[i] for i in plain), tuple(layout.cached_lens[i] for i in plain),
                          device=layout.device)
        o, c, s, recs = _run_groups(mixed[tok], g[tok], beta[tok], sub, conv_weight,
                                    None if conv_state is None else conv_state[idx],
                                    None if ssm_state is None else ssm_state[idx], split, per_channel_gate,
                                    chunk_size, tuple(j for j, i in enumerate(plain) if i in layout.verify))
        snaps.update({("verify", plain[j]): r for (_, j), r in recs.items()})
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

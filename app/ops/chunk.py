"""Chunked (WY / UT-transform) gated delta rules in fp32 torch; twins of `naive.py`, same semantics.

Per chunk of C tokens with start state S0 [K, V] and within-chunk cumulative log-decays
G_i = sum_{t<=i} g_t (per key channel for KDA, one per head for GDN):

    A[i, j]   = beta_i * sum_k k_i[k] k_j[k] exp(G_i[k] - G_j[k])       strictly lower (i > j)
    Aqk[i, j] = scale * sum_k q_i[k] k_j[k] exp(G_i[k] - G_j[k])        lower, diagonal included
    (I + A) [u, w] = [beta * v, beta * k * exp(G)]                      unit-lower triangular solve
    delta = u - w S0                                                    the C delta-rule corrections, [C, V]
    o     = (scale * q * exp(G)) S0 + Aqk delta
    S     = exp(G_C) * S0 + (k * exp(G_C - G))^T delta                  rows of S0 scaled per key channel

Stability: every exponent is G_i - G_j with i >= j (or G_i itself), which is <= 0 also in floating point
(a cumsum of non-positive numbers never increases under rounding); pairs with i < j are masked to -inf
before the exp. Strong decays therefore underflow to 0 and never overflow.

Everything before and after the chunk loop is batched over (B, H, chunks); only the inter-chunk state
recurrence loops in Python. Differentiable with autograd (no in-place ops). KDA never builds the full
[.., C, C, K] pairwise decay: see `_kda_intra`; its largest tensors hold (C / s) * T * K values per
(batch, head) with s ~ sqrt(C), i.e. 4x q's size at chunk_size=16 and 8x at 64.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F


def chunk_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet (per-head scalar gate), chunked. Same contract as `naive_gdn`.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log-decay <= 0; beta: [B, T, H]
        scale: defaults to K ** -0.5; initial_state: [B, H, K, V] or None for zeros
    Returns:
        o: [B, T, H, V] in q's dtype; final_state: [B, H, K, V] fp32
    """
    return _chunk_gated_delta(q, k, v, g.unsqueeze(-1), beta, scale, initial_state, chunk_size)[:2]


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi Delta Attention (per key-channel gate), chunked. Same contract as `naive_kda`.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay <= 0; beta: [B, T, H]
        scale: defaults to K ** -0.5; initial_state: [B, H, K, V] or None for zeros
    Returns:
        o: [B, T, H, V] in q's dtype; final_state: [B, H, K, V] fp32
    """
    return _chunk_gated_delta(q, k, v, g, beta, scale, initial_state, chunk_size)[:2]


def chunk_states_at(
    at: Sequence[int],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunk_kda` (g [B, T, H, K]) or `chunk_gdn` (g [B, T, H]) that also returns the states after the
    first t tokens for each t in `at` (0 < t < T), [len(at), B, H, K, V] fp32, from the same single pass:
    a state inside a chunk is its start state advanced by the chunk's first j deltas, one small matmul."""
    if any(not 0 < t < q.shape[1] for t in at):
        raise ValueError(f"snapshot positions {list(at)} must lie in (0, {q.shape[1]})")
    g = g.unsqueeze(-1) if g.dim() == 3 else g
    return _chunk_gated_delta(q, k, v, g, beta, scale, initial_state, chunk_size, at)


def chunk_with_replay(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`chunk_kda` (g [B, T, H, K]) or `chunk_gdn` (g [B, T, H]) over one chunk (T <= chunk_size: a speculative
    verify piece) that also returns its replay inputs (k, G, delta), each [B, H, T, K | D | V] fp32: the keys,
    the cumulative log-decays and the delta-rule corrections the pass computed (FLA's v_new). `state_after` on
    the first t of them rebuilds the state after t tokens from the initial state in one matmul, with the bits
    `chunk_states_at` gives at t."""
    if q.shape[1] > chunk_size:
        raise ValueError(f"a replayable piece fits one chunk: {q.shape[1]} tokens > chunk_size {chunk_size}")
    g = g.unsqueeze(-1) if g.dim() == 3 else g
    B, T, H, K = k.shape
    scale = K**-0.5 if scale is None else scale
    out_dtype = q.dtype
    S0 = q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32) if initial_state is None else initial_state.float()
    # one chunk of T tokens, [B, H, T, *], without the general form's padding to chunk_size and its blocking:
    # a verify piece is a few tokens, where the number of ops dispatched is the cost
    q, k, v, g = (x.float().transpose(1, 2) for x in (q, k, v, g))
    bt = beta.float().transpose(1, 2).unsqueeze(-1)  # [B, H, T, 1]
    kb = k * bt
    qs = q * scale
    G = g.cumsum(dim=-2)
    decay = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill_(_above(T, G.device), float("-inf")).exp_()
    if G.shape[-1] == 1:  # per head: [B, H, T_i, T_j]
        decay = decay.squeeze(-1)
        Aqk, A = (qs @ k.transpose(-1, -2)) * decay, (kb @ k.transpose(-1, -2)) * decay
    else:  # per channel: k_j exp(G_i - G_j) against q_i and beta_i k_i in one matmul
        qk = (decay * k.unsqueeze(-3)) @ torch.stack([qs, kb], dim=-1)  # [B, H, T_i, T_j, 2]
        Aqk, A = qk[..., 0], qk[..., 1]
    from_start = G.exp()
    kf = kb * from_start  # beta_i k_i exp(G_i)
    # the delta-rule corrections solve (I + strictly lower A) delta = beta v - (beta k exp(G)) S0 (unitriangular:
    # A's diagonal and upper part are not read)
    delta = torch.linalg.solve_triangular(A, v * bt - kf @ S0, upper=False, unitriangular=True)  # [B, H, T, V]
    o = (qs * from_start) @ S0 + Aqk @ delta
    # the state after all T: the decay matrix's last row is exp(G_T - G_j), as `state_after` computes it
    last = decay[..., -1, :, None] if G.shape[-1] == 1 else decay[..., -1, :, :]  # [B, H, T_j, D]
    S = S0 * from_start[..., -1:, :].transpose(-1, -2) + (k * last).transpose(-1, -2) @ delta
    return o.transpose(1, 2).to(out_dtype), S, (k, G, delta)


def state_after(state: torch.Tensor, k: torch.Tensor, G: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The state [.., K, V] after the t tokens of (k [.., t, K], G [.., t, D], delta [.., t, V]) from `state`
    (all inside one chunk that starts at `state`): exp(G_t) * S + (k * exp(G_t - G))^T delta, per key channel."""
    G_t = G[..., -1:, :]
    return state * G_t.transpose(-1, -2).exp() + (k * (G_t - G).exp()).transpose(-1, -2) @ delta


def _chunk_gated_delta(q, k, v, g, beta, scale, initial_state, chunk_size, at: Sequence[int] = ()):
    """g: [B, T, H, D] with D = K (per channel) or D = 1 (per head, scalar path with plain matmuls).
    Returns o, the final state and the states after the first t tokens for t in `at` (stacked, or None).
    The work is `_chunk_core`'s, or a compiled twin of it where one is in force (`compiled_cores`)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    out_dtype = q.dtype
    scale = K**-0.5 if scale is None else scale
    S0 = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    if T == 0:
        return v.new_zeros(B, 0, H, V, dtype=out_dtype), S0, None
    C = chunk_size
    core, chunks = _core_for(q, g, beta, S0, scale, C, -(-T // C))
    pad = (0, 0, 0, 0, 0, chunks * C - T)  # zero k, v, g and beta: a padding token leaves the state as it is
    q, k, v, g = (F.pad(x.float(), pad) for x in (q, k, v, g))
    beta = F.pad(beta.float(), pad[2:])
    o, S, starts, deltas, k, G = core(q, k, v, g, beta, S0)
    inside = torch.stack([_state_inside(t, C, starts, deltas, k, G) for t in at]) if at else None
    return o[:, :T].to(out_dtype), S, inside


def _chunk_core(q, k, v, g, beta, S0, scale: float, C: int):
    """The chunked pass over fp32 q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, D], beta [B, T, H] with T a
    multiple of C, from S0 [B, H, K, V]. Returns o [B, T, H, V], the final state, each chunk's start state
    [B, H, N, K, V] and corrections [B, H, N, C, V], and the chunked keys [B, H, N, C, K] and cumulative
    log-decays [B, H, N, C, D] (what a state inside a chunk is rebuilt from)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    q, k, v, g = (_to_chunks(x, C) for x in (q, k, v, g))  # [B, H, N, C, *]
    beta = _to_chunks(beta.unsqueeze(-1), C)  # [B, H, N, C, 1]
    q = q * scale
    k_beta = k * beta

    G = g.cumsum(dim=-2)  # [B, H, N, C, D]
    intra = _gdn_intra if g.shape[-1] == 1 else _kda_intra
    Aqk, A = intra(q, k_beta, k, G)  # [B, H, N, C, C] each
    A = A.tril(-1)  # the solve ignores the diagonal; tril keeps its gradient out too
    from_start = G.exp()

    rhs = torch.cat([v * beta, k_beta * from_start], dim=-1)
    u, w = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([V, K], dim=-1)
    chunk_decay = from_start[..., -1, :].unsqueeze(-1)  # [B, H, N, D, 1]: exp(G_C) scales rows of S
    k_to_end = k * (G[..., -1:, :] - G).exp()

    S, starts, deltas = S0, [], []
    # unbind, not u[:, :, n]: one backward stack instead of a full-size zero-filled grad per chunk
    for u_n, w_n, decay_n, k_n in zip(*(x.unbind(2) for x in (u, w, chunk_decay, k_to_end))):
        starts.append(S)
        delta = u_n - w_n @ S  # [B, H, C, V]
        deltas.append(delta)
        S = S * decay_n + k_n.transpose(-1, -2) @ delta
    starts, deltas = torch.stack(starts, dim=2), torch.stack(deltas, dim=2)  # [B, H, N, K|C, V]

    o = (q * from_start) @ starts + Aqk @ deltas  # [B, H, N, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(B, T, H, V), S, starts, deltas, k, G


# compiled twins of `_chunk_core` in force in this context (`compiled_cores`): core_key -> {chunk count: callable}
_CORES: ContextVar[dict | None] = ContextVar("compiled_chunk_cores", default=None)


def core_key(per_channel: bool, C: int, H: int, K: int, V: int, scale: float) -> tuple:
    """What a compiled core is specialised to, besides its chunk count (and the batch, which it takes any of)."""
    return (per_channel, C, H, K, V, float(scale))


@contextmanager
def compiled_cores(cores: dict | None):
    """Within this block (this thread), inference passes of a shape in `cores` (core_key -> {chunk count: a callable
    with `_chunk_core`'s tensor inputs and outputs}) run on the core of the smallest chunk count >= theirs, their
    input padded with tokens that leave the state as it is (app/engine/prefill.py makes them). Passes that need
    gradients, run off the CPU or find no core large enough run `_chunk_core` itself."""
    token = _CORES.set(cores)
    try:
        yield
    finally:
        _CORES.reset(token)


def _core_for(q, g, beta, S0, scale, C, chunks):
    """(the core to run, the chunk count it takes)."""
    installed = _CORES.get()
    cores = installed.get(core_key(g.shape[-1] != 1, C, q.shape[2], q.shape[3], S0.shape[-1], scale)) \
        if installed and q.device.type == "cpu" and not torch.is_grad_enabled() else None
    fit = min((n for n in cores if n >= chunks), default=None) if cores else None
    if fit is None:
        return lambda *xs: _chunk_core(*xs, scale, C), chunks
    return cores[fit], fit


def _state_inside(t: int, C: int, starts, deltas, k, G) -> torch.Tensor:
    """State after t tokens, t = n*C + j: chunk n's start state advanced by its first j deltas."""
    n, j = divmod(t, C)
    if j == 0:
        return starts[:, :, n]
    return state_after(starts[:, :, n], k[:, :, n, :j], G[:, :, n, :j], deltas[:, :, n, :j])


def _to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, N, C, D], T a multiple of C."""
    B, T, H, D = x.shape
    return x.reshape(B, T // C, C, H, D).permute(0, 3, 1, 2, 4)


def _gdn_intra(q, k_beta, k, G):
    """Per-head decay: Aqk, A [.., C, C] are plain Gram matrices times exp(G_i - G_j) ([.., C, 1] G)."""
    decay = _masked_exp(G.unsqueeze(-2) - G.unsqueeze(-3), _causal(G.shape[-2], G.device)).squeeze(-1)
    return (q @ k.transpose(-1, -2)) * decay, (k_beta @ k.transpose(-1, -2)) * decay


def _kda_intra(q, k_beta, k, G):
    """Per-channel decay: M[i, j] = sum_k x_i[k] k_j[k] exp(G_i[k] - G_j[k]), i >= j, for x = q and k_beta.

    The chunk is cut into n blocks of s tokens. Pairs inside a diagonal block use the pairwise
    [s, s, K] decay; pairs across blocks factor through R_a, the G of the last token before block a:
    exp(G_i - G_j) = exp(G_i - R_a) * exp(R_a - G_j), both exponents <= 0, one matmul per block.

            j: block 0  block 1  block 2
        i: 0 [ inside   0        0      ]
           1 [ across   inside   0      ]
           2 [ across   across   inside ]

    Args: q, k_beta, k, G: [.., C, K]. Returns: Aqk, A: [.., C, C].
    """
    C, K = k.shape[-2:]
    s = max(d for d in range(1, math.isqrt(C) + 1) if C % d == 0)  # ~sqrt(C): balances inside vs across sizes
    n = C // s

    def blocks(x):  # [.., C, K] -> [.., n, s, K]
        return x.unflatten(-2, (n, s))

    x = torch.stack([blocks(q), blocks(k_beta)], dim=-3)  # [.., n, 2, s, K]
    Gb = blocks(G)

    # inside: [.., n, s_i, s_j, K] @ [.., n, s_i, K, 2] -> [.., n, 2, s_i, s_j]
    decay_in = _masked_exp(Gb.unsqueeze(-2) - Gb.unsqueeze(-3), _causal(s, G.device))
    inside = ((decay_in * blocks(k).unsqueeze(-3)) @ x.movedim(-3, -1)).movedim(-1, -3)

    # across: [.., n, 2s, K] @ [.., n, K, C] -> [.., n, 2, s_i, C]
    R = F.pad(Gb[..., :-1, -1, :], (0, 0, 1, 0))  # [.., n, K], 0 before the first block
    x_out = (x * (Gb - R.unsqueeze(-2)).exp().unsqueeze(-3)).flatten(-3, -2)
    earlier = torch.arange(C, device=G.device) < s * torch.arange(n, device=G.device).unsqueeze(-1)  # [n, C]
    k_out = k.unsqueeze(-3) * _masked_exp(R.unsqueeze(-2) - G.unsqueeze(-3), earlier)  # [.., n, C, K]
    across = (x_out @ k_out.transpose(-1, -2)).unflatten(-2, (2, s))

    # place inside on the block diagonal: [.., n_a, 2, s_i, n_b, s_j] with n_b == n_a
    eye = torch.eye(n, dtype=G.dtype, device=G.device).view(n, 1, 1, n, 1)
    M = across.unflatten(-1, (n, s)) + inside.unsqueeze(-2) * eye
    M = M.flatten(-2, -1).movedim(-4, -3).flatten(-3, -2)  # [.., 2, C, C]
    return M.unbind(-3)


def _causal(C: int, device) -> torch.Tensor:
    """[C, C] bool, True where i >= j."""
    return torch.ones(C, C, dtype=torch.bool, device=device).tril()


@functools.lru_cache(maxsize=64)
def _above(T: int, device) -> torch.Tensor:
    """[T, T, 1] bool, True where j > i (a cached mask: a verify piece's size repeats every step)."""
    return torch.ones(T, T, dtype=torch.bool, device=device).triu(1).unsqueeze(-1)


def _masked_exp(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """exp(x) where keep ([.., C_i, C_j], broadcast over the last dim of x), else 0; masked before the exp."""
    return x.masked_fill(~keep.unsqueeze(-1), float("-inf")).exp()

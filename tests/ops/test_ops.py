"""app.ops: chunked vs naive gated delta rules (GDN, KDA), the causal conv, and transformers' torch paths.

Tolerances (relative RMS error, `err_ratio`), fp32, l2-normalised q/k, beta in (0, 1):
    chunked vs naive, outputs and final states:   1e-5 mild decays, 2e-5 strong decays (g down to -20)
    naive vs transformers' recurrent torch paths: 1e-6
    gradients, chunked vs naive:                  1e-5
    decode steps (step.py) vs naive at T=1:       1e-6
"""

from __future__ import annotations

import inspect
from functools import partial

import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen

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
    l2norm,
    naive_causal_conv1d,
    naive_gdn,
    naive_kda,
    state_after,
)

NAIVE = {"gdn": naive_gdn, "kda": naive_kda}
CHUNK = {"gdn": chunk_gdn, "kda": chunk_kda}
# The torch fallbacks themselves, even where fla / causal_conv1d would be dispatched to.
HF_RECURRENT = {
    "gdn": inspect.unwrap(hf_qwen.torch_recurrent_gated_delta_rule),
    "kda": inspect.unwrap(hf_kimi.recurrent_kimi_delta_attention),
}
HF_CHUNK = {
    "gdn": inspect.unwrap(hf_qwen.torch_chunk_gated_delta_rule),
    "kda": inspect.unwrap(hf_kimi.chunk_kimi_delta_attention),
}
DECAYS = {"mild": 1.0, "strong": 20.0}  # g ~ -U(0, bound) per token (per channel for KDA)
RATIO = {"mild": 1e-5, "strong": 2e-5}


def err_ratio(ref: torch.Tensor, tri: torch.Tensor) -> float:
    """RMS of the difference over RMS of the reference (fla's get_err_ratio)."""
    ref, tri = ref.detach().double(), tri.detach().double()
    return ((ref - tri).square().mean().sqrt() / (ref.square().mean().sqrt() + 1e-8)).item()


def assert_close(name: str, ref: torch.Tensor, tri: torch.Tensor, ratio: float, atol: float = 1e-6) -> None:
    """Finite, same shape, and max abs error <= atol or relative RMS error <= ratio (fla's assert_close)."""
    assert ref.shape == tri.shape, f"{name}: shape {tuple(tri.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(tri).all(), f"{name}: non-finite values"
    abs_err = (ref.detach().double() - tri.detach().double()).abs().max().item()
    if abs_err <= atol:
        return
    err = err_ratio(ref, tri)
    assert err <= ratio, f"{name}: err ratio {err:.2e} > {ratio:.0e} (max abs err {abs_err:.2e})"


def make_inputs(op, B, T, H, K, V, decay="mild", init=False, seed=0):
    """q, k: [B, T, H, K] l2-normalised; v: [B, T, H, V]; g: [B, T, H(, K)]; beta: [B, T, H]; S0: [B, H, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(B, T, H, K, generator=gen)) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g_shape = (B, T, H, K) if op == "kda" else (B, T, H)
    g = -DECAYS[decay] * torch.rand(*g_shape, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    S0 = torch.randn(B, H, K, V, generator=gen) if init else None
    return q, k, v, g, beta, S0


SHAPES = [  # B, T, H, K, V, C
    (2, 300, 2, 16, 32, 64),
    (2, 300, 2, 16, 32, 16),
    (1, 128, 3, 32, 16, 64),
    (1, 7, 2, 16, 16, 16),
    (2, 100, 2, 64, 64, 16),
]
CHUNK_CASES = [
    pytest.param(op, shape, init, decay, id=f"{op}-B{B}-T{T}-H{H}-K{K}-V{V}-C{C}-{'init' if init else 'zero'}-{decay}")
    for op in ("gdn", "kda")
    for shape in SHAPES
    for B, T, H, K, V, C in [shape]
    for init in (False, True)
    for decay in DECAYS
]


@pytest.mark.parametrize("op", ["gdn", "kda"])
@pytest.mark.parametrize("decay", list(DECAYS))
@pytest.mark.parametrize("B, H, K, V", [(1, 2, 16, 16), (16, 4, 32, 32), (3, 2, 64, 32)], ids=lambda x: str(x))
@pytest.mark.parametrize("form", ["eager", "traced"])
def test_decode_step_matches_naive(op, decay, B, H, K, V, form):
    """Six successive `gated_delta_step`s from a random state equal the naive loop over the same 6 tokens;
    `traced`: the form a compiled decode step traces (broadcasts and sums), run by Dynamo's eager backend."""
    q, k, v, g, beta, S0 = make_inputs(op, B, 6, H, K, V, decay, init=True)
    o_ref, S_ref = NAIVE[op](q, k, v, g, beta, initial_state=S0)
    step = gated_delta_step
    if form == "traced":
        torch._dynamo.reset()
        step = torch.compile(gated_delta_step, backend="eager", fullgraph=True)
    S, outs = S0, []
    for t in range(6):
        o, S = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        outs.append(o)
    assert_close("o", o_ref, torch.stack(outs, dim=1), 1e-6)
    assert_close("state", S_ref, S, 1e-6)


def test_conv_step_matches_conv():
    x, weight, _, s = _conv_inputs(4, 5, 24, 4, "state", False)
    y_ref, s_ref = naive_causal_conv1d(x, weight, None, s, "silu")
    ys = []
    for t in range(5):
        y, s = conv_step(x[:, t], weight, s)
        ys.append(y)
    assert_close("y", y_ref, torch.stack(ys, dim=1), 1e-6)
    assert torch.equal(s_ref, s)
    y5, s5 = conv_steps(x, weight, _conv_inputs(4, 5, 24, 4, "state", False)[3])
    assert torch.equal(y5, torch.stack(ys, dim=1)) and torch.equal(s5, s)  # the same arithmetic per position


@pytest.mark.parametrize("op, shape, init, decay", CHUNK_CASES)
def test_chunk_matches_naive(op, shape, init, decay):
    B, T, H, K, V, C = shape
    q, k, v, g, beta, S0 = make_inputs(op, B, T, H, K, V, decay, init)
    o_ref, S_ref = NAIVE[op](q, k, v, g, beta, initial_state=S0)
    o, S = CHUNK[op](q, k, v, g, beta, initial_state=S0, chunk_size=C)
    assert_close("o", o_ref, o, RATIO[decay])
    assert_close("state", S_ref, S, RATIO[decay])


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_chunk_scale_and_dtype(op):
    """A custom scale is honoured; bf16 inputs give a bf16 output and an fp32 state."""
    q, k, v, g, beta, S0 = make_inputs(op, 1, 40, 2, 16, 16, init=True)
    o_ref, S_ref = NAIVE[op](q, k, v, g, beta, scale=0.3, initial_state=S0)
    o, S = CHUNK[op](q, k, v, g, beta, scale=0.3, initial_state=S0, chunk_size=16)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("state", S_ref, S, 1e-5)
    bf16 = [x.bfloat16() for x in (q, k, v, g, beta)]
    for fn in (NAIVE[op], CHUNK[op]):
        o_b, S_b = fn(*bf16, scale=0.3, initial_state=S0)
        assert o_b.dtype == torch.bfloat16 and S_b.dtype == torch.float32
        o_up, _ = fn(*(x.float() for x in bf16), scale=0.3, initial_state=S0)
        assert_close("o bf16", o_up, o_b.float(), 1e-2)


@pytest.mark.parametrize("op", ["gdn", "kda"])
@pytest.mark.parametrize("C", [16, 64])
def test_chunk_extreme_decay_is_finite(op, C):
    """g = -20 on every token: within-chunk cumulative sums reach -20 * C (-1280), values and grads stay finite."""
    q, k, v, g, beta, S0 = make_inputs(op, 1, 2 * C + 5, 2, 16, 16, init=True)
    g = torch.full_like(g, -20.0).requires_grad_()
    inputs = [x.requires_grad_() for x in (q, k, v, beta, S0)]
    o, S = CHUNK[op](q, k, v, g, beta, initial_state=S0, chunk_size=C)
    o_ref, S_ref = NAIVE[op](q, k, v, g, beta, initial_state=S0)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("state", S_ref, S, 1e-5)
    (o.sum() + S.sum()).backward()
    for x in (*inputs, g):
        assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("op", ["gdn", "kda"])
@pytest.mark.parametrize("kind", ["naive", "chunk"])
def test_two_pieces_equal_one(op, kind):
    """Running T tokens as [0, 37) then [37, T) with the carried state equals one run."""
    fn = NAIVE[op] if kind == "naive" else partial(CHUNK[op], chunk_size=16)
    q, k, v, g, beta, S0 = make_inputs(op, 2, 90, 2, 16, 16, init=True)
    o_all, S_all = fn(q, k, v, g, beta, initial_state=S0)
    first, second = ([x[:, :37] for x in (q, k, v, g, beta)], [x[:, 37:] for x in (q, k, v, g, beta)])
    o1, S1 = fn(*first, initial_state=S0)
    o2, S2 = fn(*second, initial_state=S1)
    assert_close("o", o_all, torch.cat([o1, o2], dim=1), 1e-5)
    assert_close("state", S_all, S2, 1e-5)


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_states_inside_the_pass_equal_prefix_runs(op):
    """chunk_states_at: the state after t tokens (inside a chunk, on a boundary, in the last chunk) equals the
    naive final state of the first t tokens, and o and the final state equal the plain chunked op's."""
    q, k, v, g, beta, S0 = make_inputs(op, 2, 90, 2, 16, 16, init=True)
    at = [1, 15, 16, 37, 64, 89]
    o, S, inside = chunk_states_at(at, q, k, v, g, beta, initial_state=S0, chunk_size=16)
    o_plain, S_plain = CHUNK[op](q, k, v, g, beta, initial_state=S0, chunk_size=16)
    assert torch.equal(o, o_plain) and torch.equal(S, S_plain)
    for t, state in zip(at, inside):
        assert_close(f"state@{t}", NAIVE[op](*(x[:, :t] for x in (q, k, v, g, beta)), initial_state=S0)[1], state, 1e-5)
    with pytest.raises(ValueError, match="snapshot positions"):
        chunk_states_at([90], q, k, v, g, beta, initial_state=S0)


@pytest.mark.parametrize("op", ["gdn", "kda"])
@pytest.mark.parametrize("decay", list(DECAYS))
@pytest.mark.parametrize("T", [2, 5, 17])
def test_replay_pass_matches_naive(op, decay, T):
    """chunk_with_replay (a speculative verify piece, one chunk): o and the final state equal the naive loop's,
    and `state_after` on its first t replay inputs equals the naive state after t tokens, for every t."""
    q, k, v, g, beta, S0 = make_inputs(op, 3, T, 2, 16, 32, decay, init=True)
    o, S, (kk, G, delta) = chunk_with_replay(q, k, v, g, beta, initial_state=S0, chunk_size=T)
    o_ref, S_ref = NAIVE[op](q, k, v, g, beta, initial_state=S0)
    assert_close("o", o_ref, o, RATIO[decay])
    assert_close("state", S_ref, S, RATIO[decay])
    for t in range(1, T + 1):
        ref = NAIVE[op](*(x[:, :t] for x in (q, k, v, g, beta)), initial_state=S0)[1]
        assert_close(f"state@{t}", ref, state_after(S0, kk[:, :, :t], G[:, :, :t], delta[:, :, :t]), RATIO[decay])
    assert torch.equal(state_after(S0, kk, G, delta), S)
    with pytest.raises(ValueError, match="fits one chunk"):
        chunk_with_replay(q, k, v, g, beta, initial_state=S0, chunk_size=T - 1)


@pytest.mark.parametrize("op", ["gdn", "kda"])
@pytest.mark.parametrize("init", [False, True], ids=["zero", "init"])
def test_naive_matches_transformers(op, init):
    q, k, v, g, beta, S0 = make_inputs(op, 2, 50, 3, 16, 8, decay="mild", init=init)
    o_ref, S_ref = HF_RECURRENT[op](
        q, k, v, g, beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=False
    )
    o, S = NAIVE[op](q, k, v, g, beta, initial_state=S0)
    assert_close("o", o_ref, o, 1e-6)
    assert_close("state", S_ref, S, 1e-6)


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_chunk_matches_transformers_chunk(op):
    q, k, v, g, beta, S0 = make_inputs(op, 1, 40, 2, 16, 8, init=True)
    o_ref, S_ref = HF_CHUNK[op](
        q, k, v, g, beta, chunk_size=16, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=False
    )
    o, S = CHUNK[op](q, k, v, g, beta, initial_state=S0, chunk_size=16)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("state", S_ref, S, 1e-5)


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_chunk_grads_match_naive(op):
    q, k, v, g, beta, S0 = make_inputs(op, 1, 40, 2, 8, 8, init=True)
    gen = torch.Generator().manual_seed(1)
    do, dS = torch.randn(1, 40, 2, 8, generator=gen), torch.randn(1, 2, 8, 8, generator=gen)

    def grads(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
        o, S = fn(*leaves[:5], initial_state=leaves[5])
        torch.autograd.backward([o, S], [do, dS])
        return [x.grad for x in leaves]

    ref = grads(NAIVE[op])
    tri = grads(partial(CHUNK[op], chunk_size=16))
    for name, r, t in zip(["dq", "dk", "dv", "dg", "dbeta", "dS0"], ref, tri):
        assert_close(name, r, t, 1e-5)


def test_l2norm_matches_transformers():
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(l2norm(x), hf_qwen.l2norm(x, dim=-1, eps=1e-6))


# ---- causal conv ----

CONV_CASES = [
    pytest.param(B, T, C, W, state, bias, act, id=f"B{B}-T{T}-C{C}-W{W}-{state}-{'bias' if bias else 'nobias'}-{act}")
    for B, T, C, W in [(2, 50, 8, 4), (1, 2, 6, 4), (2, 9, 4, 1)]
    for state in ("zero", "state")
    for bias in (False, True)
    for act in ("silu", None)
]


def _conv_inputs(B, T, C, W, state, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(B, T, C, generator=gen), torch.randn(C, W, generator=gen)
    b = torch.randn(C, generator=gen) if bias else None
    s = torch.randn(B, C, W - 1, generator=gen) if state == "state" else None
    return x, weight, b, s


@pytest.mark.parametrize("B, T, C, W, state, bias, act", CONV_CASES)
def test_conv_matches_naive(B, T, C, W, state, bias, act):
    x, weight, b, s = _conv_inputs(B, T, C, W, state, bias)
    y_ref, s_ref = naive_causal_conv1d(x, weight, b, s, act)
    y, s_out = causal_conv1d(x, weight, b, s, act)
    assert_close("y", y_ref, y, 1e-6)
    assert torch.equal(s_ref, s_out)
    history = torch.cat([torch.zeros(B, C, W - 1) if s is None else s, x.transpose(1, 2)], dim=-1)
    assert torch.equal(s_out, history[:, :, history.shape[-1] - (W - 1) :])


@pytest.mark.parametrize("act", ["silu", None])
def test_conv_matches_transformers(act):
    """Zero state vs causal_conv1d_fn; carried state vs causal_conv1d_update (state of W-1 inputs)."""
    x, weight, b, s = _conv_inputs(2, 20, 8, 4, "state", True)
    y_ref = inspect.unwrap(hf_qwen.causal_conv1d_fn)(x.transpose(1, 2), weight, b, activation=act)
    assert_close("y zero state", y_ref.transpose(1, 2), causal_conv1d(x, weight, b, None, act)[0], 1e-6)
    hf_state = s.clone()
    y_ref = inspect.unwrap(hf_qwen.causal_conv1d_update)(x.transpose(1, 2), hf_state, weight, b, activation=act)
    y, s_out = causal_conv1d(x, weight, b, s, act)
    assert_close("y with state", y_ref.transpose(1, 2), y, 1e-6)
    assert torch.equal(hf_state, s_out)


@pytest.mark.parametrize("fn", [causal_conv1d, naive_causal_conv1d], ids=["conv", "naive"])
def test_conv_two_pieces_equal_one(fn):
    x, weight, b, s = _conv_inputs(2, 30, 8, 4, "state", True)
    y_all, s_all = fn(x, weight, b, s)
    y1, s1 = fn(x[:, :2], weight, b, s)  # shorter than W - 1
    y2, s2 = fn(x[:, 2:], weight, b, s1)
    assert_close("y", y_all, torch.cat([y1, y2], dim=1), 1e-6)
    assert torch.equal(s_all, s2)


def test_conv_states_at_equal_prefix_runs():
    """The carried state after t inputs equals causal_conv1d's final state on x[:, :t], from zeros or a state."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 9, 6, generator=g), torch.randn(6, 4, generator=g)
    for state in (None, torch.randn(2, 6, 3, generator=g)):
        at = [1, 2, 5, 8]
        for t, got in zip(at, conv_states_at(x, w, state, at)):
            assert torch.equal(got, causal_conv1d(x[:, :t], w, None, state)[1])


def test_conv_grads_match_naive():
    x, weight, b, s = _conv_inputs(2, 12, 4, 4, "state", True)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x, weight, b, s)]
        y, _ = fn(*leaves)
        y.square().sum().backward()
        return [t.grad for t in leaves]

    for name, r, t in zip(["dx", "dweight", "dbias", "dstate"], grads(naive_causal_conv1d), grads(causal_conv1d)):
        assert_close(name, r, t, 1e-6)

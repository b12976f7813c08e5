"""The sampler (app/engine/sampling.py) against its full-sort reference: the nucleus it keeps, the
distribution it draws from (frequencies over many draws), the tokens it must never draw, seeds."""

from __future__ import annotations

import pytest
import torch

from app.engine.sampling import naive_token_probs, nucleus, sample_rows, sample_token

LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.4, 1.0, -2.0, 0.0, float("-inf")])


def _kept(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """nucleus() of one row: the kept probabilities and ids."""
    values, ids = nucleus(probs[None], torch.tensor([top_p]))
    keep = values[0] > 0
    return values[0][keep], _ids(ids, values)[0][keep]


def _ids(ids: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """nucleus()'s ids, where None stands for the vocabulary in order."""
    return torch.arange(values.shape[-1]).expand_as(values) if ids is None else ids


def _exact_set(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """bool [V]: the nucleus of one row by a full sort, the mass summed in float64."""
    values, order = probs.double().sort(descending=True)
    keep = torch.zeros(probs.shape, dtype=torch.bool)
    keep[order[(values.cumsum(0) - values) < top_p]] = True
    return keep


@pytest.mark.parametrize("temperature, top_p, top_k", [
    (1.0, 1.0, 0), (0.5, 1.0, 0), (1.0, 0.7, 0), (0.8, 0.9, 3), (1.0, 1.0, 2), (2.0, 0.5, 0)])
def test_draws_follow_the_reference_distribution(temperature, top_p, top_k):
    want = naive_token_probs(LOGITS, temperature, top_p, top_k)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.bincount(torch.tensor([sample_token(LOGITS, temperature, top_p, gen, top_k) for _ in range(n)]),
                            minlength=LOGITS.numel())
    freq = counts.double() / n
    assert (freq[want == 0] == 0).all()  # outside the nucleus / top-k, and -inf logits, never drawn
    # binomial standard error at n = 20000 is at most 0.0036; 5 of them
    assert (freq - want.double()).abs().max().item() < 0.018, (freq, want)


def test_top_p_keeps_the_token_that_crosses_it():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    values, ids = _kept(probs, 0.7)
    assert ids.tolist() == [0, 1] and torch.allclose(values, torch.tensor([0.5, 0.3]))
    assert _kept(probs, 0.5)[1].tolist() == [0]
    assert _kept(probs, 0.81)[1].tolist() == [0, 1, 2]
    assert _kept(probs, 0.99)[1].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("scale, top_p", [(8.0, 0.9), (4.0, 0.9), (4.0, 0.999), (1.0, 0.95), (0.05, 0.9)])
def test_nucleus_over_a_large_vocabulary_equals_the_full_sort(scale, top_p):
    """V = 151936 (Qwen3-Next). Nucleus sizes here: 12 (scale 8: the first try, topk 256, holds it), 1073
    (scale 4) and 33433 to 151757 (the radix select)."""
    logits = torch.randn(151936, generator=torch.Generator().manual_seed(1)) * scale
    probs = torch.softmax(logits, -1)
    values, ids = _kept(probs, top_p)
    want = naive_token_probs(logits, 1.0, top_p)
    assert set(ids.tolist()) == set(torch.nonzero(want).flatten().tolist())
    assert torch.allclose(values / values.sum(), want[ids], atol=1e-7)
    assert (nucleus(probs[None], torch.tensor([top_p]))[1] is not None) == (scale == 8.0)  # None: whole row


def test_greedy_seeds_and_zero_weight_tokens():
    logits = torch.tensor([0.0, 3.0, 3.0, -1.0])
    assert sample_token(logits, 0.0, 1.0, None) == 1  # first maximum on ties
    runs = [[sample_token(LOGITS, 1.0, 0.9, torch.Generator().manual_seed(s)) for _ in range(1)] for s in range(50)]
    again = [[sample_token(LOGITS, 1.0, 0.9, torch.Generator().manual_seed(s)) for _ in range(1)] for s in range(50)]
    assert runs == again and len({r[0] for r in runs}) > 1
    one_hot = torch.full((151936,), float("-inf"))
    one_hot[12345] = 0.0
    assert {sample_token(one_hot, 1.0, 0.9, None) for _ in range(20)} == {12345}
    assert {sample_token(one_hot, 1.5, 1.0, None, top_k=40) for _ in range(20)} == {12345}


def test_rows_sample_together_each_from_its_own_distribution():
    """sample_rows with a different setting per row: each row's frequencies match its reference, and a
    seeded row gives the same tokens alone as in the batch."""
    settings = [(1.0, 1.0, 0), (0.7, 0.8, 0), (1.3, 1.0, 3), (0.9, 0.6, 5)]
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 0.5, LOGITS.roll(3)])
    logits[1, 0] = float("-inf")
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    n = 12000
    draws = torch.tensor([sample_rows(logits, *zip(*settings), gens) for _ in range(n)])  # [n, rows]
    for row, (t, p, k) in enumerate(settings):
        want = naive_token_probs(logits[row], t, p, k).double()
        freq = torch.bincount(draws[:, row], minlength=LOGITS.numel()).double() / n
        assert (freq[want == 0] == 0).all() and (freq - want).abs().max().item() < 0.025, (row, freq, want)
    alone = [sample_token(logits[1], 0.7, 0.8, torch.Generator().manual_seed(1)) for _ in range(1)]
    batched = sample_rows(logits, *zip(*settings), [torch.Generator().manual_seed(i) for i in range(4)])
    assert batched[1] == alone[0]


def test_batched_nucleus_rows_stop_at_different_tries():
    """Rows whose sets hold 12, ~1000, ~33000 and ~135000 tokens, in one call: each equals its full sort."""
    base = torch.randn(151936, generator=torch.Generator().manual_seed(1))
    logits = torch.stack([base * 8.0, base * 4.0, base.roll(5) * 4.0, base * 0.05])
    top_p = torch.tensor([0.9, 0.9, 0.999, 0.9])
    values, ids = nucleus(torch.softmax(logits, -1), top_p)
    for row in range(4):
        keep = values[row] > 0
        want = naive_token_probs(logits[row], 1.0, float(top_p[row]))
        assert set(_ids(ids, values)[row][keep].tolist()) == set(torch.nonzero(want).flatten().tolist())
        assert (values[row][~keep] == 0).all()


def test_radix_select_equals_the_full_sort_on_flat_rows():
    """Batches of flat rows (nuclei of about 1800 of 4096 tokens, found by the radix select), token 0 the one
    that crosses top_p (a gather padded with id 0 once dropped it): each row's set is the float64 full sort's."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        logits = torch.randn(16, 4096, generator=gen) / 0.7
        for row in range(16):  # token 0 becomes the token that crosses top_p: undecided to the end
            last = _exact_set(torch.softmax(logits[row], -1), 0.9).nonzero()[:, 0]
            cut = last[logits[row, last].argmin()]
            logits[row, [0, cut]] = logits[row, [cut, 0]]
        probs = torch.softmax(logits, -1)
        values, ids = nucleus(probs, torch.full((16,), 0.9), logits)
        assert ids is None
        for row in range(16):
            assert torch.equal(values[row] > 0, _exact_set(probs[row], 0.9)), row


def test_radix_select_cuts_ties_to_the_size_of_the_set():
    """1000 equal logits cannot be split by buckets: the set is then cut by sorting, to exactly the number of
    tokens whose mass ranked above stays under top_p, with their own probabilities."""
    logits = torch.cat([torch.tensor([4.0]), torch.zeros(1000)])
    probs = torch.softmax(logits, -1)
    values, ids = nucleus(probs[None], torch.tensor([0.5]))
    kept = values[0] > 0
    want = _exact_set(probs, 0.5)
    assert ids is None and int(kept.sum()) == int(want.sum()) and bool(kept[0])
    assert torch.equal(values[0][kept], probs[kept])


def test_flat_rows_draw_from_their_nucleus():
    """Draws through the radix select path (V = 1000, nucleus of about 700): never outside the set, and the
    mass drawn per group of ids (id mod 8) matches the reference's."""
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(3)) * 0.5
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    n = 20000
    draws = torch.tensor([sample_rows(logits, [1.0, 0.8], [0.8, 0.95], [0, 0], gens) for _ in range(n)])
    for row, (t, p) in enumerate([(1.0, 0.8), (0.8, 0.95)]):
        want = naive_token_probs(logits[row], t, p).double()
        assert (want[draws[:, row]] > 0).all()
        groups = torch.arange(1000) % 8
        freq = torch.bincount(groups[draws[:, row]], minlength=8).double() / n
        mass = torch.zeros(8, dtype=torch.float64).index_add_(0, groups, want)
        assert (freq - mass).abs().max().item() < 0.015, (row, freq, mass)

"""The sampler (app/models/sampling.py) against its full-sort reference: the nucleus it keeps, the
distribution it draws from (frequencies over many draws), the tokens it must never draw, seeds."""

from __future__ import annotations

import pytest
import torch

from app.models.sampling import CANDIDATES, naive_token_probs, nucleus, sample_rows, sample_token

LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.4, 1.0, -2.0, 0.0, float("-inf")])


def _kept(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """nucleus() of one row: the kept probabilities and ids."""
    values, ids = nucleus(probs[None], torch.tensor([top_p]))
    keep = values[0] > 0
    return values[0][keep], ids[0][keep]


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
    """V = 151936 (Qwen3-Next). Nucleus sizes here: 12 (scale 8, first try), 1073 (scale 4, second try),
    33433 to 151757 (the full sort)."""
    logits = torch.randn(151936, generator=torch.Generator().manual_seed(1)) * scale
    probs = torch.softmax(logits, -1)
    values, ids = _kept(probs, top_p)
    want = naive_token_probs(logits, 1.0, top_p)
    assert set(ids.tolist()) == set(torch.nonzero(want).flatten().tolist())
    assert torch.allclose(values / values.sum(), want[ids], atol=1e-7)
    assert (ids.numel() <= CANDIDATES[0]) == (scale == 8.0)
    assert (ids.numel() > CANDIDATES[-1]) == (scale < 4.0 or top_p > 0.99)


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
    """Rows whose sets need 12, ~1000, ~33000 and ~135000 candidates, in one call: each equals its full sort."""
    base = torch.randn(151936, generator=torch.Generator().manual_seed(1))
    logits = torch.stack([base * 8.0, base * 4.0, base.roll(5) * 4.0, base * 0.05])
    top_p = torch.tensor([0.9, 0.9, 0.999, 0.9])
    values, ids = nucleus(torch.softmax(logits, -1), top_p)
    for row in range(4):
        keep = values[row] > 0
        want = naive_token_probs(logits[row], 1.0, float(top_p[row]))
        assert set(ids[row][keep].tolist()) == set(torch.nonzero(want).flatten().tolist())
        assert (values[row][~keep] == 0).all()

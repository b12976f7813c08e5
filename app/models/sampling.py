"""Next-token sampling: temperature, top-k, top-p (nucleus), with an optional per-request generator.

A step samples every request with temperature > 0 on the host, one logits row of V entries each, and the
target models have V = 152k (Qwen3-Next) or 164k (Kimi-Linear). The obvious form, a full sort for top-p and
`torch.multinomial`, takes milliseconds per row at that size (docs/benchmarks.md, "Sampling"), so a step of
many sampled requests would wait on it. Here no part touches all V entries more than a few times: top-p sorts
only the top candidates (`topk` of 256, then 4096, until they hold top_p of the mass, which the first try
usually does; a full sort after that), and the draw is one uniform number through the cumulative distribution (inverse transform).
`naive_token_probs` is the full-sort reference the tests and loadtest/bench_sampling.py compare with.
"""

from __future__ import annotations

import torch

CANDIDATES = (256, 4096)  # topk sizes tried before a full sort


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None, top_k: int = 0
) -> int:
    """logits: [V]. temperature 0 is greedy (argmax, lowest id on ties); top_k 0 and top_p 1 are off."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p >= 1.0:
        return _draw(probs, generator)
    values, ids = nucleus(probs, top_p)
    return int(ids[_draw(values, generator)])


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of most likely tokens whose mass reaches top_p (the token that crosses it included):
    (their probabilities, descending; their ids). Tries the top 256, then 4096 candidates, then sorts all:
    a peaked distribution stops at the first, a flat one (a large nucleus) costs about one full sort."""
    for k in [k for k in CANDIDATES if k < probs.numel()] + [probs.numel()]:
        values, ids = probs.topk(k) if k < probs.numel() else probs.sort(descending=True)
        before = values.cumsum(0) - values  # mass of the tokens ranked above each one
        if before[-1] >= top_p or k == probs.numel():
            keep = int((before < top_p).sum())
            return values[:keep], ids[:keep]
    raise AssertionError("unreachable: the last try covers the vocabulary")


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index drawn with weights `probs` (need not sum to 1): one uniform through the cumulative sum; an
    index of zero weight is never drawn."""
    cdf = probs.cumsum(0)
    u = torch.rand((), generator=generator, dtype=cdf.dtype) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    return i if i < cdf.numel() else int(probs.nonzero()[-1])  # u rounded up to the total


def naive_token_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Reference: the distribution `sample_token` draws from, [V], by a full sort."""
    logits = logits.float() / temperature
    if top_k:
        kth = torch.sort(logits, descending=True).values[min(top_k, logits.numel()) - 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return probs / probs.sum()

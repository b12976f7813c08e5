"""Next-token sampling: temperature, top-k, top-p (nucleus), with an optional per-request generator.

A step samples every request with temperature > 0 on the host, one logits row of V entries each, and the
target models have V = 152k (Qwen3-Next) or 164k (Kimi-Linear). The obvious form, a full sort for top-p and
`torch.multinomial`, takes milliseconds per row at that size (docs/benchmarks.md, "Sampling"), so a step of
many sampled requests would wait on it. Here no part touches all V entries more than a few times: top-p sorts
only the top candidates (`topk` of 256, 1024, 4096, each row until they hold top_p of its mass, which the
first try usually does; a full sort after that), and the draw is one uniform number through the cumulative distribution
(inverse transform). A step's sampled rows go through each op together (`sample_rows`).
`naive_token_probs` is the full-sort reference the tests and loadtest/bench_sampling.py compare with.
"""

from __future__ import annotations

import torch

CANDIDATES = (256, 1024, 4096)  # topk sizes a row tries before a full sort


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None, top_k: int = 0
) -> int:
    """logits: [V]. temperature 0 is greedy (argmax, lowest id on ties); top_k 0 and top_p 1 are off."""
    if temperature <= 0:
        return int(logits.argmax())
    return sample_rows(logits[None], [temperature], [top_p], [top_k], [generator])[0]


def sample_rows(logits: torch.Tensor, temperature: list[float], top_p: list[float], top_k: list[int],
                generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits [n, V], row i with its own settings (temperature > 0) and generator (None:
    torch's default). All rows go through each op together; each row draws one uniform from its generator, so
    a seeded row gives the same tokens whatever it is batched with."""
    if len(set(temperature)) == 1:  # the usual case; a scalar divide is the faster kernel
        x = logits.float() / temperature[0]
    else:
        x = logits.float() / torch.tensor(temperature, dtype=torch.float32, device=logits.device)[:, None]
    if any(0 < k < x.shape[-1] for k in top_k):
        x = _top_k(x, top_k)
    probs = torch.softmax(x, dim=-1)
    u = torch.stack([torch.rand((), generator=g, device="cpu") for g in generators]).to(probs.device)
    out = [0] * len(generators)
    plain = [i for i, p in enumerate(top_p) if p >= 1.0]
    if plain:
        for i, t in zip(plain, _draw(_rows(probs, plain), _rows(u, plain)).tolist()):
            out[i] = t
    rest = [i for i, p in enumerate(top_p) if p < 1.0]
    if rest:
        values, ids = nucleus(_rows(probs, rest), torch.tensor([top_p[i] for i in rest], device=probs.device))
        for i, t in zip(rest, ids.gather(1, _draw(values, _rows(u, rest))[:, None])[:, 0].tolist()):
            out[i] = t
    return out


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows], without a copy when that is all of t (the usual case: one setting for the whole step)."""
    return t if len(rows) == t.shape[0] else t[rows]


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of probs [n, V], the smallest set of most likely tokens whose mass reaches top_p[row] (the
    token that crosses it included): (probabilities [n, w], descending, zero past each row's set; their ids).
    Each row tries the top 256, 1024, 4096 candidates, then sorts all, and stops at the first try that holds
    its set: a peaked distribution costs one small topk, a flat one (a large nucleus) about one full sort."""
    n, vocab = probs.shape
    found: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # (rows, values, ids) per try
    todo = list(range(n))
    for k in [k for k in CANDIDATES if k < vocab] + [vocab]:
        sub, p = _rows(probs, todo), _rows(top_p, todo)
        values, ids = sub.topk(k, dim=-1) if k < vocab else sub.sort(dim=-1, descending=True)
        before = values.cumsum(-1) - values  # mass of the tokens ranked above each one
        done = (before[:, -1] >= p) if k < vocab else torch.ones(len(todo), dtype=torch.bool, device=p.device)
        rows = [r for r, d in zip(todo, done.tolist()) if d]
        if rows:
            sel = done.nonzero()[:, 0] if len(rows) < len(todo) else slice(None)
            found.append((rows, (values * (before < p[:, None]))[sel], ids[sel]))
        todo = [r for r, d in zip(todo, done.tolist()) if not d]
        if not todo:
            break
    if len(found) == 1 and found[0][0] == list(range(n)):
        return found[0][1], found[0][2]
    width = max(v.shape[-1] for _, v, _ in found)
    out_v = probs.new_zeros(n, width)
    out_i = torch.zeros(n, width, dtype=torch.long, device=probs.device)
    for rows, v, i in found:
        index = torch.tensor(rows, device=probs.device)
        out_v[index, : v.shape[-1]] = v
        out_i[index, : i.shape[-1]] = i
    return out_v, out_i


def _top_k(x: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """x [n, V] with every logit below row i's top_k[i]-th largest set to -inf (0 or >= V: row unchanged)."""
    vocab = x.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    largest = x.topk(max(ks), dim=-1).values  # [n, max k], descending
    kth = largest.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=x.device)[:, None])
    kth = kth.masked_fill(torch.tensor([k == 0 for k in ks], device=x.device)[:, None], float("-inf"))
    return x.masked_fill(x < kth, float("-inf"))


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of weights [n, K] (need not sum to 1), the index its uniform u[row] selects through the
    cumulative sum; an index of zero weight is never selected."""
    cdf = weights.cumsum(-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    over = picked >= weights.shape[-1]  # u * total rounded up to the total: take the last nonzero weight
    if bool(over.any()):
        last = weights.shape[-1] - 1 - (weights.flip(-1) > 0).int().argmax(-1)
        picked = torch.where(over, last, picked)
    return picked


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

"""Next-token sampling: temperature, top-k, top-p (nucleus), with an optional per-request generator.

A step samples every request with temperature > 0 on the host, one logits row of V entries each, and the
target models have V = 152k (Qwen3-Next) or 164k (Kimi-Linear). The obvious form, a full sort for top-p and
`torch.multinomial`, takes milliseconds per row at that size (docs/benchmarks.md, "Sampling"), so a step of
many sampled requests would wait on it. Here no part sorts more than a few hundred entries of a row: top-p
first takes the row's top 64-256 candidates (`topk`), which hold top_p of the mass of a peaked distribution, and a
flatter row (a nucleus of thousands) finds its set by a radix select on the mass, a few passes over V entries
(`_radix_nucleus`). The draw is one uniform number through the cumulative distribution
(inverse transform). A step's sampled rows go through each op together (`sample_rows`).
`naive_token_probs` is the full-sort reference the tests and loadtest/bench_sampling.py compare with.
"""

from __future__ import annotations

import math

import torch

CANDIDATES = (64, 256)  # the first topk's width: vocabulary / 64, within these bounds
RADIX, SPAN, LEVELS, SORTED = 64, 32.0, 4, 512  # radix select: buckets, first span (nats), levels, sort at most


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None, top_k: int = 0
) -> int:
    """logits: [V]. temperature 0 is greedy (argmax, lowest id on ties); top_k 0 and top_p 1 are off."""
    if temperature <= 0:
        return int(logits.argmax())
    return sample_rows(logits[None], [temperature], [top_p], [top_k], [generator])[0]


def sample_rows(logits: torch.Tensor, temperature: list[float], top_p: list[float], top_k: list[int],
                generators: list[torch.Generator | None], min_p: list[float] | None = None) -> list[int]:
    """One token per row of logits [n, V], row i with its own settings (temperature > 0) and generator (None:
    torch's default). All rows go through each op together; each row draws one uniform from its generator, so
    a seeded row gives the same tokens whatever it is batched with. min_p (vLLM's): after temperature, tokens
    less likely than min_p times the row's most likely one are dropped, before top-k and top-p."""
    if len(set(temperature)) == 1:  # the usual case; a scalar divide is the faster kernel
        x = logits.float() / temperature[0]
    else:
        x = logits.float() / torch.tensor(temperature, dtype=torch.float32, device=logits.device)[:, None]
    if min_p is not None and any(m > 0 for m in min_p):
        floor = torch.tensor([math.log(m) if m > 0 else float("-inf") for m in min_p], device=x.device)
        x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + floor[:, None], float("-inf"))
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
        weights, ids = nucleus(_rows(probs, rest), torch.tensor([top_p[i] for i in rest], device=probs.device),
                               _rows(x, rest))
        picked = _draw(weights, _rows(u, rest))
        for i, t in zip(rest, (picked if ids is None else ids.gather(1, picked[:, None])[:, 0]).tolist()):
            out[i] = t
    return out


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows], without a copy when that is all of t (the usual case: one setting for the whole step)."""
    return t if len(rows) == t.shape[0] else t[rows]


def nucleus(probs: torch.Tensor, top_p: torch.Tensor,
            logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row of probs [n, V], the smallest set of most likely tokens whose mass reaches top_p[row] (the
    token that crosses it included): (weights [n, w], zero outside each row's set; their ids [n, w], or None
    when w = V and the ids are the vocabulary in order). Every row first tries its top V / 64 candidates (64
    to 256: a topk's cost grows with its width, and a larger vocabulary makes the radix select dearer), which
    hold the set of a peaked distribution; if any row's set is larger, every row comes back as weights over
    the whole vocabulary, the larger sets found by `_radix_nucleus`. logits: the rows' logits (or log
    probabilities: any shift per row), which spares it taking the log of probs."""
    n, vocab = probs.shape
    width = min(max(vocab // 64, CANDIDATES[0]), CANDIDATES[1], vocab)
    values, ids = probs.topk(width, dim=-1)
    before = values.cumsum(-1) - values  # mass of the tokens ranked above each one
    taken = before < top_p[:, None]
    done = before[:, -1] >= top_p
    if width == vocab or bool(done.all()):
        return values * taken, ids
    rest = [r for r, d in enumerate(done.tolist()) if not d]
    sub = _rows(probs, rest)
    found = _radix_nucleus(sub, sub.log() if logits is None else _rows(logits, rest), _rows(top_p, rest))
    if len(rest) == n:
        return probs * found, None
    keep = torch.zeros(probs.shape, dtype=torch.bool, device=probs.device).scatter_(1, ids, taken & done[:, None])
    keep[rest] = found
    return probs * keep, None


def _radix_nucleus(probs: torch.Tensor, logp: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool [n, V]: each row's nucleus, found without sorting the row (a radix select on the mass). logp: the
    rows' log probabilities, or any per-row shift of them (the logits).

    A level splits a row's undecided tokens into RADIX buckets of equal width in log probability (the first
    level spans SPAN nats below the row's most likely token; rarer tokens join its last bucket) and sums each
    bucket's mass (one scatter_add). The bucket in which the running mass from the top crosses what is still
    needed stays undecided: the buckets above it are in, those below out. Its tokens are gathered into a
    narrow tensor, which the next level splits. Once at most SORTED tokens of a row are undecided (or after
    LEVELS levels: ties cannot be split) they are sorted, as the reference does, and cut where the mass
    crosses. Only the first level passes over all V entries, so a flat distribution (a nucleus of thousands)
    costs a few passes over the row. Masses are summed in float64, as the reference does, so the set is the
    full sort's but where a token's mass ranked above lies within float64 rounding of top_p."""
    n, vocab = probs.shape
    keep = None  # the tokens decided in, [n, V + 1]: padding's id is V
    need = top_p.double()  # mass still to take from the undecided tokens (float64, as the reference sums)
    hi = logp.amax(-1, keepdim=True)
    scale = torch.full_like(hi, RADIX / SPAN)
    p, ids = probs, None  # the undecided tokens (zero-padded) and their ids; None: all of the row
    for _ in range(LEVELS):
        if p.shape[-1] <= SORTED:
            break
        # bucket 0 holds the most likely tokens; clamping keeps the order where rounding strays past an edge
        bucket = torch.sub(hi, logp).mul_(scale).clamp_(0, RADIX - 1).long()
        mass = need.new_zeros(n, RADIX).scatter_add_(1, bucket, p.double()).cumsum(-1)
        cross = torch.searchsorted(mass, need[:, None]).clamp_(max=RADIX - 1)  # [n, 1]
        need = need - torch.where(cross > 0, mass.gather(1, (cross - 1).clamp(min=0)), 0.0)[:, 0]
        above = bucket < cross  # not the tokens of zero probability or padding: they are in the last bucket
        if ids is None:
            keep = torch.cat([above, above.new_zeros(n, 1)], 1)
        else:
            keep.scatter_(1, ids, above)  # still undecided, so not in keep before
        p, ids, logp = _gather(bucket == cross, p, ids, logp, vocab)
        hi, scale = hi - cross / scale, scale * RADIX
    values, order = p.sort(dim=-1, descending=True)
    values = values.double()
    taken = ((values.cumsum(-1) - values) < need[:, None]) & (values > 0)
    if ids is None:
        return torch.zeros_like(taken).scatter_(1, order, taken)
    return keep.scatter_(1, ids.gather(1, order), taken)[:, :vocab]


def _gather(mask: torch.Tensor, p: torch.Tensor, ids: torch.Tensor | None, logp: torch.Tensor, pad_id: int):
    """The entries of p, ids (None: the column) and logp where mask is set, each row's to the left of a
    [n, max count] tensor, padded with probability 0, id pad_id and log probability -inf."""
    n = mask.shape[0]
    rows, cols = mask.nonzero(as_tuple=True)  # row by row
    counts = torch.bincount(rows, minlength=n)
    slot = torch.arange(rows.numel(), device=mask.device) - (counts.cumsum(0) - counts)[rows]
    width = int(counts.max())
    out_p = p.new_zeros(n, width).index_put_((rows, slot), p[rows, cols])
    out_ids = torch.full((n, width), pad_id, dtype=torch.long, device=mask.device)
    out_ids.index_put_((rows, slot), cols if ids is None else ids[rows, cols])
    out_logp = logp.new_full((n, width), float("-inf")).index_put_((rows, slot), logp[rows, cols])
    return out_p, out_ids, out_logp


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
        mass = sorted_p.double()  # float64: a float32 cumsum's rounding differs between CPUs (vector widths)
        keep = mass.cumsum(0) - mass < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return probs / probs.sum()

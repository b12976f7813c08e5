"""Comparisons of evaluation outputs: per-sample log-likelihoods of two lm-eval runs (reference agreement),
greedy generations of a setting against the dense run (answer fidelity), and the divergence of two runs'
next-token distributions from their top logprobs (logprob fidelity). Pure functions over plain data, so the
tests check them without lm-eval."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def responses(samples: Sequence[Mapping]) -> dict[int, list]:
    """lm-eval's logged samples of one task -> {doc_id: filtered responses}: a list of (log-likelihood, is_greedy)
    per choice for loglikelihood and multiple-choice tasks, a list of one string for generate_until."""
    return {int(s["doc_id"]): [list(r) if isinstance(r, (list, tuple)) else r for r in s["filtered_resps"]]
            for s in samples}


def loglik_agreement(reference: Mapping[int, list], other: Mapping[int, list]) -> dict:
    """Per-sample agreement of two runs of one loglikelihood or multiple-choice task: the largest absolute
    difference of a log-likelihood, how many were compared, how many is_greedy flags differ, and the share of
    documents where both pick the same choice (the argmax of the log-likelihoods)."""
    if reference.keys() != other.keys():
        raise ValueError(f"the runs answered different documents: {sorted(reference.keys() ^ other.keys())[:5]}")
    worst, count, greedy_diff, same_pick = 0.0, 0, 0, 0
    for doc, ref in reference.items():
        got = other[doc]
        if len(ref) != len(got):
            raise ValueError(f"document {doc}: {len(ref)} against {len(got)} responses")
        for (a, ga), (b, gb) in zip(ref, got):
            worst = max(worst, abs(a - b))
            greedy_diff += bool(ga) != bool(gb)
            count += 1
        same_pick += _argmax([r[0] for r in ref]) == _argmax([r[0] for r in got])
    return {"compared": count, "max_abs_diff": worst, "greedy_flags_differ": greedy_diff,
            "same_pick": same_pick / len(reference) if reference else 1.0}


def generation_agreement(dense: Mapping[int, list], other: Mapping[int, list]) -> float:
    """Share of documents whose greedy generation equals the dense run's, character for character."""
    if dense.keys() != other.keys():
        raise ValueError("the runs answered different documents")
    return sum(dense[d] == other[d] for d in dense) / len(dense) if dense else 1.0


def top_kl(p: Mapping, q: Mapping) -> float:
    """KL(P || Q) in nats, estimated from two top-k logprob maps {token: log-probability} of the same position:
    over P's top tokens plus one bucket for the rest of P's mass. A token missing from Q's top-k gets Q's smallest
    listed probability (an upper bound on it), and Q's rest bucket is what its listed tokens leave. Exactly 0 for
    equal maps."""
    q_floor = min(q.values())
    kl = 0.0
    for token, lp in p.items():
        kl += math.exp(lp) * (lp - q.get(token, q_floor))
    p_rest = max(0.0, 1.0 - sum(math.exp(v) for v in p.values()))
    q_rest = max(1e-12, 1.0 - sum(math.exp(q.get(t, q_floor)) for t in p))
    if p_rest > 1e-12:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)


def compare_steps(dense: Sequence[tuple[str, Mapping]], other: Sequence[tuple[str, Mapping]]
                  ) -> tuple[list[float], list[bool]]:
    """Two greedy generations of one prompt as (token, top logprobs) per step -> (KL per step, top-1 agreement
    per step) over the steps both saw the same context: up to and including the first token they differ on."""
    kls, agree = [], []
    for (ta, pa), (tb, pb) in zip(dense, other):
        kls.append(top_kl(pa, pb))
        agree.append(_argmax_map(pa) == _argmax_map(pb))
        if ta != tb:
            break
    return kls, agree


def _argmax(xs: Sequence[float]) -> int:
    return max(range(len(xs)), key=lambda i: xs[i])


def _argmax_map(m: Mapping) -> object:
    return max(sorted(m), key=m.__getitem__)

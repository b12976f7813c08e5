"""What a step does with the logits it gets back, beside the engine: logits processing of the rows that ask
(app/engine/logits.py), the greedy and sampled picks, and the logprobs of output and prompt tokens. Dicts are
keyed by id(seq), as `Engine.run_works` returns them."""

from __future__ import annotations

import torch

from app.engine.grammar import JsonGrammars
from app.engine.logits import needs_processing, process
from app.engine.request import Sequence
from app.engine.sampling import sample_rows
from app.engine.scheduler import Work
from app.engine.worker import split_logits


def processed(works: list[Work], logits: dict[int, torch.Tensor], end_ids,
              grammars: JsonGrammars | None = None) -> dict[int, torch.Tensor]:
    """`logits` with the rows of requests that ask for penalties, logit_bias, min_tokens or a JSON grammar
    processed; the others as they are."""
    seqs = [w.seq for w in works if id(w.seq) in logits and needs_processing(w.seq.params)]
    if not seqs:
        return logits
    rows = process(torch.stack([logits[id(s)] for s in seqs]), seqs, end_ids, grammars)
    return {**logits, **{id(s): rows[i] for i, s in enumerate(seqs)}}


def greedy_tokens(works: list[Work], logits: dict[int, torch.Tensor]) -> dict[int, int]:
    """Greedy picks of rows that came back as logits (`keep_logits`), as the worker makes them, keyed by id(seq)."""
    keys = [id(w.seq) for w in works if id(w.seq) in logits and w.seq.params.temperature <= 0]
    if not keys:
        return {}
    return dict(zip(keys, split_logits(torch.stack([logits[k] for k in keys]), greedy=(True,) * len(keys))[0]))


def sample(seqs: list[Sequence], logits: dict[int, torch.Tensor]) -> dict[int, int]:
    """The step's sampled picks (temperature > 0) in one `sample_rows` call, keyed by id(seq)."""
    if not seqs:
        return {}
    params = [s.params for s in seqs]
    tokens = sample_rows(torch.stack([logits[id(s)] for s in seqs]), [p.temperature for p in params],
                         [p.top_p for p in params], [p.top_k for p in params], [s.generator for s in seqs],
                         [p.min_p for p in params])
    return dict(zip([id(s) for s in seqs], tokens))


def collect_prompt_logprobs(work: Work, rows: torch.Tensor) -> None:
    """The entries of the prompt tokens this piece's rows predict (row j: token start + j + 1), appended to the
    sequence's; a piece recomputed after a preemption only adds the tokens past those it has."""
    seq, k = work.seq, work.seq.params.prompt_logprobs
    first, last = max(work.start + 1, seq.prompt_lp_upto + 1), min(work.end, seq.prompt_len - 1)
    if first > last:
        return
    lp = torch.log_softmax(rows[first - work.start - 1 : last - work.start], dim=-1)
    targets = torch.tensor(seq.prompt_ids[first : last + 1])
    chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
    top_v, top_i = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    seq.prompt_lps += [(c, list(zip(i, v))) for c, i, v in zip(chosen, top_i.tolist(), top_v.tolist())]


def output_logprobs(seqs: list[Sequence], logits: dict[int, torch.Tensor],
                    picked: dict[int, int]) -> dict[int, tuple[float, list[tuple[int, float]]]]:
    """(log-probability of the picked token, top `logprobs` (id, log-probability) pairs) per sequence, keyed by
    id(seq): log_softmax of the raw logits in float32, whatever sampling did to pick."""
    if not seqs:
        return {}
    entries = row_logprobs(torch.stack([logits[id(s)] for s in seqs]), [picked[id(s)] for s in seqs],
                           max(s.params.logprobs for s in seqs))
    return {id(s): (c, top[: s.params.logprobs]) for s, (c, top) in zip(seqs, entries)}


def row_logprobs(rows: torch.Tensor, tokens: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row of raw logits [n, V]: (log-probability of its token, its top k (id, log-probability) pairs)."""
    lp = torch.log_softmax(rows.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor([[t] for t in tokens], device=lp.device))[:, 0].tolist()
    top_v, top_i = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, top_i.tolist(), top_v.tolist())]

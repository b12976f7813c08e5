"""What a request asks to be done to its next-token logits before the pick, as vLLM defines it, in this order on
the raw logits (float32):

1. repetition_penalty r (on every token of prompt and output): a positive logit is divided by r, a negative
   one multiplied by r;
2. frequency_penalty f and presence_penalty p (on the generated tokens only): logit -= f * count + p * (count > 0);
3. logit_bias: added per id;
4. min_tokens: while fewer tokens than that were generated, the stop ids (the request's `stop_token_ids`, and
   the tokenizer's end ids unless `ignore_eos`) are set to -inf;
5. guided_json or guided_tools: every token the grammar does not allow next is set to -inf (app/engine/grammar.py,
   app/engine/tool_grammar.py), last, so that no bias brings one back.

Then sampling applies temperature, min_p, top-k and top-p (app/engine/sampling.py); greedy takes the argmax of
the processed row. Logprobs stay the raw model's (`SamplingParams.logprobs`). Only rows whose request asks for
any of these are touched (`needs_processing`), so plain requests pay nothing.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from app.engine.grammar import JsonGrammars
from app.engine.request import SamplingParams, Sequence


def needs_processing(p: SamplingParams) -> bool:
    return bool(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty or p.logit_bias
                or p.min_tokens or p.constrained)


def process(rows: torch.Tensor, seqs: Seq[Sequence], end_ids: Seq[int],
            grammars: JsonGrammars | None = None) -> torch.Tensor:
    """rows [n, V]: the raw logits of `seqs` (each `needs_processing`); -> the processed rows, float32.
    `grammars`: the engine's, needed when a sequence is `constrained` (its state is made here on first use)."""
    x = rows.float().clone()
    vocab = x.shape[-1]
    for r, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=x.device)
            seen[torch.tensor(seq.prompt_ids + seq.output_ids, device=x.device)] = True
            row = x[r]
            x[r] = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty),
                               row)
        if (p.frequency_penalty or p.presence_penalty) and seq.output_ids:
            counts = torch.bincount(torch.tensor(seq.output_ids, device=x.device), minlength=vocab).float()
            x[r] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            x[r, torch.tensor(ids, device=x.device)] += torch.tensor(bias, device=x.device)
        if len(seq.output_ids) < p.min_tokens:
            stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(end_ids))
            if stops:
                x[r, torch.tensor(stops, device=x.device)] = float("-inf")
        if p.constrained:
            if seq.grammar is None:
                seq.grammar = grammars.state_for(p)
            seq.grammar.mask(x[r], seq.output_ids)
    return x

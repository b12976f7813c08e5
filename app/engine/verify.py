"""Speculative decoding's side of a step: the tokens each verify piece emits, and its state rolled back.

A verify piece feeds a sequence's last token and k drafts (app/engine/speculative.py proposes them). From the
piece's rows, `speculative.accept` keeps the drafts plain decoding would have produced and adds one more token;
each emitted token is appended like any sampled one (its finishing deferred), and then the recurrent states of
every verify piece of the step go back to their last emitted token in one worker call. The engine settles the
pieces afterwards: KV of rejected drafts freed, checkpoints stored, finished sequences ended.
"""

from __future__ import annotations

from dataclasses import replace

from app.engine.outputs import Outputs
from app.engine.picks import row_logprobs
from app.engine.request import RequestOutput
from app.engine.speculative import NgramDrafter, accept


def verify(works: list, picked: dict, raw: dict, outputs: Outputs, worker, telemetry,
           grammars) -> dict[int, list[RequestOutput]]:
    """Per verify piece (keyed by id(seq)): the outputs of the tokens it emits, in order, the last one saying
    whether the sequence ended. `picked`/`raw`: the piece's argmax rows (a list) or its raw logits rows."""
    done, keep = {}, {}
    for w in works:
        seq = w.seq
        rows = picked.get(id(seq), raw.get(id(seq)))
        tokens = accept(seq, w.draft, rows, outputs.end_ids, grammars)
        telemetry.on_verify(len(w.draft), len(tokens) - 1)
        NgramDrafter.record(seq, len(w.draft), len(tokens) - 1)
        lps = None
        if seq.params.logprobs is not None:
            lps = row_logprobs(raw[id(seq)][: len(tokens)], tokens, seq.params.logprobs)
        outs = []
        for j, tok in enumerate(tokens):
            out, reason = outputs.append(seq, tok, None if lps is None else lps[j])
            outs.append(out)
            if reason is not None:
                break
        done[id(seq)] = outs
        keep[seq.state_slot] = len(outs)  # the emitted tokens but the last are computed: x0 + accepted drafts
    worker.rollback(keep)
    return done


def merged(outs: list[RequestOutput]) -> RequestOutput:
    """A verify piece's outputs as one: its tokens, text and logprobs together."""
    first, last = outs[0], outs[-1]
    lps = [lp for o in outs for lp in (o.new_logprobs or ())]
    return replace(last, new_token_ids=[t for o in outs for t in o.new_token_ids],
                   new_text="".join(o.new_text for o in outs), new_logprobs=lps or None,
                   prompt_logprobs=first.prompt_logprobs, ttft_s=first.ttft_s)

"""From sampled tokens to what a request sees: each sequence's text, stop conditions and `RequestOutput`s.

Text grows incrementally (each token's bytes through the sequence's UTF-8 decoder), so a token costs the same
however long the output already is. Stop strings are searched only where a new match can start, and the text
that may still become a stop string is held back from the deltas. A sequence with no stop strings decodes the
same way; its deltas are simply never held back.
"""

from __future__ import annotations

import time

from app.engine.request import RequestOutput, Sequence
from app.models.tokenizer import Tokenizer


class Outputs:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.end_ids = tuple(tokenizer.stop_token_ids)

    def append(self, seq: Sequence, token: int, logprobs=None) -> tuple[RequestOutput, str | None]:
        """Record a sampled token: (its output, why the sequence ends here or None). The caller finishes the
        sequence (a verify piece does so after its rollback)."""
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
            seq.decoder = self.tokenizer.incremental_decoder()
        seq.output_ids.append(token)
        p = seq.params
        reason = None
        early = len(seq.output_ids) <= p.min_tokens  # min_tokens: no stop yet (the ids were masked too)
        before = len(seq.decoded)
        if not early and (token in p.stop_token_ids or (not p.ignore_eos and token in self.end_ids)):
            reason = "stop"
        else:
            seq.decoded += seq.decoder.push(token)
        if reason is None and len(seq.output_ids) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            seq.decoded += seq.decoder.flush()
        text = seq.decoded
        if p.stop:
            hits = [] if early else [i for s in p.stop if (i := text.find(s, max(0, before - len(s) + 1))) >= 0]
            if hits:
                seq.decoded = text = text[: min(hits)]
                reason = "stop"
            elif reason is None:  # hold back what may still become a stop string
                hold = max(len(s) for s in p.stop) - 1
                text = text[: len(text) - hold] if hold else text
        delta = text[len(seq.text):] if len(text) > len(seq.text) else ""
        seq.text += delta
        prompt_lps = None
        if len(seq.output_ids) == 1 and seq.index == 0 and p.prompt_logprobs is not None:
            prompt_lps = [None, *seq.prompt_lps]
        out = RequestOutput(seq.request_id, seq.index, [token], delta, seq.text, reason is not None, reason,
                            seq.prompt_len, seq.cached_len, list(seq.output_ids) if reason else [],
                            seq.first_token_time - seq.arrival, new_logprobs=None if logprobs is None else [logprobs],
                            prompt_logprobs=prompt_lps, compressed_hit=seq.compressed_hit)
        return out, reason

"""OpenAI's logprobs objects from the engine's per-token `RequestOutput.new_logprobs` (the raw model's
log-probabilities: log_softmax of the logits, before temperature, top-k or top-p).

Completions (the legacy format, as vLLM writes it): `tokens` and the keys of `top_logprobs` are vocabulary
entries (byte-level forms such as "Ġreturn": one string per id, so two ids never share a key); each position's
`top_logprobs` holds the sampled token too, so it has up to `logprobs + 1` entries; `text_offset` is each token's
character offset in the choice's text. With `echo`, the prompt's tokens come first, the first one with
nulls. Chat: `content` entries with the token's text,
its UTF-8 bytes and its `top_logprobs` alternatives. JSON has no -Infinity: a log-probability below
`FLOOR` is reported as FLOOR (as vLLM does).
"""

from __future__ import annotations

from collections.abc import Sequence

from app.models.tokenizer import Tokenizer

FLOOR = -9999.0
Entry = tuple[float, Sequence[tuple[int, float]]]  # (the token's log-probability, [(id, log-probability)])


def _lp(v: float) -> float:
    return v if v > FLOOR else FLOOR


class CompletionLogprobs:
    """Accumulates one choice's `logprobs` object; `offset` is where its generated text starts."""

    def __init__(self, tok: Tokenizer, offset: int = 0) -> None:
        self.tok, self.offset = tok, offset

    def chunk(self, token_ids: Sequence[int], entries: Sequence[Entry | None]) -> dict:
        """The object for these tokens; an entry None (the prompt's first token) gives nulls, as OpenAI's."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(token_ids, entries, strict=True):
            name = self.tok.token_string(token)
            out["tokens"].append(name)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                lp, top = entry
                out["token_logprobs"].append(_lp(lp))
                out["top_logprobs"].append({**{self.tok.token_string(i): _lp(v) for i, v in top}, name: _lp(lp)})
            out["text_offset"].append(self.offset)
            self.offset += len(self.tok.token_bytes(token).decode("utf-8", "replace"))
        return out


def chat_logprobs(tok: Tokenizer, token_ids: Sequence[int], entries: Sequence[Entry]) -> dict:
    def item(token: int, lp: float) -> dict:
        raw = tok.token_bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": _lp(lp), "bytes": list(raw)}

    return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]}
                        for t, (lp, top) in zip(token_ids, entries, strict=True)]}

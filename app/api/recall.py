"""`Recall`: a bounded, salted memory of recent chat answers, so that a conversation re-sent with the answer in its
history resumes from the ids that were generated, not from a re-encoding of their text.

Why: the next turn's prompt holds the previous prompt and the previous answer. Rendered and encoded afresh, the
answer's text need not give back the ids the model sampled (a tokenizer has many spellings of one text; the
grammar of a forced call writes its literals and the model its arguments token by token), and the prefix cache
matches ids: one differing token early in the answer means recomputing everything after it. With the memory,
turn N+1's prompt starts with exactly turn N's prompt ids and output ids, so turn N's generation-end checkpoint
serves it.

How: each answer is kept under a keyed hash of its prompt's text (BLAKE2b with a per-process random key, and the
request's `cache_salt`: a tenant recalls only its own answers). A new chat prompt is rendered; for its last
assistant messages (the latest first), the text of the conversation before that message, as its generation
prompt, is looked up; a kept answer whose prompt ids and output ids decode to a prefix of the new prompt's text
gives those ids, and the rest of the new prompt is encoded after them from the template's pieces (special tokens
of the template stay control ids). Output ids past the re-sent text (a stop string's tokens) are dropped, up to
`MAX_TRIM` of them. Anything that does not line up falls back to the plain encoding: the memory can only make a
prompt's ids equal their text's, never change the text.

Counters (`stats`): re-sent turns spliced from memory, and of them those whose plain encoding differs from the
generated ids (`drifted`: the turns the memory saved from a miss) with the tokens it would have recomputed.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from app.models.tokenizer import Tokenizer

MAX_TRIM = 16  # output ids dropped at most from an answer's end to line it up with the re-sent text
MAX_LOOKUPS = 4  # assistant messages looked up per prompt, the latest first
MAX_PER_PROMPT = 16  # answers kept per prompt (n > 1, retries)


class Recall:
    def __init__(self, max_tokens: int = 1 << 22) -> None:
        self.max_tokens = max_tokens
        self._key = secrets.token_bytes(32)
        self._entries: OrderedDict[bytes, list[tuple[array, array]]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.stats = {"spliced": 0, "drifted": 0, "drift_tokens": 0}

    def metrics_text(self) -> str:
        """The counters in Prometheus' text format (this API process's)."""
        helps = {"spliced": "re-sent chat answers whose prompt resumed from the ids generated",
                 "drifted": "of them, those whose text re-encoded to other ids (a cache miss without the memory)",
                 "drift_tokens": "tokens those would have recomputed"}
        return "".join(f"# HELP dasc:recall_{k}_total {v}\n# TYPE dasc:recall_{k}_total counter\n"
                       f"dasc:recall_{k}_total {self.stats[k]}\n" for k, v in helps.items())

    def _hash(self, salt: str | None, text: str) -> bytes:
        h = hashlib.blake2b(key=self._key, digest_size=16)
        h.update((salt or "").encode("utf-8", "surrogatepass") + b"\0")
        h.update(text.encode("utf-8", "surrogatepass"))
        return h.digest()

    def remember(self, salt: str | None, prompt_text: str, prompt_ids: Sequence[int],
                 output_ids: Sequence[int]) -> None:
        """Keep one answer: the prompt it continued (its text and ids) and the ids generated."""
        if not self.max_tokens or not output_ids:
            return
        entry = (array("i", prompt_ids), array("i", output_ids))
        size = len(entry[0]) + len(entry[1])
        if size > self.max_tokens:
            return
        key = self._hash(salt, prompt_text)
        with self._lock:
            kept = self._entries.pop(key, [])
            kept.append(entry)
            self._tokens += size
            while len(kept) > MAX_PER_PROMPT:
                old = kept.pop(0)
                self._tokens -= len(old[0]) + len(old[1])
            self._entries[key] = kept
            while self._tokens > self.max_tokens:
                _, gone = self._entries.popitem(last=False)
                self._tokens -= sum(len(p) + len(o) for p, o in gone)

    def _recall(self, salt: str | None, prompt_text: str) -> list[tuple[array, array]]:
        key = self._hash(salt, prompt_text)
        with self._lock:
            if key not in self._entries:
                return []
            self._entries.move_to_end(key)
            return list(self._entries[key])

    def prompt_ids(self, tok: Tokenizer, messages: Sequence[Mapping], tools, pieces: list[str | int],
                   salt: str | None, template_kwargs: Mapping | None = None) -> list[int] | None:
        """The ids of the chat whose rendered pieces are `pieces` (rendered with `template_kwargs`), starting with
        a remembered prompt and answer, or None if no remembered answer lines up (module docstring)."""
        if not self.max_tokens:
            return None
        text = "".join(tok.piece_text(p) for p in pieces)
        turns = [k for k, m in enumerate(messages) if m.get("role") == "assistant"][-MAX_LOOKUPS:]
        for k in reversed(turns):
            before = tok.apply_chat_template(messages[:k], True, tools, **(template_kwargs or {}))
            if not text.startswith(before):
                continue
            best = None
            for prompt, output in self._recall(salt, before):
                if tok.decode(prompt) != before:
                    continue
                for j in range(len(output), max(0, len(output) - MAX_TRIM), -1):
                    said = tok.decode(output[:j])
                    end = len(before) + len(said)
                    if text.startswith(said, len(before)) and _cut(tok, pieces, end) is not None:
                        if best is None or j > len(best[1]):
                            best = (prompt, output[:j], end)
                        break
            if best is not None:
                ids = list(best[0]) + list(best[1]) + tok.encode_pieces(_cut(tok, pieces, best[2]))
                self._count(tok.encode_pieces(pieces), ids, len(best[0]) + len(best[1]))
                return ids
        return None

    def _count(self, plain: list[int], spliced: list[int], recalled: int) -> None:
        same = next((i for i, (a, b) in enumerate(zip(plain, spliced)) if a != b), min(len(plain), len(spliced)))
        with self._lock:
            self.stats["spliced"] += 1
            if same < recalled:
                self.stats["drifted"] += 1
                self.stats["drift_tokens"] += recalled - same


def continue_ids(tok: Tokenizer, pieces: list[str | int], ids: list[int]) -> list[int] | None:
    """`ids`, then the rest of the rendered chat `pieces` after the text `ids` decode to, encoded; None if that
    text does not start the pieces' text (where it ends inside a special token, too)."""
    base = tok.decode(ids)
    if not "".join(tok.piece_text(p) for p in pieces).startswith(base):
        return None
    rest = _cut(tok, pieces, len(base))
    return None if rest is None else list(ids) + tok.encode_pieces(rest)


def _cut(tok: Tokenizer, pieces: list[str | int], offset: int) -> list[str | int] | None:
    """The pieces after character `offset` of their text (a text piece cut in two), or None if the offset falls
    inside a special token."""
    at = 0
    for i, piece in enumerate(pieces):
        length = len(tok.piece_text(piece))
        if at + length > offset:
            if isinstance(piece, int):
                return None if offset > at else pieces[i:]
            return [piece[offset - at:], *pieces[i + 1:]]
        at += length
    return [] if at == offset else None

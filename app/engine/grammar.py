"""Structured output: a JSON-schema grammar constrains a sequence's tokens (xgrammar, on the CPU).

xgrammar was picked over llguidance by loadtest/bench_grammar.py (docs/benchmarks.md, "Structured output"): at
the zoo's vocabulary its next-token mask costs a fraction of llguidance's, without llguidance's millisecond
spikes, and with the control bytes masked here every output that ended parsed and validated.

A request's grammar is its schema's text (`SamplingParams.guided_json`; `JSON_OBJECT` for "any object").
`JsonGrammars` (one per tokenizer and logits width, `for_tokenizer`) compiles schemas, cached by text; `compile`
raises ValueError for a schema it cannot take and bounds its size and nesting, which bound the compile time.
`Engine.validate` compiles before a request enters the engine, so a step never compiles a new schema nor fails
on one. The grammar has no free whitespace (compact separators), and every token holding a byte below 0x20 is
masked: JSON allows such a byte only as whitespace, and xgrammar's length-bounded strings would otherwise let
raw control characters in, which `json.loads` refuses.

A sequence's `GrammarState` is made at its first constrained row and follows its `output_ids` (preemption
keeps them, forks of n > 1 have their own); `mask` first catches up with tokens it has not seen and starts
over if the outputs are not the ones it consumed. Invariant: after `sync(ids)`, the matcher has accepted
exactly `ids`. The end tokens are allowed only where the JSON value is complete, and once it is complete only
they are; accepting one terminates the matcher. Forced tool calls' arguments compile here too
(`compile_arguments`: JSON, or Qwen3.5's XML parameters, whose raw-text values may hold newlines and tabs).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from app.engine.tool_grammar import PreparedTools, ToolCallState, common_prefix, prepare, unpack
from app.models.tokenizer import Tokenizer

if TYPE_CHECKING:  # xgrammar is imported where first used: it takes seconds, which no plain request needs
    import xgrammar as xgr

    from app.engine.request import SamplingParams

JSON_OBJECT = '{"type": "object"}'
MAX_SCHEMA_CHARS = 16384  # compile time grows with size and nesting (about 0.5 s at 300 properties, 10 KB)
MAX_SCHEMA_DEPTH = 32  # nesting levels of the schema document (200 levels compile in seconds)
CACHED_GRAMMARS = 64


def check_schema(text: str) -> dict:
    """The schema a request's text holds, checked for shape and bounds (ValueError naming the limit)."""
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"the schema has {len(text)} characters, over the limit {MAX_SCHEMA_CHARS}")
    try:
        schema = json.loads(text)
    except RecursionError:  # json.loads gives up on nesting past Python's recursion limit
        raise ValueError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    except ValueError as e:
        raise ValueError(f"the schema is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("the schema must be a JSON object")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return schema


def _depth(doc) -> int:
    """Nesting levels of a JSON document (a scalar is 1), without recursion."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        x, level = todo.pop()
        deepest = max(deepest, level)
        children = x.values() if isinstance(x, dict) else x if isinstance(x, list) else ()
        todo += [(c, level + 1) for c in children]
    return deepest


class JsonGrammars:
    """Compiled JSON-schema grammars over one tokenizer, for logits rows `vocab_size` wide (the model's: ids
    past the tokenizer's are never allowed). Special tokens are never allowed inside the JSON; the tokenizer's
    end ids (`stop_token_ids`) end it. Thread-safe: the API, the engine's callers and its step thread share it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        table = [tokenizer.token_bytes(i, skip_special_tokens=True) if i < tokenizer.vocab_size else b""
                 for i in range(vocab_size)]
        self.vocab_size = vocab_size
        self.end_ids = tuple(tokenizer.stop_token_ids)
        self.encode = tokenizer.encode  # tool-call literals: their text as the tokenizer reads it, specials included
        self._added = {tokenizer.token_bytes(i).decode(): i for i in tokenizer.added_token_ids}
        info = xgr.TokenizerInfo(table, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(self.end_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._tools: OrderedDict[str, PreparedTools] = OrderedDict()
        self._lock = threading.Lock()
        keep = torch.ones(vocab_size, dtype=torch.bool)
        keep[[i for i, b in enumerate(table) if any(c < 0x20 for c in b)]] = False
        self.keep = keep  # [V] bool: tokens that may ever appear (no raw control bytes)
        text = torch.ones(vocab_size, dtype=torch.bool)
        text[[i for i, b in enumerate(table) if any(c < 0x20 and c not in b"\t\n\r" for c in b)]] = False
        self.keep_text = text  # [V] bool: the same for raw text (XML values), where tabs and newlines are text

    def _cached(self, cache: OrderedDict, text: str, make):
        """`cache[text]`, made by `make(text)` outside the lock on a miss (LRU, CACHED_GRAMMARS entries)."""
        with self._lock:
            if text in cache:
                cache.move_to_end(text)
                return cache[text]
        made = make(text)
        with self._lock:
            cache[text] = made
            while len(cache) > CACHED_GRAMMARS:
                cache.popitem(last=False)
        return made

    def compile(self, text: str) -> xgr.CompiledGrammar:
        """The grammar of the schema in `text` (cached); ValueError if the schema is malformed, over the bounds,
        or uses what xgrammar cannot compile (an unsupported type, a missing $ref, minLength over maxLength)."""
        return self._cached(self._cache, text, self._compile)

    def _compile(self, text: str) -> xgr.CompiledGrammar:
        check_schema(text)
        try:
            return self._compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"),
                                                      strict_mode=True)
        except RuntimeError as e:  # xgrammar reports schema errors as RuntimeError with a C++ location prefix
            raise ValueError(f"the schema cannot be compiled: {str(e).split(': ', 1)[-1].strip()}") from None

    def compile_arguments(self, text: str, style: str = "json", tail: str = "") -> xgr.CompiledGrammar:
        """A forced call's arguments grammar for the schema in `text` (cached): JSON (`compile`), or "qwen_xml"
        parameter blocks followed by `tail` (app/engine/tool_grammar.py). ValueError as `compile`'s."""
        if style == "json":
            return self.compile(text)
        if style != "qwen_xml":
            raise ValueError(f"unknown tool-call arguments style {style!r}")
        return self._cached(self._cache, f"{style}\0{tail}\0{text}", lambda _: self._compile_xml(text, tail))

    def _compile_xml(self, text: str, tail: str) -> xgr.CompiledGrammar:
        schema = check_schema(text)
        parts: list[dict] = [{"type": "json_schema", "json_schema": schema, "style": "qwen_xml",
                              "max_whitespace_cnt": 1}]
        for piece in _split_added(tail, self._added):
            parts.append({"type": "token", "token": piece} if isinstance(piece, int) else
                         {"type": "const_string", "value": piece})
        tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": parts}}
        try:
            return self._compiler.compile_structural_tag(json.dumps(tag))
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"the schema cannot be compiled: {str(e).split(': ', 1)[-1].strip()}") from None

    def state(self, text: str) -> GrammarState:
        return GrammarState(self, self.compile(text))

    def tools(self, text: str) -> PreparedTools:
        """The prepared forced tool calls of a `ToolSpec`'s text (cached); ValueError if they cannot be made."""
        return self._cached(self._tools, text, lambda t: prepare(self, t))

    def check(self, params: SamplingParams) -> None:
        """Compile what `params` constrains its output with (ValueError if it cannot be): before the request
        enters the engine, so that a step never compiles."""
        if params.guided_json is not None:
            self.compile(params.guided_json)
        if params.guided_tools is not None:
            self.tools(params.guided_tools)

    def state_for(self, params: SamplingParams) -> GrammarState | ToolCallState:
        """A fresh state of the grammar `params` asks for (a JSON schema or forced tool calls)."""
        if params.guided_tools is not None:
            return ToolCallState(self.tools(params.guided_tools))
        return self.state(params.guided_json)


class GrammarState:
    """One sequence's position in its grammar (see the module docstring)."""

    def __init__(self, grammars: JsonGrammars, compiled: xgr.CompiledGrammar) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._grammars, self._compiled = grammars, compiled
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bits = xgr.allocate_token_bitmask(1, grammars.vocab_size)
        self.consumed: list[int] = []

    def sync(self, output_ids: Seq[int]) -> None:
        """Accept the tokens of `output_ids` not consumed yet, after rolling back the consumed ones past their
        common prefix (speculative decoding walks the matcher along drafts, then back to what was accepted)."""
        n = common_prefix(self.consumed, output_ids)
        if n < len(self.consumed):
            self._matcher.rollback(len(self.consumed) - n)
            del self.consumed[n:]
        for token in output_ids[n:]:
            if not self._matcher.accept_token(token):
                raise ValueError(f"token {token} is outside the grammar")
            self.consumed.append(token)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def allowed(self, output_ids: Seq[int]) -> torch.Tensor:
        """[V] bool: the tokens that may follow `output_ids`."""
        self.sync(output_ids)
        self._matcher.fill_next_token_bitmask(self._bits)
        return unpack(self._bits[0], self._grammars.vocab_size) & self._grammars.keep

    def mask(self, row: torch.Tensor, output_ids: Seq[int]) -> None:
        """Set the logits of tokens that may not follow `output_ids` to -inf, in place. row: [V]."""
        row.masked_fill_(~self.allowed(output_ids).to(row.device), float("-inf"))


def _split_added(text: str, added: dict[str, int]) -> list[str | int]:
    """`text` as the tokenizer reads it: its added tokens as their ids, the text between them as text."""
    if not added:
        return [text] if text else []
    pattern = re.compile("(" + "|".join(map(re.escape, sorted(added, key=len, reverse=True))) + ")")
    return [added[p] if i % 2 else p for i, p in enumerate(pattern.split(text)) if p]


_GRAMMARS: weakref.WeakKeyDictionary[Tokenizer, dict[int, JsonGrammars]] = weakref.WeakKeyDictionary()
_GRAMMARS_LOCK = threading.Lock()


def for_tokenizer(tokenizer: Tokenizer, vocab_size: int | None = None) -> JsonGrammars:
    """The shared `JsonGrammars` of `tokenizer` at a logits width (default: the tokenizer's vocabulary)."""
    vocab_size = vocab_size or tokenizer.vocab_size
    with _GRAMMARS_LOCK:
        per = _GRAMMARS.setdefault(tokenizer, {})
        if vocab_size not in per:
            per[vocab_size] = JsonGrammars(tokenizer, vocab_size)
        return per[vocab_size]

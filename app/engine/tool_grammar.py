"""Forced tool calls: `tool_choice` "required" or a named function, enforced token by token.

A `ToolSpec` (its JSON text is `SamplingParams.guided_tools`, made by the API from the chat template's tool
format, app/api/tool_formats.py) says what the output is: one or more calls, each written exactly as the
template renders a call, then the end-of-turn token. The wrapper text (a Qwen `<tool_call>` block's
`{"name": "f", "arguments": `, a Kimi `<|tool_call_begin|>functions.f:3<|tool_call_argument_begin|>`) is
*literal*: its token ids are the tokenizer's encoding of that text, special tokens included, and only those ids
are allowed, so the bytes are the template's and a special token is never spelled out in plain characters.
Where the literals of several functions part, the model picks among them. Between literals, a function's
arguments follow its parameter schema through the JSON grammar (app/engine/grammar.py); the arguments end where
the object closes (the root of a parameters schema is an object, which cannot go on once closed).

Arguments are JSON (`style` "json") or Qwen3.5's XML parameter blocks ("qwen_xml": xgrammar's
`JSONSchemaFormat(style="qwen_xml")`, one whitespace character at most around each tag and value, where the
template writes a newline). XML parameters have no closing bracket of their own, so that style's argument grammar
takes the tail too (its added tokens, such as `</tool_call>`, as their ids) and ends with it; its literals below
then have an empty tail.

Literal choices at call c (base = `index_base`, the conversation's calls so far, for templates whose call ids
count them):
    c == 0:      prefix + head(f, base)                                   for each function f
    0 < c < max: tail + separator + head(f, base + c)   for each f,  or   tail + suffix + end
    c == max:    tail + suffix + end
so "required" makes at least one call and `max_calls` 1 is `parallel_tool_calls: false`.

With a `trigger` (`tool_choice` auto with strict tools) the output is free text, the end token included, until
its ids end with the trigger's (the format's opener: Qwen's `<tool_call>`, Kimi's section begin); the first
call's literal, which starts with those ids, then goes on from there, and everything after follows as above.
That is OpenAI's `strict`: a call the model starts is written whole and its arguments follow the schema.
Without `free_ends` the free text cannot end the output (a forced call after a reasoning block: the trigger is
the block's close, `</think>`, and the first call's literal starts with it).

`ToolCallState` has `GrammarState`'s interface (`sync`, `allowed`, `mask`, `terminated`, `consumed`): it follows
a sequence's output ids and rolls back to a common prefix (speculative decoding walks it along drafts), keeping
one snapshot per consumed token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from app.engine.grammar import JsonGrammars

FREE, LITERAL, ARGS, DONE = "free", "literal", "args", "done"
_BITS = torch.arange(32, dtype=torch.int32)


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed int32 bitmask row -> [vocab_size] bool."""
    return ((bits[:, None] >> _BITS) & 1).bool().flatten()[:vocab_size]


@dataclass(frozen=True)
class ToolSpec:
    """What a forced tool-call output looks like (see the module docstring). `head` holds `{name}` and may hold
    `{index}`; function names are `[A-Za-z0-9_-]` only, so neither placeholder can come from a name."""

    functions: tuple[tuple[str, str], ...]  # (name, parameters schema text)
    head: str
    tail: str
    prefix: str = ""
    separator: str = ""
    suffix: str = ""
    end: str = "<|im_end|>"
    index_base: int = 0
    max_calls: int = 1
    trigger: str = ""  # free text until the output's ids end with this text's (see the module docstring)
    style: str = "json"  # the arguments: JSON, or "qwen_xml" parameter blocks
    free_ends: bool = True  # the free text before the trigger may end the output

    def to_json(self) -> str:
        return json.dumps({**self.__dict__, "functions": [list(f) for f in self.functions]}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ToolSpec:
        d = json.loads(text)
        return cls(**{**d, "functions": tuple(tuple(f) for f in d["functions"])})

    def head_of(self, name: str, index: int) -> str:
        return self.head.replace("{name}", name).replace("{index}", str(index))

    @property
    def literal_tail(self) -> str:
        """The tail as written by the literals (an XML call's is its arguments grammar's)."""
        return self.tail if self.style == "json" else ""


@dataclass
class PreparedTools:
    """A spec bound to one tokenizer: compiled argument grammars and the literal choices per call (made lazily,
    shared by every sequence of the spec)."""

    spec: ToolSpec
    grammars: JsonGrammars
    compiled: list = field(default_factory=list)  # per function
    _choices: dict[int, list[tuple[tuple[int, ...], int]]] = field(default_factory=dict)

    @property
    def trigger(self) -> tuple[int, ...]:
        return tuple(self.grammars.encode(self.spec.trigger)) if self.spec.trigger else ()

    def choices(self, calls: int) -> list[tuple[tuple[int, ...], int]]:
        """The literals allowed after `calls` complete calls: (ids, function index, or -1 for the end)."""
        if calls not in self._choices:
            s, enc = self.spec, self.grammars.encode
            index = s.index_base + calls
            out = []
            if calls < s.max_calls:
                before = s.prefix if calls == 0 else s.literal_tail + s.separator
                out += [(tuple(enc(before + s.head_of(name, index))), i) for i, (name, _) in enumerate(s.functions)]
            if calls > 0:
                out.append((tuple(enc(s.literal_tail + s.suffix + s.end)), -1))
            self._choices[calls] = out
        return self._choices[calls]


def prepare(grammars: JsonGrammars, text: str) -> PreparedTools:
    """The `PreparedTools` of a spec's text; ValueError for a spec the grammar cannot take."""
    spec = ToolSpec.from_json(text)
    if not spec.functions or spec.max_calls < 1:
        raise ValueError("a tool-call grammar needs a function and at least one call")
    compiled = [grammars.compile_arguments(schema, spec.style, spec.tail) for _, schema in spec.functions]
    prepared = PreparedTools(spec, grammars, compiled)
    end = prepared.grammars.encode(spec.end)
    if len(end) != 1 or end[0] not in grammars.end_ids:
        raise ValueError(f"the tool format's end {spec.end!r} is not one end token of this tokenizer")
    for calls in range(min(spec.max_calls, 1) + 1):  # every literal shape: the first call, and what follows one
        for ids, _ in prepared.choices(calls):
            if max(ids, default=0) >= grammars.vocab_size:
                raise ValueError("a tool-call literal has ids past the model's vocabulary")
    trigger = prepared.trigger
    if spec.trigger and (not trigger or any(ids[: len(trigger)] != trigger or len(ids) == len(trigger)
                                            for ids, _ in prepared.choices(0))):
        raise ValueError(f"the trigger {spec.trigger!r} is not in the tokens every first call starts with")
    return prepared


@dataclass(frozen=True)
class _Point:
    """Where the state is, before some token: the phase, complete calls, the literal choices still open and the
    position in them, or the function whose arguments run and how many argument tokens its matcher took."""

    phase: str
    calls: int
    open: tuple[int, ...] = ()  # indexes into choices(calls)
    pos: int = 0
    fn: int = -1
    taken: int = 0


class ToolCallState:
    """One sequence's position in its forced tool calls (see the module docstring)."""

    def __init__(self, prepared: PreparedTools) -> None:
        import xgrammar as xgr

        self._xgr, self._p = xgr, prepared
        self._bits = xgr.allocate_token_bitmask(1, prepared.grammars.vocab_size)
        self._matchers: list = []  # one per call whose arguments started
        self._trigger = prepared.trigger
        self._at = _Point(FREE, 0) if self._trigger else self._literal(0)
        self._log: list[_Point] = []  # the point before each consumed token
        self.consumed: list[int] = []

    def _literal(self, calls: int) -> _Point:
        return _Point(LITERAL, calls, tuple(range(len(self._p.choices(calls)))))

    @property
    def terminated(self) -> bool:
        return self._at.phase == DONE

    def sync(self, output_ids: Seq[int]) -> None:
        """Accept the tokens of `output_ids` not consumed yet, after rolling back past their common prefix."""
        n = common_prefix(self.consumed, output_ids)
        if n < len(self.consumed):
            self._rollback(n)
        for token in output_ids[n:]:
            self._accept(token)

    def _rollback(self, n: int) -> None:
        at = self._log[n]
        del self._log[n:], self.consumed[n:]
        del self._matchers[at.calls + (at.phase == ARGS):]
        if at.phase == ARGS:
            matcher, taken = self._matchers[at.calls]
            matcher.rollback(taken - at.taken)
            self._matchers[at.calls] = [matcher, at.taken]
        self._at = at

    def _accept(self, token: int) -> None:
        at = self._at
        if at.phase == FREE:
            k = len(self._trigger)
            fired = tuple(self.consumed[len(self.consumed) - k + 1:] if k > 1 else ()) + (token,) == self._trigger
            nxt = _Point(LITERAL, 0, self._literal(0).open, k) if fired else at
        elif at.phase == LITERAL:
            choices = self._p.choices(at.calls)
            still = tuple(i for i in at.open if len(choices[i][0]) > at.pos and choices[i][0][at.pos] == token)
            if not still:
                raise ValueError(f"token {token} is outside the tool-call grammar")
            nxt = _Point(LITERAL, at.calls, still, at.pos + 1)
            done = [i for i in still if len(choices[i][0]) == at.pos + 1]
            if done:  # the literals are prefix-free: a complete one is the only one left
                fn = choices[done[0]][1]
                if fn < 0:
                    nxt = _Point(DONE, at.calls)
                else:
                    self._matchers.append([self._xgr.GrammarMatcher(self._p.compiled[fn]), 0])
                    nxt = _Point(ARGS, at.calls, fn=fn)
        elif at.phase == ARGS:
            entry = self._matchers[at.calls]
            if not entry[0].accept_token(token):
                raise ValueError(f"token {token} is outside the arguments' grammar")
            entry[1] += 1
            nxt = (self._literal(at.calls + 1) if entry[0].is_completed()
                   else _Point(ARGS, at.calls, fn=at.fn, taken=entry[1]))
        else:
            raise ValueError(f"token {token} after the tool calls ended")
        self._log.append(at)
        self.consumed.append(token)
        self._at = nxt

    def allowed(self, output_ids: Seq[int]) -> torch.Tensor:
        """[V] bool: the tokens that may follow `output_ids`."""
        self.sync(output_ids)
        g, at = self._p.grammars, self._at
        if at.phase == ARGS:
            self._matchers[at.calls][0].fill_next_token_bitmask(self._bits)
            return unpack(self._bits[0], g.vocab_size) & (g.keep if self._p.spec.style == "json" else g.keep_text)
        if at.phase == FREE:
            free = torch.ones(g.vocab_size, dtype=torch.bool)
            free[list(g.end_ids)] = self._p.spec.free_ends
            return free
        out = torch.zeros(g.vocab_size, dtype=torch.bool)
        if at.phase == LITERAL:
            choices = self._p.choices(at.calls)
            out[[choices[i][0][at.pos] for i in at.open]] = True
        else:
            out[list(g.end_ids)] = True
        return out

    def mask(self, row: torch.Tensor, output_ids: Seq[int]) -> None:
        """Set the logits of tokens that may not follow `output_ids` to -inf, in place. row: [V]."""
        row.masked_fill_(~self.allowed(output_ids).to(row.device), float("-inf"))

"""Chat answers of requests that read tool calls (`tool_choice` auto, required or named): the backend's outputs
through one `ToolOutput` per choice (app/api/tool_calls.py), as SSE chunks or as one chat.completion.

The backend always streams here, so that a stop string in the content (applied by the API: never inside a call)
ends the choice at once; a choice so ended reads no further outputs, and once every choice ended the generation
is closed (the engine aborts what is left). `finish_reason` is "tool_calls" when the answer holds calls and the
model ended it, "stop" at a stop string or end token without calls, "length" when cut off (a forced call cut off
comes back as far as it was written). With a thinking template (`split`, app/api/reasoning.py) the parser reads
the content after the reasoning, which comes back as `reasoning_content`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from app.api.errors import from_backend
from app.api.logprobs import chat_logprobs
from app.api.reasoning import Reasoning
from app.api.tool_calls import ToolOutput
from app.api.tools import ToolPlan
from app.engine.request import RequestOutput
from app.models.tokenizer import Tokenizer


@dataclass
class Choice:
    parser: ToolOutput
    ids: list[int] = field(default_factory=list)
    entries: list = field(default_factory=list)  # (token, logprobs entry) pairs, with logprobs
    finish_reason: str | None = None
    reasoning: Reasoning | None = None  # splits the reasoning off before the parser reads the content

    def message(self) -> dict:
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in self.parser.calls]
        thought = {} if self.reasoning is None else {"reasoning_content": self.reasoning.reasoning or None}
        empty = None if calls or self.reasoning is not None else ""  # a thinking answer's, as the plain chat's
        return {"role": "assistant", "content": self.parser.content or empty, **thought,
                **({"tool_calls": calls} if calls else {})}

    def feed(self, text: str, final: bool) -> list[dict]:
        """The deltas of the next output text: its reasoning, then the parser's of its content."""
        if self.reasoning is None:
            return self.parser.feed(text, final)
        thought, said = self.reasoning.feed(text, final)
        return ([{"reasoning_content": thought}] if thought else []) + self.parser.feed(said, final)


Event = tuple[int, list[dict], str | None, dict | None]


async def events(outputs, plan: ToolPlan, stops: tuple[str, ...], n: int, tok: Tokenizer,
                 choices: dict[int, Choice], heads: list[RequestOutput], split=None) -> AsyncIterator[Event]:
    """Per backend output of a choice still open: (choice index, its deltas, its finish_reason once it ends, the
    logprobs of its new tokens). `choices` fills with each choice's state, `heads` with the first output. `split`:
    a `Reasoning` factory, for a thinking template's answers."""
    async with aclosing(outputs):
        async for _, out in outputs:
            if not heads:
                heads.append(out)
            c = choices.get(out.index)
            if c is None:
                parser = ToolOutput(plan.fmt, plan.forced, stops, plan.max_calls, plan.schemas)
                c = choices[out.index] = Choice(parser, reasoning=split() if split else None)
            if c.finish_reason is not None:
                continue
            c.ids += out.new_token_ids
            if out.new_logprobs:
                c.entries += zip(out.new_token_ids, out.new_logprobs)
            deltas = c.feed(out.new_text, out.finished)
            if c.parser.stopped:
                c.finish_reason = "stop"
            elif out.finished:
                ended = out.finish_reason == "stop"
                c.finish_reason = "tool_calls" if c.parser.calls and ended else out.finish_reason
            lp = None
            if out.new_logprobs:
                lp = chat_logprobs(tok, out.new_token_ids, out.new_logprobs)
            yield out.index, deltas, c.finish_reason, lp
            if len(choices) == n and all(x.finish_reason is not None for x in choices.values()):
                return


async def collect(outputs, plan: ToolPlan, stops: tuple[str, ...], n: int, tok: Tokenizer,
                  split=None) -> tuple[dict[int, Choice], RequestOutput]:
    """Every choice's final state, and the first output (usage and fingerprint)."""
    choices: dict[int, Choice] = {}
    heads: list[RequestOutput] = []
    try:
        async for _ in events(outputs, plan, stops, n, tok, choices, heads, split):
            pass
    except Exception as e:
        raise from_backend(e) from e
    return choices, heads[0]

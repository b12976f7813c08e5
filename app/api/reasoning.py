"""Reasoning in chat answers: a thinking template's `<think>...</think>` block (Qwen3.5's) comes back as the
message's `reasoning_content` beside its `content`, as vLLM's and SGLang's `qwen3` reasoning parsers return it.

When: the chat template writes `</think>` (`thinks`). Where the reasoning starts (`opens_reasoning`):
- the prompt opened a block (its text's last `<think>` comes after its last `</think>`: Qwen3.5's generation
  prompt with thinking on, `<|im_start|>assistant\\n<think>\\n`): the output starts as reasoning;
- otherwise (`enable_thinking` false: the prompt closes an empty block) the output is content, unless it opens a
  block itself (`<think>` first, as older Qwen3 templates let the model do), which then starts the reasoning.
The reasoning ends at `</think>`, and the content is what follows, verbatim (the template's "\\n\\n" after the
close included, as vLLM returns it), so reasoning + `</think>` + content is the output's text. Where tool calls
are read (`implicit_end`), a call opened inside the reasoning (`<tool_call>` then `<function=`: Qwen3.5 sometimes
calls without closing the block) ends it too, and the call is content. An output cut off before either is all
reasoning (its content None). The first end in the text wins, streamed or not, so both give the same split.

`Reasoning.feed` reads one choice's output as it grows and returns the new reasoning and content text; what may
be the start of an end is held back until known. Stop strings are the engine's (plain chats: the whole text) or
the tool-call parser's (the content), never the reasoning's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

THINK, END_THINK = "<think>", "</think>"
AFTER_THINK = "\n\n"  # what Qwen3.5's template writes between a block's close and the answer
CALL = "<tool_call>"
CALL_OPENS = re.compile(r"<tool_call>\s*<function=")
FUNCTION = "<function="


def thinks(chat_template: str) -> bool:
    """Whether a chat template writes reasoning blocks."""
    return END_THINK in chat_template


def opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an open reasoning block."""
    return prompt_text.rfind(THINK) > prompt_text.rfind(END_THINK)


def _held(text: str, ending: str) -> int:
    """How many characters at the end of `text` may be the start of `ending`."""
    for k in range(min(len(text), len(ending)), 0, -1):
        if ending.startswith(text[-k:]):
            return k
    return 0


@dataclass
class Reasoning:
    """One choice's split into reasoning and content (module docstring). `opened`: the prompt opened a block;
    `implicit_end`: a tool call opened in the reasoning ends it."""

    opened: bool
    implicit_end: bool = False
    text: str = ""
    reasoning: str = ""  # sent so far
    content: str | None = None  # sent so far; None until the content starts
    _body: int | None = None  # where the reasoning starts in `text` (after an opening `<think>`), once known
    _start: int | None = None  # where the content starts, once known

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        """Take the next text of the output; -> (new reasoning text, new content text)."""
        self.text += delta
        sent = len(self.reasoning)
        if self._start is None:
            self._scan(final)
        new_reasoning = self.reasoning[sent:]
        if self._start is None:
            return new_reasoning, ""
        content = self.text[self._start:]
        new_content = content[len(self.content or ""):]
        self.content = content
        return new_reasoning, new_content

    def _scan(self, final: bool) -> None:
        text = self.text
        if self._body is None:
            lead = text.lstrip()
            if not final and THINK.startswith(lead) and lead != THINK:
                return  # only whitespace, or what may be the block's opener
            if lead.startswith(THINK):
                self._body = len(text) - len(lead) + len(THINK)
            elif self.opened:
                self._body = 0
            else:
                self._start = 0
                return
        body, at = self._body, self._body + len(self.reasoning)  # no end starts in what was sent
        cut, after = text.find(END_THINK, at), len(END_THINK)
        if self.implicit_end and (m := CALL_OPENS.search(text, at)) and (cut < 0 or m.start() < cut):
            cut, after = m.start(), 0
        if cut >= 0:
            self.reasoning, self._start = text[body:cut], cut + after
        else:
            self.reasoning = text[body:] if final else text[body: len(text) - self._hold(text[at:])]

    def _hold(self, tail: str) -> int:
        """Characters at the end of the reasoning not sent yet that may start its end."""
        hold = max(_held(tail, END_THINK), _held(tail, CALL) if self.implicit_end else 0)
        if self.implicit_end and (i := tail.rfind(CALL)) >= 0 and FUNCTION.startswith(tail[i + len(CALL):].lstrip()):
            hold = max(hold, len(tail) - i)
        return hold

    def message(self) -> dict:
        """The message fields of the whole output (once fed its end): `reasoning_content` and `content`."""
        return {"reasoning_content": self.reasoning or None, "content": self.content or None}

"""What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` ask for, checked against the operator's
caps (`ApiSettings`) and the chat template's tool format (app/api/tool_calls.py), as a `ToolPlan`.

- `tool_choice` defaults to "auto" with tools and "none" without; "none" keeps the tools in the prompt and reads
  no calls; "auto" reads the calls the model writes (with a `strict` tool, a call the model opens is then
  written whole by the grammar: OpenAI's strict mode); "required" and a named function force calls through the
  engine's grammar (`SamplingParams.guided_tools`, app/engine/tool_grammar.py).
- Every function's `parameters` must be a schema whose root is an object; each is compiled by the grammar engine
  (whatever the choice, so that a schema it cannot take is refused up front), within `max_grammar_compile_s`.
- Caps: `max_tools` functions, `max_tools_chars` characters of tool JSON, `max_tool_calls` calls per answer; the
  rendered tools count against `max_prompt_tokens` like any prompt text.
- A prompt that opened a reasoning block (Qwen3.5 thinking, app/api/reasoning.py) gets forced calls after the
  reasoning (`after_reasoning`): the model reasons freely, cannot end there, and from its `</think>` the calls are
  forced, as vLLM applies a tool grammar once the reasoning ended.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from app.api.errors import ApiError
from app.api.reasoning import AFTER_THINK, END_THINK
from app.api.tool_calls import ToolFormat, format_of
from app.engine.grammar import for_tokenizer as grammars_for
from app.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from app.api.routes import ApiSettings
    from app.api.schemas import ChatCompletionRequest


@dataclass(frozen=True)
class ToolPlan:
    fmt: ToolFormat
    tools: list[dict]  # what the chat template renders
    choice: str  # none | auto | required | named
    guided: str | None  # the ToolSpec JSON the engine's grammar follows (SamplingParams.guided_tools), if any
    max_calls: int
    functions: list[tuple[str, str]] = field(default_factory=list)  # (name, parameters schema text) allowed
    base: int = 0  # the conversation's calls so far
    schemas: dict = field(default_factory=dict)  # each function's parameters, by name (typing XML values)
    reasoned: bool = False  # forced calls come after the output's reasoning block (`after_reasoning`)

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """The output is calls from its first token (a grammar without a trigger)."""
        return self.choice in ("required", "named")


def _schema(parameters: dict | None, where: str) -> str:
    """The arguments' schema text: `parameters`, its root an object (a schema without a type gets one)."""
    if parameters is None:
        return json.dumps({"type": "object"})
    if parameters.get("type", "object") != "object":
        raise ApiError(400, f"{where}: the root of a function's parameters must be an object schema", param=where)
    return json.dumps({"type": "object", **parameters}, ensure_ascii=False)


async def plan(body: ChatCompletionRequest, tok: Tokenizer, settings: ApiSettings) -> ToolPlan | None:
    """The request's tool plan, or None when it names no tools (400/413 naming the field at fault)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice: needs tools", param="tool_choice")
        return None
    if body.response_format is not None and body.response_format.type != "text":
        raise ApiError(400, "response_format: cannot be combined with tools (a call is not the JSON value)",
                       param="response_format")
    fmt = format_of(tok.chat_template)
    if fmt is None:
        raise ApiError(400, "tools: this model's chat template renders no tool calls", param="tools")
    if len(body.tools) > settings.max_tools:
        raise ApiError(400, f"tools: {len(body.tools)} is over the limit {settings.max_tools}", param="tools")
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    size = len(json.dumps(tools, ensure_ascii=False))
    if size > settings.max_tools_chars:
        raise ApiError(413, f"tools: {size} characters of tool JSON, over the limit {settings.max_tools_chars}",
                       param="tools")
    names: dict[str, int] = {}
    for i, tool in enumerate(body.tools):
        if names.setdefault(tool.function.name, i) != i:
            raise ApiError(400, f"tools.{i}.function.name: {tool.function.name!r} is named twice",
                           param=f"tools.{i}.function.name")
    schemas = [_schema(t.function.parameters, f"tools.{i}.function.parameters") for i, t in enumerate(body.tools)]
    await _compile(tok, fmt, schemas, settings.max_grammar_compile_s)
    kind = choice.type if choice is not None and not isinstance(choice, str) else (choice or "auto")
    if kind == "function":
        name = choice.function.name
        if name not in names:
            raise ApiError(400, f"tool_choice.function.name: no function named {name!r} in tools",
                           param="tool_choice.function.name")
        functions, kind = [(name, schemas[names[name]])], "named"
    else:
        functions = list(zip(names, schemas))
    max_calls = settings.max_tool_calls if body.parallel_tool_calls else 1
    guided = None
    base = sum(len(m.tool_calls or ()) for m in body.messages)  # Kimi's call ids count the conversation's
    unbound = not any(getattr(body, f) for f in ("stop_token_ids", "min_tokens", "ignore_eos"))
    if kind in ("required", "named"):
        for field in ("stop_token_ids", "min_tokens", "ignore_eos"):
            if getattr(body, field):
                raise ApiError(400, f"{field}: cannot be combined with tool_choice {kind} (the grammar ends the "
                               "output where the calls end)", param=field)
        guided = fmt.spec(functions, base, max_calls).to_json()
    elif kind == "auto" and unbound and any(t.function.strict for t in body.tools):
        guided = _triggered(tok, fmt.spec(functions, base, max_calls, trigger=fmt.opens).to_json())
    schemas_of = {t.function.name: t.function.parameters or {} for t in body.tools}
    return ToolPlan(fmt, tools, kind, guided, max_calls, functions, base, schemas_of)


def after_reasoning(plan: ToolPlan, tok: Tokenizer) -> ToolPlan:
    """A forced plan whose calls follow a reasoning block the prompt opened: free text that cannot end the output
    until the model writes `</think>`, then the template's separator and the calls as forced. The plan as it was
    where the tokenizer does not write `</think>` as the first tokens of that literal."""
    if not plan.forced:
        return plan
    spec = plan.fmt.spec(plan.functions, plan.base, plan.max_calls, trigger=END_THINK, before=END_THINK + AFTER_THINK,
                         free_ends=False).to_json()
    if _triggered(tok, spec) is None:
        return plan
    return replace(plan, guided=spec, reasoned=True)


def _triggered(tok: Tokenizer, spec: str) -> str | None:
    """A strict auto request's grammar (free text until the model opens a call), or None where the tokenizer
    does not write the opener as the start of every call's tokens (a plain-text opener that merges with what
    follows it, as the zoo's): then calls are read as written."""
    try:
        grammars_for(tok).tools(spec)
    except ValueError:
        return None
    return spec


async def _compile(tok: Tokenizer, fmt: ToolFormat, schemas: list[str], limit_s: float) -> None:
    """Compile every schema (cached by text) as the format's arguments, in a worker thread: past `limit_s` the
    request is refused (the compilation finishes in the background and is cached; the size caps bound it)."""
    grammars = grammars_for(tok)

    def run() -> tuple[int, str] | None:
        for i, text in enumerate(schemas):
            try:
                grammars.compile_arguments(text, fmt.style, fmt.tail)
            except ValueError as e:
                return i, str(e)
        return None

    try:
        failed = await asyncio.wait_for(asyncio.to_thread(run), limit_s)
    except TimeoutError:
        raise ApiError(400, f"tools: the parameter schemas took over {limit_s:g} s to compile into a grammar",
                       param="tools") from None
    if failed is not None:
        where = f"tools.{failed[0]}.function.parameters"
        raise ApiError(400, f"{where}: {failed[1]}", param=where)

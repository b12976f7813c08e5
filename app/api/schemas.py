"""OpenAI-compatible request and response bodies (the subset this server implements).

Types are strict: `"n": "2"`, `"stream": "yes"` or `true` for an integer are 400s, not coerced (a float field
takes an integer). Every string must be encodable as UTF-8 (JSON can carry a lone surrogate such as
`"\\ud800"`, which no tokenizer takes). Caps that an operator sets (prompts per request, stop strings, ...) are
checked in the routes against `ApiSettings`; what is here holds for every deployment.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from app.engine.grammar import JSON_OBJECT

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what torch.Generator.manual_seed takes (with room for seed + index)
MAX_LOGPROBS = 20  # OpenAI's cap on top alternatives per token (app.engine.request.MAX_LOGPROBS)


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text must be valid Unicode: {e.reason} at character {e.start}") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
# Top-level request bodies keep the fields they do not declare (`model_extra`), so that the routes can refuse
# each one by name (`unsupported_field`) instead of ignoring what a client expects to take effect.
TOP_LEVEL = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

# Accepted and ignored: they change nothing about a completion (docs/serving.md, "Request fields").
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier"})
# Unsupported fields whose value asks for nothing beyond the default (a client library filling every field):
# accepted. Any other value is refused naming the field. (`functions` and `function_call` are the legacy form of
# `tools` and `tool_choice`.) On a completion, `tools` and the like are undeclared, so refused the same way.
NEUTRAL_VALUES = {"suffix": (None, ""), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
                  "function_call": (None, "none"), "parallel_tool_calls": (None, True, False)}


def unsupported_field(extra: dict | None, n: int = 1) -> str | None:
    """The first field of `extra` (a body's undeclared fields) that the API does not support, or None. A null
    is a field not set, whatever its name; `best_of` equal to `n` is plain sampling."""
    for name, value in (extra or {}).items():
        if value is None or name in IGNORED_FIELDS:
            continue
        if name == "best_of" and type(value) is int and value == n:
            continue
        if any(type(value) is type(v) and value == v for v in NEUTRAL_VALUES.get(name, ())):
            continue
        return name
    return None


# Inside a chat message: `name` is accepted and ignored (the chat templates do not render it). Content parts are
# text only: an image or audio part would otherwise be dropped from the prompt without a word.
IGNORED_MESSAGE_FIELDS = frozenset({"name"})
NEUTRAL_MESSAGE_VALUES: dict[str, tuple] = {}


def unsupported_message_field(messages: list) -> str | None:
    """The path ("messages.2.tool_calls", "messages.0.content.1.type") of the first thing inside `messages` the
    API does not support, or None: an undeclared field with a value other than null or a neutral one, or a
    content part whose type is not "text"."""
    for i, message in enumerate(messages):
        for name, value in (message.model_extra or {}).items():
            neutral = any(type(value) is type(v) and value == v for v in NEUTRAL_MESSAGE_VALUES.get(name, ()))
            if value is not None and name not in IGNORED_MESSAGE_FIELDS and not neutral:
                return f"messages.{i}.{name}"
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part.type != "text":
                return f"messages.{i}.content.{j}.type"
            for name, value in (part.model_extra or {}).items():
                if value is not None:
                    return f"messages.{i}.content.{j}.{name}"
    return None


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`. The grammar is enforced whatever `strict` says."""

    model_config = STRICT

    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Text | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: "text" (no constraint), "json_object" (any JSON object) or "json_schema"."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError('type "json_schema" needs json_schema.schema')
        return self

    def guided_json(self) -> str | None:
        """The schema text the engine's grammar follows (`SamplingParams.guided_json`), or None for text."""
        if self.type == "json_object":
            return JSON_OBJECT
        return None if self.type == "text" else json.dumps(self.json_schema.schema_)


class _Request(BaseModel):
    model_config = TOP_LEVEL

    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=1, description="new tokens at most")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="extension: 0 is off")
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = Field(default=None, description="vLLM's: generation ends after any of these "
                                             "ids, which are not part of the text")
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    ignore_eos: bool = Field(default=False, description="extension: do not stop at end-of-text")
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0, description="vLLM's")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="vLLM's")
    logit_bias: dict[str, float] | None = Field(default=None, description="token id (as a string) -> bias in "
                                                "[-100, 100]")
    min_tokens: int = Field(default=0, ge=0, description="vLLM's: no stop before this many tokens")
    cache_salt: Text | None = Field(default=None, description="prefixes are shared only among requests with the "
                                    "same salt (vLLM's field): one tenant's prompts do not hit another's cache")
    prompt_cache_key: Text | None = Field(default=None, description="OpenAI's routing hint: requests with the same "
                                          "key (and cache_salt) go to one replica while its load allows")
    cache_lossless: bool = Field(default=False, description="extension: resume only from exact checkpoints, never "
                                 "from a compressed (dasc) one")
    response_format: ResponseFormat | None = Field(default=None, description="json_object or json_schema: the "
                                                   "output is JSON that follows it (docs/serving.md)")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0, description="new tokens at most (0: with echo, the prompt "
                                   "alone)")
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, description="each token's log-probability "
                                 "and this many top alternatives")

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], list) and any(not p for p in v):
            raise ValueError("prompt token lists must not be empty")
        return v


class ContentPart(BaseModel):
    model_config = TOP_LEVEL  # undeclared fields are refused by name (`unsupported_message_field`)

    type: Text
    text: Text | None = None


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
FORBID = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # inside tools: an unknown key is a 400


class FunctionCall(BaseModel):
    """A call in an assistant message of the history. `arguments` is rendered back verbatim."""

    model_config = FORBID

    name: Text
    arguments: Text


class ToolCall(BaseModel):
    model_config = FORBID

    id: Text = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = FORBID

    name: FunctionName
    description: Text | None = None
    parameters: dict | None = Field(default=None, description="a JSON schema whose root is an object")
    strict: bool | None = None  # under auto: a call the model opens is written whole by the grammar


class Tool(BaseModel):
    model_config = FORBID

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = FORBID

    name: Text


class NamedToolChoice(BaseModel):
    model_config = FORBID

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = TOP_LEVEL  # undeclared fields are refused by name (`unsupported_message_field`)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = ""
    reasoning_content: Text | None = None  # an assistant's reasoning (the template decides where it goes)
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: Text | None = Field(default=None, max_length=256)  # a tool result's: the call it answers

    @model_validator(mode="after")
    def _roles(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message has them")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("reasoning_content: only an assistant message has it")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message needs the id of the call it answers")
        return self

    def template_dict(self) -> dict:
        """What the chat template sees: role, the content's text, and the tool fields where set."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content if part.type == "text")
        return self.content or ""


# vLLM's `chat_template_kwargs`: scalars by name, checked against the template's variables in the routes
TemplateKwargs = dict[Annotated[str, Field(max_length=64)], bool | int | float | Text | None]


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="default: auto with tools, none without")
    parallel_tool_calls: bool = Field(default=True, description="false: at most one call per answer")
    chat_template_kwargs: TemplateKwargs | None = Field(default=None, description="vLLM's: the chat template's own "
                                                        "variables (enable_thinking for Qwen3.5)")

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text (`prompt`) or a conversation (`messages`, formatted as chat completions do)."""

    model_config = TOP_LEVEL

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None
    add_special_tokens: bool = Field(default=True, description="the zoo tokenizers add none either way")
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = TOP_LEVEL

    model: Text | None = None
    tokens: list[int]


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, ChatMessage, ContentPart, StreamOptions,
                  TokenizeRequest, DetokenizeRequest, ResponseFormat, JsonSchemaFormat, Tool, FunctionDef,
                  NamedToolChoice, NamedFunction, ToolCall, FunctionCall)
FIELD_NAMES = {f.alias or name for model in REQUEST_MODELS for name, f in model.model_fields.items()}


def register_fields(*models: type[BaseModel]) -> None:
    """Let `field_path` name the fields of request bodies defined elsewhere (app/api/responses.py)."""
    FIELD_NAMES.update(f.alias or name for model in models for name, f in model.model_fields.items())


def field_path(loc: tuple) -> str:
    """The field a validation error's `loc` names, as "messages.0.content.0.text": list indexes kept, pydantic's
    union-member tags ("str", "list[int]", ...) and the leading "body" left out."""
    return ".".join(str(x) for x in loc if isinstance(x, int) or x in FIELD_NAMES)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error status answers this body (OpenAI's)."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict = Field(default_factory=dict)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, compressed: bool = False) -> dict:
    """OpenAI's usage, with an extension in `prompt_tokens_details`: `compressed_checkpoint`, whether a lossy
    (dasc or INT8) checkpoint served any of the request's prompts."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details={"cached_tokens": cached_tokens, "compressed_checkpoint": compressed}
                 ).model_dump()


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error JSON. Text from the client can reach `message`; characters UTF-8 cannot carry (a lone
    surrogate) come out as backslash escapes, so the body always encodes."""
    safe = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": safe, "type": type_, "param": param, "code": code}}


def now() -> int:
    return int(time.time())

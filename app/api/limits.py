"""What a request may ask for, checked before anything reaches the engine: the operator's caps from
`ApiSettings` (prompts, sequences, stop strings, messages, `cache_salt`, tokens), the prompt's ids, and the
400 a validation error becomes (naming the field at fault).

Chat messages are encoded with `Tokenizer.encode_chat`: a special-token string in a message is plain text, so
a user cannot forge a turn. A completion's raw text prompt keeps `encode`'s behaviour (special strings become
control ids): its sender writes the whole prompt, and may format a chat of its own. `chat_template_kwargs`
(vLLM's) must name variables the chat template reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jinja2

from app.api.errors import ApiError
from app.api.schemas import CompletionRequest, field_path, unsupported_field, unsupported_message_field
from app.engine.grammar import for_tokenizer as grammars_for
from app.engine.request import SamplingParams
from app.models.tokenizer import RENDER_ARGS, Tokenizer

MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's cap

if TYPE_CHECKING:
    from app.api.recall import Recall
    from app.api.routes import ApiSettings


def _over(param: str, what: str, count: int, cap: int) -> None:
    if count > cap:
        raise ApiError(400, f"{what}: {count} is over the limit {cap}", param=param)


def check_request(body, settings: ApiSettings) -> None:
    """What the API would otherwise ignore: a field it does not support (400 naming it: a client asking for
    `tools` or `logit_bias` must not get an answer made without them) and a model it does not serve (404, as
    OpenAI answers; a request naming no model gets the served one)."""
    name = unsupported_field(body.model_extra, getattr(body, "n", 1))
    if name is None and getattr(body, "messages", None):
        name = unsupported_message_field(body.messages)
    if name is not None:
        raise ApiError(400, f"{name}: not supported by this server", param=name)
    if body.model is not None and body.model != settings.model_name:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {settings.model_name!r}",
                       param="model", code="model_not_found")


def completion_prompts(body: CompletionRequest, tok: Tokenizer, settings: ApiSettings) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    batch = not isinstance(prompt[0], int)  # a list of texts or of id lists; a flat id list is one prompt
    _over("prompt", "prompts in one request", len(prompt) if batch else 1, settings.max_prompts)
    if isinstance(prompt[0], str):
        return [tok.encode(p) for p in prompt]
    return [list(p) for p in prompt] if batch else [list(prompt)]


def chat_prompt(body, tok: Tokenizer, settings: ApiSettings, add_generation_prompt: bool = True,
                tools: list[dict] | None = None, recall: Recall | None = None) -> list[int]:
    """The ids of `body.messages` and `tools` (a chat completion's, or /tokenize's), rendered with the body's
    `chat_template_kwargs`. With `recall`, a re-sent answer keeps the ids it was generated as (app/api/recall.py)."""
    _over("messages", "messages in one request", len(body.messages), settings.max_messages)
    messages = [m.template_dict() for m in body.messages]
    kwargs = template_kwargs(body, tok)
    try:
        pieces = tok.chat_pieces(messages, add_generation_prompt, tools, **kwargs)
        ids = None if recall is None else recall.prompt_ids(tok, messages, tools, pieces, body.cache_salt, kwargs)
    except (ValueError, jinja2.TemplateError) as e:  # the model's template refused the conversation
        raise ApiError(400, f"messages: {e}", param="messages") from e
    return tok.encode_pieces(pieces) if ids is None else ids


def template_kwargs(body, tok: Tokenizer) -> dict:
    """The body's `chat_template_kwargs`, each a variable the chat template reads (beyond messages, tools and
    the generation prompt) and `enable_thinking` a boolean; else a 400 naming the entry."""
    kwargs = dict(getattr(body, "chat_template_kwargs", None) or {})
    takes = tok.template_variables - RENDER_ARGS
    for name, value in kwargs.items():
        where = f"chat_template_kwargs.{name}"
        if name not in takes:
            known = ", ".join(sorted(takes)) or "none"
            raise ApiError(400, f"{where}: not a variable of this model's chat template (it takes: {known})",
                           param=where)
        if name == "enable_thinking" and type(value) is not bool:
            raise ApiError(400, f"{where}: must be a boolean", param=where)
    return kwargs


def guided_json(body, tok: Tokenizer) -> str | None:
    """The schema text of `response_format` (None for text), compiled once here so that a schema the grammar
    library cannot take is a 400 naming `response_format`; fields that could end the output elsewhere than
    where the JSON value ends are 400s naming them."""
    fmt = body.response_format
    text = None if fmt is None else fmt.guided_json()
    if text is None:
        return None
    for name in ("stop", "stop_token_ids", "ignore_eos", "min_tokens"):
        if getattr(body, name):
            raise ApiError(400, f"{name}: cannot be combined with response_format {fmt.type} (it could end the "
                           "output before the JSON value ends, or keep it going after)", param=name)
    try:
        grammars_for(tok).compile(text)
    except ValueError as e:
        raise ApiError(400, f"response_format: {e}", param="response_format") from e
    return text


def sampling_params(body, max_tokens: int | None, settings: ApiSettings, prompts: int, vocab_size: int,
                    guided_json: str | None = None, guided_tools: str | None = None,
                    engine_stops: bool = True, output_resumed: bool = False) -> SamplingParams:
    """`engine_stops` False: the stop strings are checked here but applied by the API (to the content outside
    tool calls), not by the engine."""
    n_tokens = settings.default_max_tokens if max_tokens is None else max_tokens
    echo = getattr(body, "echo", False)
    if n_tokens == 0 and not echo:
        raise ApiError(400, "max_tokens: 0 is only for echo (the prompt alone, with its logprobs)", param="max_tokens")
    _over("max_tokens", "max_tokens", n_tokens, settings.max_tokens_limit)
    _over("n", "sequences (prompts x n)", prompts * body.n, settings.max_sequences)
    stops = body.stop or []
    _over("stop", "stop strings", len(stops), settings.max_stops)
    _over("stop", "characters in a stop string", max(map(len, stops), default=0), settings.max_stop_chars)
    _over("cache_salt", "characters in cache_salt", len(body.cache_salt or ""), settings.max_cache_salt_chars)
    stop_ids = tuple(body.stop_token_ids or ())
    _over("stop_token_ids", "stop token ids", len(stop_ids), MAX_STOP_TOKEN_IDS)
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise ApiError(400, f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    bias = _logit_bias(body.logit_bias or {}, vocab_size)
    if body.min_tokens > n_tokens:
        raise ApiError(400, f"min_tokens ({body.min_tokens}) is over max_tokens ({n_tokens})", param="min_tokens")
    if getattr(body, "top_logprobs", None) is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
    # echo with logprobs reports the prompt's too; echo with max_tokens 0 runs the prompt alone (its logprobs are
    # computed, a 0 reports none of the alternatives)
    prompt_logprobs = body.logprobs if echo and body.logprobs is not None else (0 if echo and n_tokens == 0 else None)
    try:
        return SamplingParams(max_tokens=n_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                              stop=tuple(stops) if engine_stops and guided_tools is None else (), seed=body.seed,
                              n=body.n, ignore_eos=body.ignore_eos,
                              cache_salt=body.cache_salt, logprobs=body.top_logprobs_wanted,
                              stop_token_ids=stop_ids, presence_penalty=body.presence_penalty,
                              frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                              min_p=body.min_p, logit_bias=bias, min_tokens=body.min_tokens,
                              prompt_logprobs=prompt_logprobs, cache_lossless=body.cache_lossless,
                              guided_json=guided_json, guided_tools=guided_tools, output_resumed=output_resumed)
    except ValueError as e:
        raise ApiError(400, str(e)) from e


def _logit_bias(bias: dict[str, float], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token ids as strings) as (id, bias) pairs, checked."""
    _over("logit_bias", "entries in logit_bias", len(bias), MAX_LOGIT_BIAS)
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or not 0 <= int(key) < vocab_size:
            raise ApiError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                           param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise ApiError(400, f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def check_prompt(ids: list[int], settings: ApiSettings, tok: Tokenizer) -> None:
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if len(ids) > settings.max_prompt_tokens:
        raise ApiError(413, f"prompt has {len(ids)} tokens, over the limit {settings.max_prompt_tokens}",
                       param="prompt")
    check_ids(ids, tok, "prompt")


def check_ids(ids: list[int], tok: Tokenizer, param: str) -> None:
    if any(not 0 <= t < tok.vocab_size for t in ids):
        raise ApiError(400, f"{param} token ids must be in [0, {tok.vocab_size})", param=param)


def from_validation(errors: list[dict]) -> ApiError:
    """The 400 for pydantic's errors: the first field at fault, and of the errors about it (a union gives one
    per member) the one that got furthest into the input, as a parser reports its furthest failure:
    "messages.0.content.0.text" rather than "messages.0.content", "prompt.1" rather than "prompt.0" for
    `[1, "a"]`."""
    if not errors:
        return ApiError(400, "invalid request")
    if errors[0].get("type") == "json_invalid":
        return ApiError(400, "the request body is not valid JSON")
    top = field_path(errors[0]["loc"]).split(".")[0]
    about = [e for e in errors if field_path(e["loc"]).split(".")[0] == top]
    best = max(about, key=_reach)
    where = field_path(best["loc"])
    message = str(best.get("msg", "invalid request")).removeprefix("Value error, ")
    return ApiError(400, f"{where}: {message}" if where else message, param=where or None)


def _reach(error: dict) -> tuple[int, list[int]]:
    """How far into the input an error got: the depth of its field, then the list indexes on the way."""
    return field_path(error["loc"]).count("."), [x for x in error["loc"] if isinstance(x, int)]

"""FastAPI routes of the OpenAI-compatible API, over any `Backend` (the Ray Serve ingress, or a local engine).

Errors are OpenAI-style JSON (app/api/errors.py). In front of the routes, `Guard` (app/api/guards.py) checks the
key, the body size and admission, and turns any unhandled exception into a JSON 500; CORS is on only when
`cors_origins` names origins. The prompts of one request are generated concurrently and streamed through a
bounded buffer (app/api/streams.py), and leave collected whole or as server-sent chunks (app/api/answers.py). A
thinking template's chat answers split their reasoning off as `reasoning_content` (app/api/reasoning.py).
Request bodies are in app/api/schemas.py; caps an operator sets are checked here (app/api/limits.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api import limits, reasoning, resend, responses, tool_answers, tools
from app.api.answers import chat_chunks, chat_tool_chunks, collect, completion_chunks, fingerprint, first_output, sse
from app.api.errors import REQUEST_ID, ApiError, error_response, openapi_responses, public_reason, strip_422
from app.api.guards import Guard, RequestId
from app.api.hints import RouteHint
from app.api.logprobs import CompletionLogprobs, chat_logprobs
from app.api.recall import Recall
from app.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    now,
    usage,
)
from app.api.streams import Outputs
from app.engine.request import RequestOutput, SamplingParams
from app.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)
GENERATION = openapi_responses(400, 401, 404, 413, 429, 500, 503)


class Backend(Protocol):
    tokenizer: Tokenizer
    max_model_len: int  # longest prompt plus output, in tokens

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request cannot be served (context length, ...)."""

    def generate(self, prompt_ids: list[int], params: SamplingParams, *, deadline: float | None = None,
                 stream: bool = True, hint: RouteHint | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (`stream` False: each sequence's first output, then the rest merged into
        one at its end; see `AsyncEngine.generate`). `deadline` (time.time()): a request not started by then fails
        with QueueTimeout. `hint`: where its prefix may live, for a router (app/api/hints.py). Closing the
        iterator early aborts the request. Raises ValueError for bad input and the types of app/engine/errors.py
        when the engine cannot serve it."""

    async def health(self) -> None:
        """Return when the engine(s) can step; raise otherwise (cheap: no generation)."""

    async def metrics_text(self) -> str: ...

    async def status(self) -> dict: ...


@dataclass(frozen=True)
class ApiSettings:
    """The API's limits (`api:` in the serve config, `ApiArgs` in deployments/builder.py; docs/serving.md)."""

    model_name: str
    api_key: str | tuple[str, ...] | None = None  # several: any one is accepted (stored responses stay per key)
    max_prompt_tokens: int = 3072
    max_tokens_limit: int = 1024
    default_max_tokens: int = 16
    max_body_bytes: int = 1 << 20
    max_prompts: int = 16  # prompts in one completion request
    max_sequences: int = 64  # prompts x n of one request
    max_stops: int = 4
    max_stop_chars: int = 256
    max_messages: int = 256
    max_cache_salt_chars: int = 256
    cors_origins: Sequence[str] = ()  # empty: no CORS headers
    request_id_header: bool = True  # echo X-Request-Id (off behind Serve's proxy, which does it itself)
    max_in_flight: int = 256  # generation requests open in this API process; beyond: 429
    queue_timeout_s: float = 60.0  # a request not started by then: 503
    max_buffered_chunks: int = 256  # stream chunks a client may fall behind before its request is aborted
    max_tools: int = 128  # functions in one request's tools (OpenAI's cap)
    max_tools_chars: int = 65536  # characters of one request's tool JSON
    max_tool_calls: int = 16  # calls in one answer (parallel_tool_calls: false is 1)
    max_grammar_compile_s: float = 5.0  # the tools' parameter schemas compile within this, or the request is a 400
    recall_tokens: int = 1 << 22  # ids of recent chat answers kept so a re-sent answer keeps them (0: off)
    # a thinking template's chat turn also stores the conversation as its next turn re-sends it (app/api/resend.py)
    warm_next_turn: bool = True
    max_stored_responses: int = 10_000  # Responses API: stored responses at most (the oldest go first)
    max_stored_response_bytes: int = 256 << 20  # ... and their ids and text at most
    stored_response_age_s: float = 24 * 3600.0  # ... kept this long at most


def build_api(backend: Backend, settings: ApiSettings) -> FastAPI:
    app = FastAPI(title="dasc-serve", version="0.1.0", redirect_slashes=False,  # a 307 has no JSON body
                  lifespan=_lifespan(backend))
    tok = backend.tokenizer
    recall = Recall(settings.recall_tokens)
    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       max_in_flight=settings.max_in_flight)
    if settings.request_id_header:
        app.add_middleware(RequestId)  # added last: outermost, so that refusals carry the id too
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    _handlers(app)
    _documented_errors_only(app)
    responses.register(app, backend, settings, recall, SimpleNamespace(_validate=_validate, _start=_start))

    @app.get("/health", responses=openapi_responses(503))
    async def health():
        try:
            await backend.health()
        except Exception as e:
            raise ApiError(503, f"not healthy: {public_reason(e)}", "server_error", retry_after_s=5.0) from e
        return {"status": "ok"}

    @app.get("/v1/models", responses=openapi_responses(401))
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "dasc-serve"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(await backend.metrics_text() + recall.metrics_text(),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/status")
    async def status():
        return {**await backend.status(), "recall": dict(recall.stats)}

    @app.post("/tokenize", responses=openapi_responses(400, 401, 404, 413))
    async def tokenize(body: TokenizeRequest):
        """vLLM's: the ids a prompt, or a conversation formatted as chat completions format it, becomes."""
        limits.check_request(body, settings)
        tool_json = [t.model_dump(exclude_none=True) for t in body.tools or ()]
        ids = (tok.encode(body.prompt) if body.prompt is not None else
               limits.chat_prompt(body, tok, settings, body.add_generation_prompt, tool_json))
        return {"count": len(ids), "max_model_len": backend.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses=openapi_responses(400, 401, 404, 413))
    async def detokenize(body: DetokenizeRequest):
        limits.check_request(body, settings)
        limits.check_ids(body.tokens, tok, "tokens")
        return {"prompt": tok.decode(body.tokens)}

    @app.post("/v1/completions", responses=GENERATION)
    async def completions(body: CompletionRequest, request: Request):
        limits.check_request(body, settings)
        prompts = limits.completion_prompts(body, tok, settings)
        params = limits.sampling_params(body, body.max_tokens, settings, len(prompts), tok.vocab_size,
                                        limits.guided_json(body, tok))
        for p in prompts:
            limits.check_prompt(p, settings, tok)
            _validate(backend, p, params)
        rid = _request_id("cmpl", request)
        outputs = _start(backend, prompts, params, settings, body.stream, RouteHint(body.prompt_cache_key))
        if body.stream:
            first = await first_output(outputs)
            return sse(completion_chunks(first, prompts, params, body, rid, settings, tok))
        final, entries, prompt_entries = await collect(outputs, params.logprobs is not None)
        choices, comp_t = [], 0
        for (i, j), out in sorted(final.items()):
            text = (tok.decode(prompts[i]) if body.echo else "") + out.text
            lp = None
            if params.logprobs is not None:
                pairs = (list(zip(prompts[i], prompt_entries[i])) if body.echo else []) + entries.get((i, j), [])
                lp = CompletionLogprobs(tok).chunk([t for t, _ in pairs], [e for _, e in pairs])
            choices.append({"index": len(choices), "text": text, "logprobs": lp, "finish_reason": out.finish_reason})
            comp_t += len(out.output_ids)
        heads = [final[(i, 0)] for i in range(len(prompts))]
        return {"id": rid, "object": "text_completion", "created": now(), "model": settings.model_name,
                "system_fingerprint": fingerprint(heads[0]), "choices": choices,
                "usage": usage(sum(h.prompt_tokens for h in heads), comp_t, sum(h.cached_tokens for h in heads),
                               any(o.compressed_hit for o in final.values()))}

    thinking = reasoning.thinks(tok.chat_template)
    warms = thinking and settings.warm_next_turn

    @app.post("/v1/chat/completions", responses=GENERATION)
    async def chat(body: ChatCompletionRequest, request: Request):
        limits.check_request(body, settings)
        plan = await tools.plan(body, tok, settings)
        prompt = limits.chat_prompt(body, tok, settings, tools=plan and plan.tools, recall=recall)
        limits.check_prompt(prompt, settings, tok)
        overtake(body.cache_salt, prompt)
        opened = thinking and reasoning.opens_reasoning(tok.decode(prompt))
        if plan is not None and opened:
            plan = tools.after_reasoning(plan, tok)
        reads_calls = plan is not None and plan.reads_calls
        implicit_end = reads_calls and not plan.reasoned  # a forced call after the reasoning cannot end it
        split = functools.partial(reasoning.Reasoning, opened, implicit_end) if thinking else None
        asked = body.max_completion_tokens or body.max_tokens
        if asked is None:  # chat's default, as vLLM's: the rest of the context (within the operator's limit)
            asked = max(1, min(settings.max_tokens_limit, backend.max_model_len - len(prompt)))
        params = limits.sampling_params(body, asked, settings, 1, tok.vocab_size, limits.guided_json(body, tok),
                                        guided_tools=plan and plan.guided, engine_stops=not reads_calls,
                                        output_resumed=True)  # a chat answer comes back in the next turn's prompt
        _validate(backend, prompt, params)
        rid = _request_id("chatcmpl", request)
        if reads_calls:
            return await _chat_tools(body, plan, prompt, params, rid, settings, tok, split)
        # a thinking template's next turn leaves this prompt early and re-sends the answer without its reasoning
        turn = _Turn(body, prompt, split) if warms and params.n == 1 else None
        if turn is not None and turn.shared is not None:
            params = dataclasses.replace(params, checkpoint_at=(turn.shared,))
        outputs = _start(backend, [prompt], params, settings, body.stream, RouteHint(body.prompt_cache_key))

        def finished(ids: list[list[int]]) -> None:
            _remember(body, prompt, ids)
            if turn is not None:
                turn.warm(ids[0])

        if body.stream:
            return sse(chat_chunks(await first_output(outputs), body, rid, settings, tok, finished, split))
        final, entries, _ = await collect(outputs, params.logprobs is not None)
        outs = [out for _, out in sorted(final.items())]
        finished([o.output_ids for o in outs])
        choices = [{"index": o.index, "message": _message(o.text, split),
                    "logprobs": None if params.logprobs is None else chat_logprobs(tok, *zip(*entries[(0, o.index)])),
                    "finish_reason": o.finish_reason} for o in outs]
        return {"id": rid, "object": "chat.completion", "created": now(), "model": settings.model_name,
                "system_fingerprint": fingerprint(outs[0]), "choices": choices,
                "usage": usage(outs[0].prompt_tokens, sum(len(o.output_ids) for o in outs), outs[0].cached_tokens,
                               any(o.compressed_hit for o in outs))}

    warming: dict[asyncio.Task, tuple[str | None, list[int]]] = {}  # a warm request's task -> (salt, prompt)

    def overtake(salt: str | None, prompt: list[int]) -> None:
        """Cancel the warm requests a new prompt overtakes (it extends theirs): it computes what they would store
        on its own way, and both at once would compute it twice."""
        for task, (their_salt, ids) in list(warming.items()):
            if their_salt == salt and len(prompt) > len(ids) and prompt[: len(ids)] == ids:
                task.cancel()

    class _Turn:
        """A plain chat answer under a thinking template (app/api/resend.py): where the next turn leaves the prompt
        (`shared`), and the warm request that stores the conversation as the next turn re-sends it."""

        def __init__(self, body: ChatCompletionRequest, prompt: list[int], split, tools=None) -> None:
            self.body, self.prompt, self.split, self.tools = body, prompt, split, tools
            self.messages = [m.template_dict() for m in body.messages]
            self.kwargs = limits.template_kwargs(body, tok)
            self.shared = resend.shared_len(tok, prompt, self.messages, self.kwargs, tools)

        def warm(self, output: list[int], message: dict | None = None) -> None:
            """After the answer `output` (as `message` when its calls were parsed; else read from its text)."""
            if message is None:
                ended = bool(output) and output[-1] in tok.stop_token_ids  # the end token is no part of the answer
                message = _message(tok.decode(output[:-1] if ended else output), self.split)
            message = {k: v for k, v in message.items() if k != "reasoning_content"}  # as clients re-send it
            ids = resend.next_prompt(tok, self.prompt, output, self.messages, message, self.kwargs, self.tools,
                                     self.shared)
            if ids is None or len(ids) > backend.max_model_len - 1:
                return
            params = SamplingParams(max_tokens=1, temperature=0.0, cache_salt=self.body.cache_salt, warm=True)
            task = asyncio.get_running_loop().create_task(_drain(_start(
                backend, [ids], params, settings, False, RouteHint(self.body.prompt_cache_key))))
            warming[task] = (self.body.cache_salt, ids)
            task.add_done_callback(lambda t: warming.pop(t, None))

    def _remember(body: ChatCompletionRequest, prompt: list[int], outputs: list[list[int]]) -> None:
        """Keep the answers for the turn that re-sends one of them (app/api/recall.py)."""
        if recall.max_tokens:
            text = tok.decode(prompt)
            for ids in outputs:
                recall.remember(body.cache_salt, text, prompt, ids)

    async def _chat_tools(body, plan, prompt, params, rid, settings, tok, split):
        stops = tuple(body.stop or ()) if not plan.forced else ()
        turn = _Turn(body, prompt, split, plan.tools) if warms and params.n == 1 else None
        if turn is not None and turn.shared is not None:
            params = dataclasses.replace(params, checkpoint_at=(turn.shared,))
        outputs = _start(backend, [prompt], params, settings, True, RouteHint(body.prompt_cache_key))

        def finished(ids: list[list[int]], messages: list[dict]) -> None:
            _remember(body, prompt, ids)
            if turn is not None:
                turn.warm(ids[0], messages[0])

        if body.stream:
            return sse(chat_tool_chunks(await first_output(outputs), body, plan, stops, params, rid, settings, tok,
                                           finished, split))
        choices, head = await tool_answers.collect(aiter(outputs), plan, stops, params.n, tok, split)
        ordered = [c for _, c in sorted(choices.items())]
        finished([c.ids for c in ordered], [c.message() for c in ordered])
        answers = [{"index": j, "message": c.message(), "finish_reason": c.finish_reason,
                    "logprobs": chat_logprobs(tok, *zip(*c.entries)) if params.logprobs is not None else None}
                   for j, c in sorted(choices.items())]
        return {"id": rid, "object": "chat.completion", "created": now(), "model": settings.model_name,
                "system_fingerprint": fingerprint(head), "choices": answers,
                "usage": usage(head.prompt_tokens, sum(len(c.ids) for c in choices.values()), head.cached_tokens,
                               head.compressed_hit)}

    return app


async def _drain(outputs: Outputs) -> None:
    """Run a warm request to its end; what it answers, or how it fails (an overloaded engine refuses it), is dropped."""
    try:
        async for _ in outputs:
            pass
    except Exception as e:  # noqa: BLE001 - a warm request is best effort
        log.debug("warm request dropped: %s", public_reason(e))


def _message(text: str, split) -> dict:
    """A plain chat answer's message: its text as content, or split by a fresh `Reasoning` from `split`."""
    if split is None:
        return {"role": "assistant", "content": text}
    parts = split()
    parts.feed(text, True)
    return {"role": "assistant", **parts.message()}


def _lifespan(backend: Backend):
    """At the server's stop, the backend's `close` (if it has one: an in-process engine stops gracefully)."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        close = getattr(backend, "close", None)
        if close is not None:
            await close()

    return lifespan


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        return error_response(limits.from_validation(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return error_response(ApiError(exc.status_code, str(exc.detail)))


def _documented_errors_only(app: FastAPI) -> None:
    """The OpenAPI schema without FastAPI's 422s (validation errors are 400s here)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = strip_422(build())
        return app.openapi_schema

    app.openapi = openapi


def _request_id(kind: str, request: Request) -> str:
    """The response's id: unique whatever the client sends. The client's X-Request-Id (echoed in the response
    headers by `RequestId`, or by Serve's proxy) is logged beside it, so one finds the other."""
    rid = f"{kind}-{uuid.uuid4().hex}"
    REQUEST_ID.set(rid)  # an error's full detail is logged under it (app/api/errors.py)
    log.info("%s X-Request-Id %s", rid, request.headers.get("x-request-id", "-"))
    return rid


def _validate(backend: Backend, prompt: list[int], params: SamplingParams) -> None:
    try:
        backend.validate(prompt, params)
    except ValueError as e:
        raise ApiError(400, str(e)) from e


def _start(backend: Backend, prompts: list[list[int]], params: SamplingParams, settings: ApiSettings,
           stream: bool, hint: RouteHint | None = None) -> Outputs:
    """Start every prompt's generation; a stream's outputs go through the bounded buffer."""
    deadline = time.time() + settings.queue_timeout_s
    return Outputs([backend.generate(p, params, deadline=deadline, stream=stream, hint=hint) for p in prompts],
                   settings.max_buffered_chunks if stream else None)

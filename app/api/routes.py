"""FastAPI routes of the OpenAI-compatible API, over any `Backend` (the Ray Serve ingress, or a local engine).

Errors are OpenAI-style JSON: 400 for bad input (validation included), 401 for a missing or wrong key,
404 for an unknown model, 413 for an oversized body or prompt, 503 when the backend fails.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.schemas import ChatCompletionRequest, CompletionRequest, error_body, now, usage
from app.engine.request import RequestOutput, SamplingParams
from app.models.tokenizer import Tokenizer


class Backend(Protocol):
    tokenizer: Tokenizer

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request cannot be served (context length, ...)."""

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]: ...

    async def metrics_text(self) -> str: ...

    async def status(self) -> dict: ...


@dataclass(frozen=True)
class ApiSettings:
    model_name: str
    api_key: str | None = None
    max_prompt_tokens: int = 3072
    max_tokens_limit: int = 1024
    default_max_tokens: int = 16
    max_body_bytes: int = 1 << 20


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def build_api(backend: Backend, settings: ApiSettings) -> FastAPI:
    app = FastAPI(title="dasc-serve", version="0.1.0")
    tok = backend.tokenizer

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            if settings.api_key and request.headers.get("authorization") != f"Bearer {settings.api_key}":
                return _error(ApiError(401, "missing or invalid API key", "authentication_error"))
            size = request.headers.get("content-length")
            if size is not None and int(size) > settings.max_body_bytes:
                return _error(ApiError(413, f"request body over {settings.max_body_bytes} bytes"))
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError):
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(ApiError(400, "the request body is not valid JSON"))
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error(ApiError(400, f"{where}: {first.get('msg', 'invalid request')}" if where else
                               first.get("msg", "invalid request"), param=where or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return _error(ApiError(exc.status_code, str(exc.detail), "invalid_request_error"))

    @app.get("/health")
    async def health():  # 200 only when the backend can serve (every engine replica can step)
        try:
            if (check := getattr(backend, "health", None)) is not None:
                await check()
        except Exception as e:  # noqa: BLE001 - any failure means not ready
            return _error(ApiError(503, f"not ready: {e}", "server_error"))
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "dasc-serve"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(await backend.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/status")
    async def status():
        return await backend.status()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        prompts = _completion_prompts(body.prompt, tok)
        params = _params(body, body.max_tokens, settings)
        for p in prompts:
            _check_prompt(p, settings, tok)
            _validate(backend, p, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _sse(_stream_completions(backend, prompts, params, body, rid, settings, tok))
        outs = [await _collect(backend, p, params) for p in prompts]
        choices, prompt_t, comp_t, cached = [], 0, 0, 0
        for i, per_seq in enumerate(outs):
            for out in per_seq:
                text = (tok.decode(prompts[i]) if body.echo else "") + out.text
                choices.append({"index": len(choices), "text": text, "logprobs": None,
                                "finish_reason": out.finish_reason})
                comp_t += len(out.output_ids)
            prompt_t += per_seq[0].prompt_tokens
            cached += per_seq[0].cached_tokens
        return {"id": rid, "object": "text_completion", "created": now(), "model": settings.model_name,
                "system_fingerprint": _fingerprint(outs[0][0]), "choices": choices,
                "usage": usage(prompt_t, comp_t, cached)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        text = tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
        prompt = tok.encode(text)
        _check_prompt(prompt, settings, tok)
        params = _params(body, body.max_completion_tokens or body.max_tokens, settings)
        _validate(backend, prompt, params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _sse(_stream_chat(backend, prompt, params, body, rid, settings))
        outs = await _collect(backend, prompt, params)
        choices = [{"index": o.index, "message": {"role": "assistant", "content": o.text}, "logprobs": None,
                    "finish_reason": o.finish_reason} for o in outs]
        return {"id": rid, "object": "chat.completion", "created": now(), "model": settings.model_name,
                "system_fingerprint": _fingerprint(outs[0]), "choices": choices,
                "usage": usage(outs[0].prompt_tokens, sum(len(o.output_ids) for o in outs), outs[0].cached_tokens)}

    return app


def _fingerprint(out: RequestOutput) -> str:
    """`system_fingerprint` names the engine replica that served the request ("dasc-<replica>")."""
    return f"dasc-{out.replica or 'local'}"


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.param), status_code=exc.status)


def _params(body, max_tokens: int | None, settings: ApiSettings) -> SamplingParams:
    n_tokens = max_tokens or settings.default_max_tokens
    if n_tokens > settings.max_tokens_limit:
        raise ApiError(400, f"max_tokens {n_tokens} is over the limit {settings.max_tokens_limit}", param="max_tokens")
    try:
        return SamplingParams(max_tokens=n_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                              stop=tuple(body.stop or ()), seed=body.seed, n=body.n, ignore_eos=body.ignore_eos)
    except ValueError as e:
        raise ApiError(400, str(e)) from e


def _completion_prompts(prompt, tok: Tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if isinstance(prompt[0], str):
        return [tok.encode(p) for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _check_prompt(ids: list[int], settings: ApiSettings, tok: Tokenizer) -> None:
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if len(ids) > settings.max_prompt_tokens:
        raise ApiError(413, f"prompt has {len(ids)} tokens, over the limit {settings.max_prompt_tokens}",
                       param="prompt")
    if any(not 0 <= t < tok.vocab_size for t in ids):
        raise ApiError(400, f"prompt token ids must be in [0, {tok.vocab_size})", param="prompt")


def _validate(backend: Backend, prompt: list[int], params: SamplingParams) -> None:
    try:
        backend.validate(prompt, params)
    except ValueError as e:
        raise ApiError(400, str(e)) from e


async def _collect(backend: Backend, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    final: dict[int, RequestOutput] = {}
    try:
        async for out in backend.generate(prompt, params):
            if out.finished:
                final[out.index] = out
    except ValueError as e:
        raise ApiError(400, str(e)) from e
    except ApiError:
        raise
    except Exception as e:  # the engine or the cluster failed: say so, do not hang
        raise ApiError(503, f"generation failed: {e}", "server_error") from e
    return [final[i] for i in sorted(final)]


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except ApiError as e:
            yield f"data: {json.dumps(error_body(e.message, e.type))}\n\n"
        except Exception as e:
            yield f"data: {json.dumps(error_body(f'generation failed: {e}', 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def _stream_completions(backend, prompts, params, body, rid, settings, tok) -> AsyncIterator[dict]:
    created, prompt_t, comp_t, cached = now(), 0, 0, 0
    for i, prompt in enumerate(prompts):
        base = i * params.n
        if body.echo:
            for j in range(params.n):
                yield _text_chunk(rid, created, settings, base + j, tok.decode(prompt), None)
        first = True
        async for out in _checked(backend.generate(prompt, params)):
            if first:
                prompt_t, cached, first = prompt_t + out.prompt_tokens, cached + out.cached_tokens, False
            comp_t += len(out.new_token_ids)
            if out.new_text or out.finished:
                yield _text_chunk(rid, created, settings, base + out.index, out.new_text, out.finish_reason)
    if (body.stream_options or {}).get("include_usage"):
        yield {"id": rid, "object": "text_completion", "created": created, "model": settings.model_name,
               "choices": [], "usage": usage(prompt_t, comp_t, cached)}


async def _stream_chat(backend, prompt, params, body, rid, settings) -> AsyncIterator[dict]:
    created, comp_t, started, head = now(), 0, set(), None
    async for out in _checked(backend.generate(prompt, params)):
        head = head or out
        comp_t += len(out.new_token_ids)
        delta = {} if out.index in started else {"role": "assistant"}
        started.add(out.index)
        if out.new_text:
            delta["content"] = out.new_text
        if delta or out.finished:
            yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": settings.model_name,
                   "choices": [{"index": out.index, "delta": delta, "logprobs": None,
                                "finish_reason": out.finish_reason}]}
    if (body.stream_options or {}).get("include_usage") and head is not None:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": settings.model_name,
               "choices": [], "usage": usage(head.prompt_tokens, comp_t, head.cached_tokens)}


async def _checked(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    try:
        async for out in outputs:
            yield out
    except ValueError as e:
        raise ApiError(400, str(e)) from e


def _text_chunk(rid, created, settings, index, text, finish_reason) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": settings.model_name,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


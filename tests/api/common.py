"""Shared pieces of the in-process API tests: an httpx client on the ASGI app, a raw ASGI call (bodies in
chunks, a client that stops reading), SSE parsing, a backend wrapper that records or refuses at the backend
boundary, and a fault that makes a real engine's step fail."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI
from openai import AsyncOpenAI

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def client(app: FastAPI) -> httpx.AsyncClient:
    """An httpx client that calls `app` in this process (no server, no lifespan events: build_api has none)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)


def openai_client(http: httpx.AsyncClient, api_key: str = KEY) -> AsyncOpenAI:
    """The official client over `http` (from `client`)."""
    return AsyncOpenAI(base_url="http://test/v1", api_key=api_key, http_client=http, max_retries=0)


def sse_events(body: str) -> list[dict | str]:
    """The `data:` payloads of an event stream, in order: decoded JSON, or the literal "[DONE]"."""
    events = []
    for block in body.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@dataclass
class RawCall:
    """What a raw ASGI call saw: the response status and headers (once started), the body, and how many request
    chunks the app pulled. Set `disconnect` to make `receive` report the client gone."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    chunks_read: int = 0
    started: asyncio.Event = field(default_factory=asyncio.Event)
    disconnect: asyncio.Event = field(default_factory=asyncio.Event)

    def json(self) -> dict:
        return json.loads(self.body)


async def raw_call(app, call: RawCall, path: str, chunks: Iterable[bytes], headers: dict[str, str] | None = None,
                   stall_body: bool = False) -> RawCall:
    """POST `chunks` as one body in that many ASGI messages (no Content-Length unless `headers` has one).
    `stall_body`: `send` never completes for a non-empty body chunk, as for a client that stops reading."""
    pending = list(chunks)
    hdrs = [(b"content-type", b"application/json"), *((k.lower().encode(), v.encode())
                                                      for k, v in (headers or {}).items())]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": hdrs, "client": ("127.0.0.1", 1), "server": ("test", 80)}

    async def receive():
        if pending:
            call.chunks_read += 1
            body = pending.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(pending)}
        await call.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            call.status = message["status"]
            call.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
            call.started.set()
        elif message["type"] == "http.response.body":
            if stall_body and message.get("body"):
                await asyncio.Event().wait()  # never set
            call.body += message.get("body", b"")

    await app(scope, receive, send)
    return call


async def wait_until(condition, what: str, timeout_s: float = 120.0) -> None:
    """Poll `condition()` until true; fail after a generous `timeout_s` (a hang guard, not a timing check)."""
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        await asyncio.sleep(0.02)


class Recording:
    """A real backend, recording what the routes hand it (`calls`: (prompt ids, params, deadline)), and, when
    `refuse` is set, raising that exception after `refuse_after` outputs of a generation, as an engine or the
    cluster would refuse or fail a request."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self.calls: list[tuple[list[int], object, float | None]] = []
        self.hints: list = []  # each call's RouteHint
        self.refuse: BaseException | None = None
        self.refuse_after = 0

    def __getattr__(self, name):
        return getattr(self._backend, name)

    async def generate(self, prompt_ids, params, *, deadline=None, stream=True, hint=None):
        self.calls.append((list(prompt_ids), params, deadline))
        self.hints.append(hint)
        if self.refuse is not None and self.refuse_after == 0:
            raise self.refuse
        outputs = self._backend.generate(prompt_ids, params, deadline=deadline, stream=stream)
        sent = 0
        try:
            async for out in outputs:
                if self.refuse is not None and sent == self.refuse_after:
                    raise self.refuse
                sent += 1
                yield out
        finally:
            await outputs.aclose()


class StepFault:
    """A forward pre-hook for the model under a real engine: once armed with `after`, it lets `after` more
    forwards run and raises on the next one, as a device error inside an engine step would, then disarms.

    Register it with `model.register_forward_pre_hook(fault)`; the hook runs in the engine's step thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._left: int | None = None

    def arm(self, after: int) -> None:
        with self._lock:
            self._left = after

    def __call__(self, module, args) -> None:
        with self._lock:
            if self._left is None:
                return
            if self._left > 0:
                self._left -= 1
                return
            self._left = None
        raise RuntimeError("injected device fault")


EMPTY_OBJECT = '{"type": "object", "properties": {}, "additionalProperties": false}'


class Scripted:
    """A real backend whose engine writes a script: each request's sampling params get a grammar that forces
    `before`, then `{}` (the one object its schema allows), then `after` and the end token, whatever the request
    asked. The scripted engine of the tool-call parser tests: the zoo models never write a call by themselves."""

    def __init__(self, backend, before: str, after: str = "") -> None:
        from app.engine.tool_grammar import ToolSpec

        self._backend = backend
        self._spec = ToolSpec(functions=(("script", EMPTY_OBJECT),), head="", tail=after, prefix=before).to_json()

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def _script(self, params):
        return dataclasses.replace(params, guided_tools=self._spec, guided_json=None, stop=(), min_tokens=0,
                                   stop_token_ids=(), ignore_eos=False)

    def validate(self, prompt_ids, params) -> None:
        self._backend.validate(prompt_ids, self._script(params))

    def generate(self, prompt_ids, params, **kwargs):
        return self._backend.generate(prompt_ids, self._script(params), **kwargs)

"""Shared pieces of the in-process API tests: an httpx client on the ASGI app, SSE parsing, and a fault that
makes a real engine's step fail."""

from __future__ import annotations

import json
import threading

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

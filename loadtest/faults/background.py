"""A bounded background load for the kill scenarios: `concurrency` clients, each sending one streaming request
after another until stopped (or `max_s`), in a thread with its own event loop. Every request is recorded with
its send time and fate, so a scenario can ask "what happened to requests sent after the kill"."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import httpx


@dataclass
class Record:
    sent: float  # time.monotonic()
    done: float
    status: int  # 0: no answer (connection refused, timeout)
    tokens: int  # text events before the end
    fate: str  # "ok", "rejected" (4xx), "failed_before_token", "failed_after_token"
    error_event: bool  # the stream ended with an OpenAI-style error event


def fate(status: int, tokens: int, done: bool, error_event: bool) -> str:
    """How a request ended: "ok" (a 200 stream to [DONE] without an error event), "rejected" (a 4xx other
    than 429: the request itself), else failed before or after its first token."""
    if status == 200 and done and not error_event:
        return "ok"
    if 400 <= status < 500 and status != 429:
        return "rejected"
    return "failed_after_token" if tokens else "failed_before_token"


class BackgroundLoad:
    def __init__(self, url: str, model: str, concurrency: int, max_s: float, timeout_s: float,
                 max_tokens: int = 32) -> None:
        self.url, self.model, self.concurrency = url, model, concurrency
        self.max_s, self.timeout_s, self.max_tokens = max_s, timeout_s, max_tokens
        self.records: list[Record] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> BackgroundLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 10)

    async def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            async def loop(c: int) -> None:
                i = 0
                while not self._stop.is_set() and time.monotonic() < deadline:
                    self.records.append(await self._one(client, f"load {c} {i}: the history of"))
                    i += 1

            await asyncio.gather(*(loop(c) for c in range(self.concurrency)))

    async def _one(self, client: httpx.AsyncClient, prompt: str) -> Record:
        sent, status, tokens, done, error = time.monotonic(), 0, 0, False, False
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True}
        try:
            async with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                status = r.status_code
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data:"):
                        event = json.loads(line[5:])
                        error = error or "error" in event
                        tokens += bool(event.get("choices") and event["choices"][0].get("text"))
        except (httpx.HTTPError, ValueError):
            pass
        return Record(sent, time.monotonic(), status, tokens, fate(status, tokens, done, error), error)

    def after(self, t: float) -> list[Record]:
        return [r for r in self.records if r.sent >= t]

    def first_ok_after(self, t: float) -> float | None:
        """Seconds from `t` to the end of the first request sent at or after `t` that succeeded."""
        done = [r.done for r in self.after(t) if r.fate == "ok"]
        return min(done) - t if done else None

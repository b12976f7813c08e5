"""What every scenario asks the service over HTTP: replica snapshots (/status), waiting for it to go idle,
greedy outputs to compare before and after a fault, a small steady load, and a stream opened and dropped."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from loadtest.faults.client import RawRequest, encode_request

GREEDY_PROMPTS = ("def fibonacci(n):", "The capital of France is", "import numpy as np\n", "Once upon a time")


async def replicas(client: httpx.AsyncClient, url: str) -> dict[str, dict]:
    """Replica id -> its latest engine snapshot, from /status."""
    r = await client.get(f"{url}/status", timeout=30)
    r.raise_for_status()
    return r.json().get("replicas", {})


def busy(snaps: dict[str, dict]) -> int:
    """Sequences running or waiting over all replicas."""
    return sum(s.get("running", 0) + s.get("waiting", 0) for s in snaps.values())


def settings_of(snaps: dict[str, dict]) -> dict[str, object]:
    """Each replica's cache setting (the `dasc` block: W_max, policy, ...; None when dense)."""
    return {rid: s.get("dasc") for rid, s in sorted(snaps.items())}


async def wait_idle(client: httpx.AsyncClient, url: str, within_s: float) -> tuple[bool, float, dict]:
    """Poll /status until no replica runs or queues a sequence; -> (idle, seconds waited, last snapshots).
    Behind Ray, a replica's snapshot is as old as its last telemetry window (`reported_at`): one reported
    before this call began does not count."""
    t0, since = time.monotonic(), time.time()
    snaps: dict = {}
    while time.monotonic() - t0 < within_s:
        try:
            snaps = await replicas(client, url)
            fresh = all(s.get("reported_at", since) >= since for s in snaps.values())
            if snaps and fresh and not busy(snaps):
                return True, time.monotonic() - t0, snaps
        except (httpx.HTTPError, ValueError):
            pass
        await asyncio.sleep(0.5)
    return False, time.monotonic() - t0, snaps


async def greedy(client: httpx.AsyncClient, url: str, model: str, max_tokens: int = 16) -> list[str]:
    """Temperature-0 continuations of GREEDY_PROMPTS (a fixed cache setting must give the same ones)."""
    texts = []
    for p in GREEDY_PROMPTS:
        r = await client.post(f"{url}/v1/completions", timeout=120,
                              json={"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0})
        texts.append(r.json()["choices"][0]["text"] if r.status_code == 200 else f"<{r.status_code}>")
    return texts


def stream_body(model: str, rng: random.Random, max_tokens: int = 256) -> bytes:
    """A streaming request that would run long: ignore_eos, sampled or greedy, one or two sequences."""
    prompt = f"{rng.choice(GREEDY_PROMPTS)} {rng.randint(0, 10**6)}"
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": rng.choice((0.0, 1.0)), "n": rng.choice((1, 1, 2))}
    if rng.random() < 0.3:
        body = {k: v for k, v in body.items() if k != "prompt"} | {"messages": [{"role": "user", "content": prompt}]}
    return json.dumps(body).encode()


async def dropped_stream(url: str, body: bytes, when: str, timeout_s: float) -> dict:
    """Open a stream and drop the connection (a reset, as a killed client does) at `when`: "sent" (right after
    the request), "headers" (after the answer's head), "token" (after the first event), "tokens" (after a
    few events), "timeout" (a client giving up after 0.2 s). -> what was seen before the drop."""
    host, port = url.split("//", 1)[1].split(":")
    path = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
    req = RawRequest("stream", path, body)
    seen = {"status": 0, "events": 0}
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(encode_request(req, f"{host}:{port}"))
            await writer.drain()
            if when == "timeout":
                await asyncio.wait_for(reader.read(-1), 0.2)
            if when in ("headers", "token", "tokens"):
                head = await reader.readuntil(b"\r\n\r\n")
                seen["status"] = int(head.split()[1])
            want = {"token": 1, "tokens": 4}.get(when, 0)
            while seen["events"] < want and (line := await reader.readline()):
                seen["events"] += line.startswith(b"data:")
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
        pass
    finally:
        if writer is not None:
            writer.transport.abort()
    return seen

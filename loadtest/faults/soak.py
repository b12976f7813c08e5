"""The soak: a steady mixed load (completions, chat, full streams, dropped streams, shared prefixes) for
`duration_s`, with each replica's RSS sampled every `sample_s`. Growth is measured from the first sample after
`warmup_s` (caches, allocator pools and compiled code settle in the first minute) to the last one."""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from loadtest.faults.client import Outcome, rss_bytes, tally
from loadtest.faults.service import dropped_stream, stream_body
from loadtest.serve_harness import prefix_prompts

KINDS = ("completion", "chat", "stream", "drop", "prefix")
MAX_GROWTH = 0.10


def growth(samples: list[tuple[float, dict[str, int]]], warmup_s: float) -> dict[str, float | None]:
    """Per process: RSS at the last sample over RSS at the first sample taken at or after `warmup_s`, minus 1
    (None for a process missing from either: it was replaced, which is a failure of its own)."""
    later = [s for t, s in samples if t >= warmup_s]
    if len(later) < 2:
        return {}
    first, last = later[0], later[-1]
    return {k: (last[k] / first[k] - 1 if k in last and first[k] else None) for k in first}


async def _client(client, target, rng: random.Random, deadline: float, kinds: list, prompts: list[str]) -> None:
    i = rng.randrange(len(KINDS))
    while time.monotonic() < deadline:
        kind, i = KINDS[i % len(KINDS)], i + 1
        n = rng.randint(4, 24)
        try:
            if kind == "drop":
                await dropped_stream(target.url, stream_body(target.model, rng, 64), "token", 30)
                kinds.append("dropped")
                continue
            if kind == "chat":
                messages = [{"role": "user", "content": rng.choice(prompts)}]
                r = await client.post(f"{target.url}/v1/chat/completions",
                                      json={"model": target.model, "max_tokens": n, "messages": messages})
            else:
                body = {"model": target.model, "max_tokens": n, "stream": kind == "stream",
                        "prompt": rng.choice(prompts) if kind == "prefix" else f"soak {rng.randint(0, 10**6)}"}
                r = await client.post(f"{target.url}/v1/completions", json=body)
            kinds.append(str(r.status_code))
        except httpx.HTTPError as exc:
            kinds.append(type(exc).__name__)


async def _soak(target, o) -> tuple[list, list]:
    pids = _pids(target)
    prompts = prefix_prompts(8, 8, seed=7, header_lines=20)
    kinds, samples = [], []
    t0 = time.monotonic()
    deadline = t0 + o.duration_s
    async with httpx.AsyncClient(timeout=60) as client:
        clients = [asyncio.create_task(_client(client, target, random.Random(c), deadline, kinds, prompts))
                   for c in range(o.concurrency)]
        while time.monotonic() < deadline:
            samples.append((time.monotonic() - t0, _rss(_pids(target) if target.cluster else pids)))
            await asyncio.sleep(min(o.sample_s, max(0.0, deadline - time.monotonic())))
        await asyncio.gather(*clients)
        samples.append((time.monotonic() - t0, _rss(_pids(target) if target.cluster else pids)))
    return kinds, samples


def _pids(target) -> dict[str, int]:
    if target.cluster is not None:
        return target.cluster.replica_pids()
    return {"local": target.pid} if target.pid else {}


def _rss(pids: dict[str, int]) -> dict[str, int]:
    out = {}
    for name, pid in pids.items():
        try:
            out[name] = rss_bytes(pid)
        except (OSError, ValueError):
            pass
    return out


def run(target, o) -> Outcome:
    out = Outcome()
    kinds, samples = asyncio.run(_soak(target, o))
    counts = tally(kinds)
    grew = growth(samples, o.warmup_s)
    mb = {name: [round(s[name] / 2**20) for _, s in samples if name in s] for name in samples[0][1]} if samples else {}
    out.figures = {"duration_s": o.duration_s, "warmup_s": o.warmup_s, "requests": len(kinds), "by_answer": counts,
                   "rss_growth": {k: None if v is None else round(v, 4) for k, v in grew.items()},
                   "rss_mb_samples": mb}
    engines = {k: v for k, v in grew.items() if "Ingress" not in k}
    out.check("replica RSS growth after warm-up", engines and all(v is not None and v < MAX_GROWTH
                                                                  for v in engines.values()),
              f"< {MAX_GROWTH:.0%} per replica", engines or "no replica process to measure (give --pid)")
    failed = {k: v for k, v in counts.items() if k not in ("200", "dropped")}
    out.check("no failed request", not failed, "every request 200 (dropped streams aside)", failed or 0)
    return out

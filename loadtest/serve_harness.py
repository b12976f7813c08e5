"""Shared by the serving benchmarks: start a local Ray Serve app from `build_app` args, drive a prefix-reuse
workload over HTTP with bounded concurrency, and summarise replay metrics."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import statistics
import time
from contextlib import contextmanager

import httpx

from loadtest.common import wait_compiled


def free_port(outside_ephemeral: bool = False) -> int:
    """A port free on loopback now. outside_ephemeral: one from 20000-32767, below the kernel's ephemeral range and
    above Ray's worker ports, for a server that binds it after Ray has started processes, which take ephemeral
    ports of their own (one of them may be the port handed out here otherwise)."""
    if outside_ephemeral:
        rng = random.Random()
        for _ in range(200):
            port = rng.randint(20000, 32767)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def cluster(num_cpus: int = 4):
    """Yields the base URL of a fresh local Ray cluster with Serve listening on loopback; tears it down."""
    import ray
    from ray import serve

    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)  # never a stale one
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def deployed(url: str, args: dict):
    """`build_app(args)` served at `url` (a `cluster`) until the block ends; then deleted with its controller. With
    compiled packages asked for, it yields once they are in force (a first start builds them in the background)."""
    import ray
    from ray import serve

    from deployments import controller as controller_mod
    from deployments.builder import build_app

    serve.run(build_app(args), name="dasc", route_prefix="/")
    try:
        deadline = time.time() + 120
        while httpx.get(f"{url}/health", timeout=5).status_code != 200 and time.time() < deadline:
            time.sleep(0.5)
        engine = args.get("engine") or {}
        if engine.get("compile_decode") or engine.get("compile_prefill"):
            wait_compiled(url, 1800)
        yield url
    finally:
        serve.delete("dasc")
        try:
            ray.kill(controller_mod.lookup(), no_restart=True)
        except ValueError:
            pass


@contextmanager
def serve_app(args: dict, num_cpus: int = 4):
    """Yields the base URL of a fresh local cluster serving `build_app(args)`; tears everything down."""
    with cluster(num_cpus) as url, deployed(url, args):
        yield url


def prefix_prompts(groups: int, per_group: int, seed: int, header_lines: int = 40,
                   tail_seed: int | None = None) -> list[str]:
    """`groups` long shared headers (drawn from `seed`), each followed by `per_group` different short tails
    (drawn from `tail_seed`, default `seed`), shuffled. A new `tail_seed` gives new queries on the same headers."""
    headers_rng = random.Random(seed)
    rng = random.Random(seed if tail_seed is None else tail_seed + 1_000_003)
    prompts = []
    for g in range(groups):
        header = "\n".join(f"field_{g}_{i} = {headers_rng.randint(0, 9999)}" for i in range(header_lines))
        prompts += [f"{header}\nquery_{j} = {rng.randint(0, 99)}" for j in range(per_group)]
    rng.shuffle(prompts)
    return prompts


async def _drive(url: str, prompts: list[str], concurrency: int, model: str) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(p: str) -> dict:
            async with sem:
                t0 = time.perf_counter()
                r = await client.post(f"{url}/v1/completions", json={"model": model, "prompt": p, "max_tokens": 1,
                                                                     "temperature": 0})
                dt = time.perf_counter() - t0
                body = r.json()
                if r.status_code != 200:
                    return {"ok": False, "latency_s": dt, "error": body}
                u = body["usage"]
                return {"ok": True, "latency_s": dt, "prompt_tokens": u["prompt_tokens"],
                        "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                        "replica": body.get("system_fingerprint")}

        return await asyncio.gather(*(one(p) for p in prompts))


def drive(url: str, prompts: list[str], concurrency: int = 4, model: str = "kda-tiny") -> list[dict]:
    return asyncio.run(_drive(url, prompts, concurrency, model))


def summarise(results: list[dict], wall_s: float | None = None) -> dict:
    ok = [r for r in results if r["ok"]]
    lat = sorted(r["latency_s"] for r in ok)
    per_replica: dict[str, int] = {}
    for r in ok:
        per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    prompt = sum(r["prompt_tokens"] for r in ok)
    out = {"requests": len(results), "failed": len(results) - len(ok),
           "hit_rate": sum(r["cached_tokens"] for r in ok) / prompt if prompt else 0.0,
           "ttft_mean_ms": statistics.fmean(lat) * 1e3 if lat else None,
           "ttft_p90_ms": lat[int(0.9 * (len(lat) - 1))] * 1e3 if lat else None,
           "requests_per_replica": sorted(per_replica.values(), reverse=True)}
    if wall_s:
        out["input_tok_s"] = prompt / wall_s
    return out

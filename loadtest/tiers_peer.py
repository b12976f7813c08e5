"""bench_tiers' peer section (`python -m loadtest.bench_tiers --section peer`, issue 40): checkpoints fetched from
the replica that holds them, on the two-node Ray setup of `make reliability` (`ray start --head` and a second node
on loopback, the serve config deployed with replicas reserving a whole CPU, so that Serve spreads them and objects
move between nodes). One deployment per arm: dense and dasc nr-W16, each with peer fetches and without.

- One request, fetch against recompute: per prompt length (--peer-lengths) and repeat, a fresh prompt is warmed
  on replica A (the holder), then asked on replica B (pinned with `GenerateRequest.route_to`) with a fetch from A,
  and another fresh prompt of the same length asked on B cold. TTFT is the handle call's time to its first output;
  bytes are what B's fetcher counted (read live, `peer_fetch_status`).
- Hot prefix: one --hot-tokens prefix warmed on one replica, then --hot-requests concurrent requests over HTTP,
  each the prefix and its own --hot-suffix-token question (the router decides); mean and p90 TTFT, with peer
  fetches on and off; --repeats bursts, each on a fresh prefix, reported as medians (fetch counters: the
  replicas' totals after the last burst, the one-request trials included).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import httpx

from app.engine.request import SamplingParams
from app.models.loader import resolve_model_dir
from app.models.tokenizer import Tokenizer
from loadtest.faults.cluster import two_nodes
from loadtest.faults.peer import fetch_counters
from loadtest.workloads import text_block

ARMS = {"dense/fetch": {"peer_fetch": True}, "dasc nr-W16/fetch": {"peer_fetch": True, "w_max": 16.0,
                                                                      "policy": "nr"},
        "dense/no fetch": {"peer_fetch": False},
        "dasc nr-W16/no fetch": {"peer_fetch": False, "w_max": 16.0, "policy": "nr"}}
ENGINE = {"checkpoint_budget_mb": 64, "compile_decode": False, "compile_prefill": False, "max_running": 32}
ONE = SamplingParams(max_tokens=1, temperature=0.0)


def run(args) -> dict:
    tok = Tokenizer.from_dir(resolve_model_dir(args.model))
    out = {}
    for arm, knobs in ARMS.items():
        overrides = {"replicas": 2, "engine": {**ENGINE, **knobs}, "controller": {"enabled": False, "window_s": 0.5},
                     "router": {"stats_period_s": 0.5}, "api": {"max_prompt_tokens": 8192}}
        with two_nodes(args.config, overrides, args.model) as target:
            out[arm] = asyncio.run(_arm(target, tok, args, one=knobs["peer_fetch"]))
        print(arm, {k: v for k, v in out[arm].items() if k != "trials"}, flush=True)
    return out


async def _arm(target, tok: Tokenizer, args, one: bool) -> dict:
    from ray import serve

    handle = serve.get_deployment_handle("EngineReplica", "dasc").options(stream=True)
    actors = target.cluster.actors("EngineReplica")
    ids = [a["Name"].rsplit("#", 1)[-1] for a in actors]
    nodes = len({a.get("Address", {}).get("NodeID") for a in actors})
    res: dict = {"nodes": nodes, "trials": []}
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(timeout=300) as client:
        if one:
            holder, fetcher = ids[0], ids[1]
            for length in args.peer_lengths:
                for _ in range(args.repeats):
                    warm, cold = _prompt(tok, rng, length), _prompt(tok, rng, length)
                    await _ttft(handle, warm, holder)
                    await asyncio.sleep(1.0)  # the holder's routing stats show it (not needed for a pinned fetch)
                    before = await _fetched(fetcher)
                    t_fetch, cached = await _ttft(handle, warm, fetcher, fetch=holder)
                    t_cold, _ = await _ttft(handle, cold, fetcher)
                    moved = await _fetched(fetcher)
                    res["trials"].append({"tokens": length, "fetch_s": t_fetch, "recompute_s": t_cold,
                                          "cached": cached, "bytes": moved - before})
        bursts = [await _hot(client, target.url, target.model, tok, rng, args) for _ in range(args.repeats)]
        res["hot"] = {k: statistics.median(b[k] for b in bursts) for k in ("ttft_mean_s", "ttft_p90_s",
                                                                         "replicas_used", "cached_mean")}
        res["hot"]["fetches"], res["hot_bursts"] = bursts[-1]["fetches"], bursts
    return res


def _prompt(tok: Tokenizer, rng: random.Random, n: int) -> list[int]:
    return tok.encode(text_block(rng, f"peer{rng.random()}", n // 4))[:n]


async def _ttft(handle, prompt: list[int], replica: str, fetch: str | None = None) -> tuple[float, int]:
    """(seconds to the first output, its cached tokens) of one request pinned to `replica`."""
    from deployments.messages import GenerateRequest

    req = GenerateRequest(prompt, ONE, route_to=replica, fetch={replica: (fetch, 0)} if fetch else None)
    start = time.perf_counter()
    async for wired in handle.generate.remote(req):
        return time.perf_counter() - start, int(wired.get("cached_tokens", 0))
    raise RuntimeError("no output")


async def _fetched(replica: str) -> int:
    """The bytes `replica`'s fetcher has fetched so far, read live from it (`EngineReplica.peer_fetch_status`)."""
    from ray import serve

    from deployments.messages import FetchStatusRequest

    handle = serve.get_deployment_handle("EngineReplica", "dasc")
    status = await handle.peer_fetch_status.remote(FetchStatusRequest(route_to=replica))
    if status["replica"] != replica:
        raise RuntimeError(f"replica {replica} is gone")
    return status["fetched_bytes"]


async def _hot(client: httpx.AsyncClient, url: str, model: str, tok: Tokenizer, rng: random.Random, args) -> dict:
    prefix = tok.decode(_prompt(tok, rng, args.hot_tokens))
    questions = [prefix + "\n" + tok.decode(_prompt(tok, rng, args.hot_suffix_tokens))
                 for _ in range(args.hot_requests)]
    body = {"model": model, "max_tokens": 1, "temperature": 0}
    r = await client.post(f"{url}/v1/completions", json={**body, "prompt": prefix})
    r.raise_for_status()
    await asyncio.sleep(1.5)  # routing stats publish the prefix's checkpoint

    async def one(q: str) -> tuple[float, int, str]:
        start = time.perf_counter()
        r = await client.post(f"{url}/v1/completions", json={**body, "prompt": q})
        r.raise_for_status()
        j = r.json()
        return time.perf_counter() - start, j["usage"]["prompt_tokens_details"]["cached_tokens"], \
            j["system_fingerprint"]

    got = await asyncio.gather(*(one(q) for q in questions))
    ttfts = sorted(t for t, _, _ in got)
    await asyncio.sleep(1.5)  # the replicas report their fetch counters
    fetches = await fetch_counters(client, url)
    return {"ttft_mean_s": statistics.fmean(ttfts), "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "replicas_used": len({f for _, _, f in got}), "cached_mean": statistics.fmean(c for _, c, _ in got),
            "fetches": fetches}

"""bench_tiers `--section stops`: what a stop of `python -m app.api.local` with a disk tier keeps for the next start.

Each arm runs the server as a user does (a process of its own on loopback, compile knobs off so that every TTFT is
the same eager engine's), on a fresh disk directory, with the probe of issue 49: a 0.4 MB checkpoint pool, a 64 MB
host tier, --stop-prompts distinct prompts of about --stop-tokens tokens. Each prompt is served once cold; then
the server stops and a new one starts on the same directory, and each prompt is served again:
- SIGINT: a graceful stop (the server persists what its pools and host tier hold);
- SIGKILL: a crash, once the write-behind queue has drained; before it, --stop-reused of the prompts were served a
  second time (a reuse: written behind at once), the rest once only;
- SIGKILL, no reuse writes (`disk_reuse_mb_s` 0): the same crash as the server wrote before this (only what the
  tiers evicted);
- no disk: SIGINT without a disk tier.
Reported per arm as medians over --seeds: the share of prompts that resumed (cached >= prompt - 64 tokens, less the
dasc recompute tail of 4 W_max; of the reused and of the others apart after a crash) and the mean TTFT after the
restart over the cold one, per codec.
"""

from __future__ import annotations

import math
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

from loadtest.common import table
from loadtest.local_server import local_server

ARMS = ("SIGINT", "SIGKILL", "SIGKILL, no reuse writes", "no disk")
CODECS = {"dense": {}, "dasc nr-W16": {"w_max": 16.0, "policy": "nr"}}
PROBE = {"compile_decode": False, "compile_prefill": False, "checkpoint_budget_mb": 0.4, "host_mb": 64}


def _prompts(seed: int, n: int, tokens: int) -> list[str]:
    rng = random.Random(seed)
    return ["\n".join(f"k{seed}_{i}_{j} = {rng.randint(0, 99999)}" for j in range(tokens // 8)) for i in range(n)]


def _ask(url: str, prompt: str) -> tuple[float, int, int]:
    """(TTFT s, cached tokens, prompt tokens) of a streamed one-token completion."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    t0 = time.perf_counter()
    ttft, usage = None, None
    for chunk in client.completions.create(model="kda-tiny", prompt=prompt, max_tokens=1, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        ttft = ttft or time.perf_counter() - t0
        usage = chunk.usage or usage
    return ttft, usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens


def _drained(url: str, timeout_s: float = 300.0) -> None:
    import httpx

    end = time.monotonic() + timeout_s
    while (httpx.get(f"{url}/status", timeout=30).json()["replicas"]["local"]["disk_tier"] or {}).get("queued"):
        if time.monotonic() > end:
            raise TimeoutError("the write-behind queue did not drain")
        time.sleep(0.2)


def run_arm(arm: str, codec: dict, prompts: list[str], reused: int, tmp: Path) -> dict:
    engine = {**PROBE, **codec, **({} if arm == "no disk" else {"disk_dir": str(tmp / "tier")}),
              **({"disk_reuse_mb_s": 0.0} if arm.endswith("no reuse writes") else {})}
    stop = signal.SIGINT if arm in ("SIGINT", "no disk") else signal.SIGKILL
    with local_server(engine, tmp, stop=stop) as url:
        cold = [_ask(url, p) for p in prompts]
        if stop == signal.SIGKILL:
            for p in prompts[:reused]:
                _ask(url, p)
            if "disk_dir" in engine:
                _drained(url)
    with local_server(engine, tmp) as url:
        warm = [_ask(url, p) for p in prompts]
    tail = math.ceil(4.0 * codec.get("w_max", 0.0))  # a dasc nr hit resumes this far short of its checkpoint cut
    resumed = [cached >= n - 64 - tail for _, cached, n in warm]
    out = {"resumed": sum(resumed) / len(resumed),
           "ttft_ratio": statistics.mean(t for t, _, _ in warm) / statistics.mean(t for t, _, _ in cold),
           "cold_ttft_ms": 1e3 * statistics.mean(t for t, _, _ in cold),
           "warm_ttft_ms": 1e3 * statistics.mean(t for t, _, _ in warm)}
    if stop == signal.SIGKILL:
        out |= {"resumed_reused": sum(resumed[:reused]) / reused,
                "resumed_once": sum(resumed[reused:]) / max(1, len(resumed) - reused)}
    return out


def run(args, say=print) -> dict:
    seeds = {}
    for seed in args.seeds:
        prompts = _prompts(seed, args.stop_prompts, args.stop_tokens)
        seeds[seed] = {}
        for name, codec in CODECS.items():
            for arm in ARMS:
                with tempfile.TemporaryDirectory(prefix="dasc-stops-") as tmp:
                    r = run_arm(arm, codec, prompts, args.stop_reused, Path(tmp))
                seeds[seed][f"{name}/{arm}"] = r
                say(f"seed {seed} {name} {arm}: {r}")
    return {"seeds": seeds}


def report(results: dict) -> str:
    seeds = list(results["seeds"].values())
    rows = []
    for key in seeds[0]:
        med = {k: statistics.median(s[key][k] for s in seeds) for k in seeds[0][key]}
        rows.append([key, med["resumed"], med.get("resumed_reused", "-"), med.get("resumed_once", "-"),
                     med["cold_ttft_ms"], med["warm_ttft_ms"], med["ttft_ratio"]])
    return table(["codec/stop", "resumed", "reused resumed", "others resumed", "cold TTFT ms", "restart TTFT ms",
                  "restart / cold TTFT"], rows) + "\n"

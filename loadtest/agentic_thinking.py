"""bench_agentic --thinking: the agents of loadtest/workloads.py under Qwen3.5's thinking chat template, with the
next-turn checkpoints of app/api/resend.py on (`api.warm_next_turn`, the default) and off.

The model is kda-tiny under the synthetic Qwen3.5 tokenizer (loadtest/family_checkpoints.py: the zoo's weights,
Qwen3.5's template and added tokens, written under ~/.cache/dasc-serve/family/). The generation prompt opens
`<think>`, and kda-tiny never closes it: every answer is reasoning up to its max_tokens, no call and no content,
which is what an agent then re-sends (an empty answer: the history form drops the reasoning). Each continuation's
prompt shares the previous prompt up to `<|im_start|>assistant\\n` and then re-sends the answer, so neither the
previous prompt-end nor its generation-end checkpoint is on its path. Reported per setting, medians over seeds: the
prompt tokens each continuation computed (prompt less cached), the hit rate of continuations, their mean TTFT, and
the warm requests the server sent (and the tokens they computed, off the continuations' path).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import httpx

from loadtest.family_checkpoints import write_family_checkpoint
from loadtest.peer import llama
from loadtest.serve_harness import deployed
from loadtest.workloads import agentic

SETTINGS = {"warm next turn": True, "off": False}


def model_dir() -> Path:
    """kda-tiny under Qwen3.5's chat format, written once."""
    out = llama.cache_root() / "family" / "kda-tiny-qwen3_5"
    if not (out / "config.json").exists():
        write_family_checkpoint("qwen3_5", out)
    return out


def _warm(url: str) -> tuple[int, int]:
    replicas = httpx.get(f"{url}/status", timeout=30).json()["replicas"].values()
    return sum(r.get("warm_requests", 0) for r in replicas), sum(r.get("warm_tokens", 0) for r in replicas)


def run(url: str, app_args: dict, args) -> dict:
    """Every seed under each setting, each on a fresh deployment, the settings' order alternating with the seed (a
    first deployment and a second one on this machine differ by more than the settings do)."""
    model = str(model_dir())
    out: dict = {label: [] for label in SETTINGS}
    for seed in args.seeds:
        for label, on in (list(SETTINGS.items()) if seed % 2 else list(SETTINGS.items())[::-1]):
            cfg = {**app_args, "model": model, "api": {**app_args.get("api", {}), "warm_next_turn": on}}
            with deployed(url, cfg):
                agentic(url, model, 0, 4, (1, 1), cold=True)  # warm-up: grammar import, tool schemas compiled
                before = _warm(url)
                res = agentic(url, model, seed, args.agents, tuple(args.turns), args.answer_tokens)
                after = _warm(url)
            later = [r for r in res if r["ok"] and r.get("previous") is not None]
            out[label].append({
                "seed": seed, "requests": len(res), "failed": sum(not r["ok"] for r in res),
                "computed": statistics.fmean(r["prompt_tokens"] - r["cached_tokens"] for r in later),
                "hit_rate": sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later),
                "ttft_ms": statistics.fmean(r["latency_s"] for r in later) * 1e3,
                "warm_requests": after[0] - before[0], "warm_tokens": after[1] - before[1]})
            print(label, out[label][-1], flush=True)
    return out


def markdown(res: dict, seeds) -> str:
    med = {label: {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "seed"}
           for label, rows in res.items()}
    lines = ["| setting | requests | failed | prompt tokens computed per continuation | continuations' hit rate | "
             "continuations' mean TTFT ms | warm requests | tokens they computed |",
             "|---|---|---|---|---|---|---|---|"]
    for label, m in med.items():
        lines.append(f"| {label} | {m['requests']:.0f} | {m['failed']:.0f} | {m['computed']:.1f} | "
                     f"{m['hit_rate']:.3f} | {m['ttft_ms']:.1f} | {m['warm_requests']:.0f} | {m['warm_tokens']:.0f} |")
    on, off = med["warm next turn"], med["off"]
    ratio = statistics.median(a["ttft_ms"] / b["ttft_ms"] for a, b in zip(res["warm next turn"], res["off"]))
    return ("\n".join(lines) + f"\n\nMedians over seeds {', '.join(map(str, seeds))} (the settings' order "
            f"alternating with the seed). With the next-turn checkpoints "
            f"each continuation computed {on['computed']:.1f} prompt tokens against {off['computed']:.1f} without "
            f"({on['computed'] / off['computed']:.2f}x), mean TTFT {on['ttft_ms']:.1f} ms against "
            f"{off['ttft_ms']:.1f} ms (per-seed ratio {ratio:.2f}x).\n")

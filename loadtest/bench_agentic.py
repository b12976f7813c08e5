"""Agentic benchmark: `python -m loadtest.bench_agentic [--out docs/benchmarks.md]` (about 7 minutes on 2 cores).

Agents (loadtest/workloads.py, agentic) on kda-tiny behind our prefix-aware router at 2 replicas (dense
checkpoints, controller off): one shared system prompt of about 800 tokens with six tool schemas, each agent 4-6
turns of a tool call (`tool_choice` required or auto), its result (100-300 tokens) and an answer, the whole history
re-sent over Chat Completions every time. Each seed runs warm (the agents share a `cache_salt`) and the same agents
over the Responses API (loadtest/agent_responses.py: only the new items, with `previous_response_id`; a salt of
their own, so they start as cold as the warm chat run), in an order that alternates with the seed (odd: Responses
first; the default seeds run each order twice), then cold (every request its own salt: nothing reused), on the
same deployment, after a warm-up that has each replica import the grammar library and compile the tools' schemas.

Reported per seed and as medians: the share of requests after each agent's first whose cached tokens reach the
previous request's prompt and output less one token (a request the router sent to another replica than its previous
one counts as a miss, as its cache there is cold), over Chat Completions and over Responses, the mean TTFT by step
of the agent loop warm and cold and their ratio, Responses' mean TTFT against warm chat's (also by which API ran
first), the response store's mean get and put time (/metrics: `dasc_response_store_seconds`), and the
re-tokenization drift: of the re-sent answers whose prompt resumed from the ids generated (the API's recall
memory), those whose plain re-encoding would have differed, and the tokens that would have cost. Results:
loadtest/results/bench_agentic_cpu.json; --out DOC replaces the block in DOC. `--thinking` runs only the agents
under Qwen3.5's thinking template, with the next-turn checkpoints on and off (loadtest/agentic_thinking.py).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict

import httpx

from loadtest import agentic_thinking
from loadtest.agent_responses import agentic_responses
from loadtest.common import start_run, table
from loadtest.sections import knob_variant, publish
from loadtest.serve_harness import cluster, deployed, summarise
from loadtest.workloads import agentic, resumed


def app_args(args) -> dict:
    return {"model": args.model, "replicas": args.replicas, "replica_cpus": 0.5,
            "engine": {**(args.engine or {}), "checkpoint_budget_mb": args.budget_mb},
            "router": {"kind": "prefix", "stats_period_s": 1.0}, "controller": {"enabled": False}}


def by_step(results: list[dict]) -> dict[int, float]:
    steps = defaultdict(list)
    for r in results:
        if r["ok"]:
            steps[r["step"]].append(r["latency_s"] * 1e3)
    return {s: statistics.fmean(v) for s, v in sorted(steps.items())}


def recall_stats(url: str) -> dict:
    return httpx.get(f"{url}/status", timeout=30).json()["recall"]


def store_totals(url: str) -> dict[str, tuple[float, float]]:
    """The response store's timed operations so far, from /metrics: op -> (seconds, count)."""
    out: dict[str, list[float]] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        m = re.match(r'dasc_response_store_seconds_(sum|count)\{op="(\w+)"\} ([0-9.e+-]+)', line)
        if m:
            out.setdefault(m[2], [0.0, 0.0])[m[1] == "count"] = float(m[3])
    return {op: (v[0], v[1]) for op, v in out.items()}


def store_ms(before: dict, after: dict) -> dict[str, float]:
    """Mean milliseconds per store operation between two `store_totals`."""
    out = {}
    for op, (total, n) in after.items():
        t0, n0 = before.get(op, (0.0, 0.0))
        if n > n0:
            out[op] = (total - t0) / (n - n0) * 1e3
    return out


def continuations_ms(results: list[dict]) -> float:
    """Mean TTFT of the requests after each agent's first (those that resume), in ms."""
    return statistics.fmean(r["latency_s"] * 1e3 for r in results if r["ok"] and r.get("previous") is not None)


def run_seed(url: str, seed: int, args) -> dict:
    timed = {}

    def over_responses():
        before = store_totals(url)
        out = agentic_responses(url, args.model, seed, args.agents, tuple(args.turns), args.answer_tokens,
                                salt=f"responses-{seed}")
        timed.update(store_ms(before, store_totals(url)))
        return out

    responses = over_responses() if seed % 2 else None  # which API goes first alternates with the seed
    before = recall_stats(url)
    warm = agentic(url, args.model, seed, args.agents, tuple(args.turns), args.answer_tokens)
    after = recall_stats(url)
    responses = responses or over_responses()
    cold = agentic(url, args.model, seed, args.agents, tuple(args.turns), args.answer_tokens, cold=True)
    drift = {k: after[k] - before[k] for k in after}
    row = {"seed": seed, "requests": len(warm), "failed": sum(not r["ok"] for r in warm + cold + responses),
           "resumed": resumed(warm, args.nr_tail), "warm": summarise(warm), "cold": summarise(cold),
           "responses_requests": len(responses), "responses_resumed": resumed(responses, args.nr_tail),
           "responses": summarise(responses), "ttft_by_step_responses_ms": by_step(responses),
           "continuations_ms": {"chat": continuations_ms(warm), "responses": continuations_ms(responses)},
           "store_ms": timed,
           "ttft_by_step_warm_ms": by_step(warm), "ttft_by_step_cold_ms": by_step(cold),
           "spliced": drift["spliced"], "drifted": drift["drifted"], "drift_tokens": drift["drift_tokens"]}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kda-tiny")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])  # both API orders, twice each
    p.add_argument("--agents", type=int, default=12)
    p.add_argument("--turns", type=int, nargs=2, default=[4, 6])
    p.add_argument("--answer-tokens", type=int, default=12)
    p.add_argument("--budget-mb", type=float, default=8.0, help="checkpoint pool per replica")
    p.add_argument("--nr-tail", type=int, default=0, help="tokens before a checkpoint an nr load may not serve")
    p.add_argument("--engine", type=json.loads, default=None, metavar="JSON", help="engine knobs (own variant)")
    p.add_argument("--thinking", action="store_true", help="only the thinking-template run: kda-tiny under Qwen3.5's "
                   "template, next-turn checkpoints on and off (loadtest/agentic_thinking.py)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    record = start_run("bench_agentic", {k: v for k, v in vars(args).items() if k != "out"}, argv)
    if args.thinking:
        with cluster(num_cpus=4) as url:
            res = agentic_thinking.run(url, app_args(args), args)
        publish(record, f"{args.model}/thinking", res, agentic_thinking.markdown(res, args.seeds), args.out,
                "Agentic: every turn resumes where the last ended", "Thinking turns: the history as re-sent")
        return
    with cluster(num_cpus=4) as url, deployed(url, app_args(args)):
        agentic(url, args.model, 0, 4, (1, 1), cold=True)  # warm-up: each replica imports xgrammar, compiles the tools
        rows = [run_seed(url, seed, args) for seed in args.seeds]
    steps = sorted({s for r in rows for s in r["ttft_by_step_warm_ms"]}, key=int)
    step_rows = []
    for s in steps:
        warm, cold, resp = (statistics.median(r[k][s] for r in rows if s in r[k]) for k in (
            "ttft_by_step_warm_ms", "ttft_by_step_cold_ms", "ttft_by_step_responses_ms"))
        step_rows.append([s, warm, cold, warm / cold, resp])
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("resumed", "responses_resumed", "spliced", "drifted", "drift_tokens")}
    warm_ttft = statistics.median(r["warm"]["ttft_mean_ms"] for r in rows)
    cold_ttft = statistics.median(r["cold"]["ttft_mean_ms"] for r in rows)
    resp_ttft = statistics.median(r["responses"]["ttft_mean_ms"] for r in rows)
    resp_ratio = statistics.median(r["responses"]["ttft_mean_ms"] / r["warm"]["ttft_mean_ms"] for r in rows)
    by_order = {first: [r["responses"]["ttft_mean_ms"] / r["warm"]["ttft_mean_ms"] for r in rows
                        if (r["seed"] % 2 == 1) == (first == "Responses")] for first in ("Responses", "Chat")}
    order_text = "; ".join(f"{first} first: " + ", ".join(f"{x:.2f}x" for x in xs)
                           for first, xs in by_order.items() if xs)
    cont = {k: statistics.median(r["continuations_ms"][k] for r in rows) for k in ("chat", "responses")}
    store = {op: statistics.median(r["store_ms"][op] for r in rows if op in r.get("store_ms", {}))
             for op in ("get", "put") if any(op in r.get("store_ms", {}) for r in rows)}
    md = table(["seed", "requests", "failed", "resumed", "hit rate", "TTFT warm ms", "TTFT cold ms", "Responses: "
                "resumed", "hit rate", "TTFT ms", "spliced", "drifted", "drift tokens"],
               [[r["seed"], r["requests"], r["failed"], r["resumed"], r["warm"]["hit_rate"], r["warm"]["ttft_mean_ms"],
                 r["cold"]["ttft_mean_ms"], r["responses_resumed"], r["responses"]["hit_rate"],
                 r["responses"]["ttft_mean_ms"], r["spliced"], r["drifted"], r["drift_tokens"]] for r in rows])
    store_text = ", ".join(f"{op} {ms:.1f} ms" for op, ms in store.items()) or "not measured"
    md += "\n\nMean TTFT by step of the agent loop (medians over seeds):\n\n"
    md += table(["step", "warm ms", "cold ms", "warm/cold", "Responses ms"], step_rows)
    md += (f"\n\nMedians over seeds {', '.join(map(str, args.seeds))}: {med['resumed']:.3f} of the requests after "
           f"each agent's first resumed from the previous prompt and output (target at least 0.95); mean TTFT "
           f"{warm_ttft:.1f} ms warm vs {cold_ttft:.1f} ms cold ({warm_ttft / cold_ttft:.2f}x). Over Responses with "
           f"previous_response_id: {med['responses_resumed']:.3f} resumed (target at least 0.97), mean TTFT "
           f"{resp_ttft:.1f} ms ({resp_ratio:.2f}x warm Chat Completions', median of the per-seed ratios; by which "
           f"API ran first in the seed, {order_text}); over "
           f"the requests after each agent's first, {cont['responses']:.1f} ms against {cont['chat']:.1f} ms "
           f"({cont['responses'] / cont['chat']:.2f}x); the response store's round trip, as the API awaited it: "
           f"{store_text} a call (a get on every continuation's path to its first token, a put after each answer). "
           f"Drift: of "
           f"{med['spliced']:.0f} re-sent answers spliced from the generated ids, {med['drifted']:.0f} would have "
           f"re-encoded to other ids ({med['drift_tokens']:.0f} tokens recomputed without the memory).\n")
    variant, title = knob_variant(args.model, args.engine)
    publish(record, variant, {"seeds": rows}, md, args.out, "Agentic: every turn resumes where the last ended", title)


if __name__ == "__main__":
    main()

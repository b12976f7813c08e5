"""Router benchmark: `python -m loadtest.bench_router [--out docs/benchmarks.md]` (about 25 minutes on 2 cores).

Request routers in front of replicas of kda-tiny (dense checkpoints, controller off), on four workloads
(loadtest/workloads.py: few-shot headers, multi-turn chat with growing histories, the paper's reuse-distance
replay, and agents whose tool-calling turns re-send their whole history over Chat Completions, for every arm),
each over several seeds. Arms: ours (prefix-aware, predicted cost from the replicas' checkpoint digests
and load), Ray's default power-of-two choices, Ray's PrefixCacheAffinityRouter (text-prefix tree), and one
replica holding both replicas' checkpoint budget (the hit-rate ceiling for the same bytes; reported only). The
few-shot workload also runs at 4 replicas, for hit rate.

One Ray cluster serves every arm; each (workload, arm) is a fresh deployment that runs the seeds one after the
other (each seed's prompts are new text, so an earlier seed's checkpoints only take room, as on a live server);
with --interleave, each (seed, arm) is, the arms' order rotated per seed (this VM's speed drifts by up to 2x
within a run: arms run one after the other compare different machines).
The checkpoint budget holds about 18 dense checkpoints per replica: less than the working set, so where a prefix
goes decides whether it hits. TTFT is the time to the first streamed chunk; the hit rate is token-weighted.
Reported per workload and arm: the median over seeds of hit rate, mean TTFT, p90 TTFT and max/min requests per
replica, and ratios against Ray's PrefixCacheAffinityRouter.
Results: loadtest/results/bench_router_cpu.json, variant the model (with --engine JSON, engine knobs for every
arm: `<model>/engine-<hash>`; with a subset of --workloads, `/` and their names after it); --out DOC replaces
that variant's block in DOC (loadtest/sections.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from loadtest.common import start_run, table
from loadtest.sections import knob_variant, publish
from loadtest.serve_harness import cluster, deployed, summarise
from loadtest.workloads import agentic, chat, chat_openers, drive, few_shot, reuse_phases

ARMS = ("prefix", "pow2", "prefix_affinity", "single")
WORKLOADS = ("few-shot", "chat", "reuse", "agentic")
REFERENCE = "prefix_affinity"


def app_args(arm: str, replicas: int, args) -> dict:
    single = arm == "single"
    return {"model": args.model, "replicas": 1 if single else replicas, "replica_cpus": 0.5,
            "engine": {**(args.engine or {}), "checkpoint_budget_mb": args.budget_mb * (replicas if single else 1)},
            "router": {"kind": "pow2" if single else arm, "stats_period_s": 1.0,
                       **(ours_knobs(args) if arm == "prefix" else {})},
            "controller": {"enabled": False}}


def ours_knobs(args) -> dict:
    knobs = {"affinity_credit": args.affinity_credit, "work_weight": args.work_weight}
    return {k: v for k, v in knobs.items() if v is not None}


def run_seed(url: str, workload: str, seed: int, args) -> list[dict]:
    """The measured requests of one seed of `workload`."""
    if workload == "few-shot":
        warm, timed = few_shot(seed, args.groups, args.per_group)
        drive(url, args.model, warm, args.concurrency)
        time.sleep(2.5)  # digests refresh
        return drive(url, args.model, timed, args.concurrency)
    if workload == "chat":
        return chat(url, args.model, chat_openers(seed, args.conversations), args.turns, args.answer_tokens,
                    args.concurrency, seed)
    if workload == "agentic":
        return agentic(url, args.model, seed, args.agents)
    return drive(url, args.model, reuse_phases(seed, tuple(args.phases)), args.concurrency)


def per_replica_ratio(row: dict) -> float:
    counts = row["requests_per_replica"]
    return counts[0] / counts[-1] if len(counts) > 1 and counts[-1] else float("inf") if len(counts) > 1 else 1.0


def run_arm(url: str, workload: str, arm: str, replicas: int, args) -> dict:
    rows = []
    with deployed(url, app_args(arm, replicas, args)):
        for seed in args.seeds:
            rows.append(measure(url, workload, arm, replicas, seed, args))
    return summary(workload, replicas, arm, rows)


def run_interleaved(url: str, workload: str, arms: list[str], replicas: int, args) -> list[dict]:
    """Every arm on every seed, seed by seed, the arms' order rotated each seed and each (seed, arm) on a fresh
    deployment (warmed up first for agentic: the grammar library and the tools' schemas): a machine whose speed
    drifts during the run, or an arm that runs after a heavier one, biases no arm."""
    rows: dict[str, list[dict]] = {arm: [] for arm in arms}
    for i, seed in enumerate(args.seeds):
        for arm in arms[i % len(arms):] + arms[: i % len(arms)]:
            with deployed(url, app_args(arm, replicas, args)):
                if workload == "agentic":
                    agentic(url, args.model, 0, 4, (1, 1), cold=True)
                rows[arm].append(measure(url, workload, arm, replicas, seed, args))
    return [summary(workload, replicas, arm, rows[arm]) for arm in arms]


def measure(url: str, workload: str, arm: str, replicas: int, seed: int, args) -> dict:
    t0 = time.perf_counter()
    results = run_seed(url, workload, seed, args)
    row = {"seed": seed, **summarise(results, time.perf_counter() - t0)}
    row["max_min"] = per_replica_ratio(row)
    print(json.dumps({"workload": workload, "replicas": replicas, "arm": arm, **row}), flush=True)
    return row


def summary(workload: str, replicas: int, arm: str, rows: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in rows) for k in ("hit_rate", "ttft_mean_ms", "ttft_p90_ms", "max_min")}
    return {"workload": workload, "replicas": replicas, "arm": arm, "failed": sum(r["failed"] for r in rows),
            "seeds": rows, **{f"median_{k}": v for k, v in med.items()}}


def verdicts(arms: list[dict]) -> dict:
    """Ours against Ray's PrefixCacheAffinityRouter on one workload (medians over seeds)."""
    by = {a["arm"]: a for a in arms}
    ours, ref = by["prefix"], by[REFERENCE]
    return {"hit_delta": ours["median_hit_rate"] - ref["median_hit_rate"],
            "ttft_ratio": ours["median_ttft_mean_ms"] / ref["median_ttft_mean_ms"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kda-tiny")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument("--groups", type=int, default=12, help="few-shot: headers")
    p.add_argument("--per-group", type=int, default=4, help="few-shot: queries per header and pass")
    p.add_argument("--conversations", type=int, default=8, help="chat: conversations")
    p.add_argument("--turns", type=int, default=4, help="chat: turns per conversation")
    p.add_argument("--answer-tokens", type=int, default=16, help="chat: tokens per answer")
    p.add_argument("--agents", type=int, default=12, help="agentic: agents side by side")
    p.add_argument("--phases", type=int, nargs="+", default=[24, 12, 6, 3], help="reuse: working set per phase")
    p.add_argument("--wide-replicas", type=int, default=4, help="few-shot again at this many replicas (0: skip)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--affinity-credit", type=float, default=None, help="ours: RouterKnobs.affinity_credit (default: "
                   "the router's)")
    p.add_argument("--work-weight", type=float, default=None, help="ours: RouterKnobs.work_weight (default: the "
                   "router's)")
    p.add_argument("--budget-mb", type=float, default=2.0, help="per replica: about 18 dense kda-tiny checkpoints")
    p.add_argument("--engine", type=json.loads, default=None, metavar="JSON",
                   help="engine knobs for every arm (e.g. '{\"lookback\": 64}'): its own variant, "
                        "<model>/engine-<hash>")
    p.add_argument("--interleave", action="store_true", help="a fresh deployment per (seed, arm), arms rotated per "
                   "seed (fair when the machine's speed drifts; slower: one deployment per seed and arm)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    record = start_run("bench_router", {k: v for k, v in vars(args).items() if k != "out"}, argv)
    results = []
    with cluster(num_cpus=4) as url:
        for workload in args.workloads:
            if args.interleave:
                results += run_interleaved(url, workload, list(args.arms), 2, args)
            else:
                results += [run_arm(url, workload, arm, 2, args) for arm in args.arms]
        if args.wide_replicas and "few-shot" in args.workloads:
            results += [run_arm(url, "few-shot", arm, args.wide_replicas, args) for arm in args.arms if arm != "single"]
    md = table(["workload", "replicas", "router", "failed", "hit rate", "TTFT mean ms", "TTFT p90 ms", "max/min"],
               [[r["workload"], 1 if r["arm"] == "single" else r["replicas"], r["arm"], r["failed"],
                 r["median_hit_rate"], r["median_ttft_mean_ms"], r["median_ttft_p90_ms"], r["median_max_min"]]
                for r in results])
    lines = []
    for workload in dict.fromkeys((r["workload"], r["replicas"]) for r in results):
        arms = [r for r in results if (r["workload"], r["replicas"]) == workload]
        if {"prefix", REFERENCE} <= {a["arm"] for a in arms}:
            v = verdicts(arms)
            lines.append(f"- {workload[0]}, {workload[1]} replicas: ours vs PrefixCacheAffinityRouter: hit rate "
                         f"{v['hit_delta']:+.3f}, mean TTFT {v['ttft_ratio']:.2f}x")
    md += "\n\nMedians over seeds " + ", ".join(map(str, args.seeds)) + ".\n\n" + "\n".join(lines) + "\n"
    variant, title = knob_variant(args.model, args.engine)
    if set(args.workloads) != set(WORKLOADS):  # a subset is its own block: it does not replace the full run's
        variant += "/" + "+".join(args.workloads)
        title = f"{title or args.model}, workloads {' '.join(args.workloads)}"
    publish(record, variant, {"arms": results}, md, args.out, "Router: prefix-aware vs Ray's routers", title)


if __name__ == "__main__":
    main()

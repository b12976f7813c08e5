"""Router benchmark: `python -m loadtest.bench_router [--out docs/benchmarks.md]`.

One run, same workload and seed, three request routers in front of 2 replicas of kda-tiny (dense checkpoints,
controller off): ours (prefix-aware, digests of held checkpoints), Ray's default power-of-two choices, and
Ray's PrefixCacheAffinityRouter (text-prefix tree). Workload (few-shot style): `groups` long shared headers
with short distinct queries; a warm-up pass, then the timed pass with new queries on the same headers, so
every hit comes from a header checkpoint. The budget holds about 18 dense checkpoints per replica: enough for
half of the headers plus the traffic's prompt-end checkpoints, not for all of them, which is where
steering each header to one replica pays. Each request asks for one token (latency = TTFT). Reported:
token-weighted hit rate, mean and p90 TTFT, requests per replica.
Results: loadtest/results/bench_router_cpu.json, variant the model; --out DOC replaces that variant's block in
DOC (loadtest/sections.py).
"""

from __future__ import annotations

import argparse
import json
import time

from loadtest.common import start_run, table
from loadtest.sections import publish
from loadtest.serve_harness import drive, prefix_prompts, serve_app, summarise

KINDS = ("prefix", "pow2", "prefix_affinity")


def run(kind: str, args) -> dict:
    app = {"model": args.model, "replicas": 2, "replica_cpus": 0.5,
           "engine": {"checkpoint_budget_mb": args.budget_mb},
           "router": {"kind": kind, "stats_period_s": 1.0}, "controller": {"enabled": False}}
    warm = prefix_prompts(args.groups, args.per_group, args.seed)
    timed = prefix_prompts(args.groups, args.per_group, args.seed, tail_seed=args.seed + 1)  # new queries
    with serve_app(app) as url:
        drive(url, warm, args.concurrency, args.model)
        time.sleep(2.5)  # digests refresh
        t0 = time.perf_counter()
        results = drive(url, timed, args.concurrency, args.model)
        row = {"router": kind, **summarise(results, time.perf_counter() - t0)}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kda-tiny")
    p.add_argument("--groups", type=int, default=12)
    p.add_argument("--per-group", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--budget-mb", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    record = start_run("bench_router", config, argv)
    rows = [run(kind, args) for kind in KINDS]
    md = table(["router", "requests", "failed", "hit rate", "TTFT mean ms", "TTFT p90 ms", "per replica"],
               [[r["router"], r["requests"], r["failed"], r["hit_rate"], r["ttft_mean_ms"], r["ttft_p90_ms"],
                 "/".join(map(str, r["requests_per_replica"]))] for r in rows])
    publish(record, args.model, {"rows": rows}, md, args.out, "Router: prefix-aware vs Ray's routers")


if __name__ == "__main__":
    main()

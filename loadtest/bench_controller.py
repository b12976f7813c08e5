"""Controller benchmark: `python -m loadtest.bench_controller [--out docs/benchmarks.md]`.

A prefix-reuse workload whose working set exceeds dense checkpoint capacity, served by 1 replica of
kda-tiny: first a sweep of static settings (controller off), then the controller starting from dense. Each
arm runs the same rounds of the same prompts; the last `--measure` rounds are measured (the controller arm
has had the earlier rounds to tune). Reported: hit rate, mean and p90 TTFT, and for the controller its
final setting and decisions; the comparison is against the best and the worst static setting.
Results: loadtest/results/bench_controller_cpu.json, variant the model; --out DOC replaces that variant's block
in DOC (loadtest/sections.py).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from loadtest.common import start_run, table
from loadtest.sections import publish
from loadtest.serve_harness import drive, prefix_prompts, serve_app, summarise

STATIC = ({"w_max": None}, {"w_max": 16}, {"w_max": 64}, {"w_max": 128}, {"w_max": 512, "policy": "wr"})


def label(s: dict) -> str:
    return "dense" if s.get("w_max") is None else f"{s.get('policy', 'nr')}-W{s['w_max']}"


def run(arm: str, engine: dict, controller: bool, args) -> dict:
    app = {"model": args.model, "replicas": 1, "replica_cpus": 1.0,
           "engine": {"checkpoint_budget_mb": args.budget_mb, **engine},
           "controller": {"enabled": controller, "window_s": args.window_s, "trial_windows": 1, "min_requests": 2,
                          "max_w_nr": 128, "max_w_wr": 512}}
    prompts = prefix_prompts(args.groups, 1, args.seed)
    measured = []
    with serve_app(app) as url:
        t_start = time.perf_counter()
        for r in range(args.rounds):
            t0 = time.perf_counter()
            order = prompts[:]
            random.Random(args.seed + r).shuffle(order)
            results = drive(url, order, args.concurrency, args.model)
            if r >= args.rounds - args.measure:
                measured.append((results, time.perf_counter() - t0))
        state = None
        if controller:
            import ray

            from deployments import controller as controller_mod

            state = ray.get(controller_mod.lookup().state.remote())
        elapsed = time.perf_counter() - t_start
    allres = [x for res, _ in measured for x in res]
    row = {"arm": arm, **summarise(allres, sum(w for _, w in measured)), "wall_s": elapsed}
    if state:
        row["final_setting"] = state["current_label"]
        row["decisions"] = [f"{d['decision']} {d['setting']}" for d in state["decisions"]]
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kda-tiny")
    p.add_argument("--groups", type=int, default=24, help="distinct prefixes in the working set")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--measure", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--budget-mb", type=float, default=1.5, help="about 12 dense kda-tiny checkpoints")
    p.add_argument("--window-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    record = start_run("bench_controller", {k: v for k, v in vars(args).items() if k != "out"}, argv)
    rows = [run(label(s), s, False, args) for s in STATIC]
    rows.append(run("controller", {}, True, args))
    static = rows[:-1]
    best = min(static, key=lambda r: r["ttft_mean_ms"])
    worst = max(static, key=lambda r: r["ttft_mean_ms"])
    ctrl = rows[-1]
    md = table(["arm", "hit rate", "TTFT mean ms", "TTFT p90 ms", "failed"],
               [[r["arm"], r["hit_rate"], r["ttft_mean_ms"], r["ttft_p90_ms"], r["failed"]] for r in rows])
    md += (f"\n\nController final setting: {ctrl.get('final_setting')}; decisions: {ctrl.get('decisions')}.\n"
           f"Mean TTFT vs best static ({best['arm']}): {ctrl['ttft_mean_ms'] / best['ttft_mean_ms']:.2f}x; "
           f"vs worst static ({worst['arm']}): {ctrl['ttft_mean_ms'] / worst['ttft_mean_ms']:.2f}x.\n")
    publish(record, args.model, {"rows": rows}, md, args.out, "Controller vs static settings")


if __name__ == "__main__":
    main()

"""Controller benchmark: `python -m loadtest.bench_controller [--out docs/benchmarks.md]` (about 25 minutes on 2
cores).

The tuning controller against static settings in three situations, 1 replica of kda-tiny, one Ray cluster:

- overflow: a prefix-reuse working set (24 prompts, walked round after round) larger than the dense checkpoint
  budget (about 12 dense kda-tiny checkpoints): the controller starts at dense and should climb to a compressed
  setting.
- fits: the same with 6 prompts, which dense holds: started at nr-W64, it should come back to dense (or stay
  within its trial windows of the best).
- chat: conversations with long answers, whose client keeps only the answer's complete lines (so a next turn
  leaves the generated tokens just before their end, past the generation-end checkpoint), in a budget with room
  for interval checkpoints: started without them, it should pick an interval.

Each arm runs the same rounds (each round new prompts of the same shape for chat, the same prompts reshuffled
otherwise); the last few rounds are measured (`ROUNDS`; the controller has had the earlier ones to tune). The
controller may use what the model's measured allowance permits (allowance.json). Reported per situation: hit
rate, mean and p90 TTFT of each arm, the controller's final setting and decisions, and its mean TTFT against the
best static setting's and against its start setting's. The best static setting runs again after the controller
(ABA: drift of the machine over a situation's minutes weighs on both sides), and its figure is the mean of its two
runs.
Results: loadtest/results/bench_controller_cpu.json, variant the model (with --engine JSON, engine knobs for every
arm: `<model>/engine-<hash>`); --out DOC replaces that variant's block in DOC (loadtest/sections.py).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from deployments.builder import ServeArgs, controller_config
from loadtest.common import start_run, table
from loadtest.sections import knob_variant, publish
from loadtest.serve_harness import cluster, deployed, prefix_prompts, summarise
from loadtest.workloads import chat, chat_openers, drive

# name: (rounds, of which the last are measured); fits' rounds are short (6 prompts), so it runs more of them for
# the controller to finish its trial in
ROUNDS = {"overflow": (16, 4), "fits": (240, 120), "chat": (8, 4)}
SITUATIONS = {
    # name: (static settings, the controller's start setting)
    "overflow": ([{}, {"w_max": 16}, {"w_max": 64}, {"w_max": 128}, {"w_max": 512, "policy": "wr"}], {}),
    "fits": ([{}, {"w_max": 16}, {"w_max": 64}], {"w_max": 64}),
    "chat": ([{}, {"interval": 32}, {"interval": 64}, {"interval": 128}, {"interval": 256},
              {"w_max": 16, "interval": 64}], {}),
}


def label(s: dict) -> str:
    base = "dense" if s.get("w_max") is None else f"{s.get('policy', 'nr')}-W{s['w_max']}"
    return base + (f"/I{s['interval']}" if s.get("interval") else "")


def one_round(url: str, situation: str, r: int, args) -> list[dict]:
    if situation == "chat":
        openers = chat_openers(args.seed * 1000 + r, args.conversations)
        return chat(url, args.model, openers, args.turns, args.answer_tokens, args.concurrency, args.seed + r,
                    whole_lines=True)
    prompts = prefix_prompts(24 if situation == "overflow" else 6, 1, args.seed)
    random.Random(args.seed + r).shuffle(prompts)
    return drive(url, args.model, prompts, args.concurrency)


def run(url: str, situation: str, arm: str, engine: dict, controller: bool, args) -> dict:
    app = {"model": args.model, "replicas": 1, "replica_cpus": 1.0,
           "engine": {**(args.engine or {}),
                      "checkpoint_budget_mb": args.chat_budget_mb if situation == "chat" else args.budget_mb,
                      **engine},
           "controller": {"enabled": controller, "window_s": args.window_s, "trial_windows": 1, "min_requests": 2,
                          "max_w_nr": 128, "max_w_wr": 512}}
    rounds, measure = (max(1, round(n * args.scale)) for n in ROUNDS[situation])
    measured, state, history, actor = [], None, None, None
    with deployed(url, app):
        t_start = time.perf_counter()
        for r in range(rounds):
            t0 = time.perf_counter()
            results = one_round(url, situation, r, args)
            if r >= rounds - measure:
                measured.append((results, time.perf_counter() - t0))
        if controller:
            import ray

            from deployments import controller as controller_mod

            state = ray.get(controller_mod.lookup().state.remote())
            history = ray.get(controller_mod.lookup().history.remote())
            actor = controller_config(ServeArgs(**app))["actor"]
        elapsed = time.perf_counter() - t_start
    allres = [x for res, _ in measured for x in res]
    row = {"situation": situation, "arm": arm, **summarise(allres, sum(w for _, w in measured)), "wall_s": elapsed}
    if state:
        row["final_setting"] = state["current_label"]
        row["decisions"] = [f"{d['decision']} {d['label']}" for d in state["decisions"]]
        row["evidence"] = [{k: d[k] for k in ("decision", "label", "kind", "evidence", "trial_ttft", "control_ttft")
                            if k in d} for d in state["decisions"]]
        # what `tuner.replay` needs to make the same decisions offline (tests/deployments/data/)
        row["recording"] = {"knobs": actor["knobs"], "initial": actor["initial"], "history": history}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kda-tiny")
    p.add_argument("--situations", nargs="+", default=list(SITUATIONS), choices=list(SITUATIONS))
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every situation's rounds and measured rounds "
                   "(ROUNDS)")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--answer-tokens", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--budget-mb", type=float, default=1.5, help="about 12 dense kda-tiny checkpoints")
    p.add_argument("--chat-budget-mb", type=float, default=6.0, help="chat: room for interval checkpoints")
    p.add_argument("--window-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--engine", type=json.loads, default=None, metavar="JSON",
                   help="engine knobs for every arm under its own settings (e.g. '{\"lookback\": 64}'): its own "
                        "variant, <model>/engine-<hash>")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    record = start_run("bench_controller", {k: v for k, v in vars(args).items() if k != "out"}, argv)
    rows, lines = [], []
    with cluster(num_cpus=4) as url:
        for situation in args.situations:
            static, start = SITUATIONS[situation]
            arms = [run(url, situation, label(s), s, False, args) for s in static]
            ctrl = run(url, situation, f"controller (from {label(start)})", start, True, args)
            # the best static setting again after the controller: its figure is the mean of both runs, so that a
            # machine drifting over the situation's minutes weighs on both sides alike
            setting, best = min(zip(static, arms), key=lambda p: p[1]["ttft_mean_ms"])
            again = run(url, situation, f"{label(setting)} (again)", setting, False, args)
            rows += arms + [ctrl, again]
            best_ms = (best["ttft_mean_ms"] + again["ttft_mean_ms"]) / 2
            first = next(r for r in arms if r["arm"] == label(start))
            lines.append(f"- {situation}: controller ended at {ctrl.get('final_setting')}; mean TTFT "
                         f"{ctrl['ttft_mean_ms'] / best_ms:.2f}x the best static ({best['arm']}, mean of its two "
                         f"runs), {ctrl['ttft_mean_ms'] / first['ttft_mean_ms']:.2f}x its start ({first['arm']}); "
                         f"decisions: {', '.join(ctrl.get('decisions') or ['none'])}")
    md = table(["situation", "arm", "hit rate", "TTFT mean ms", "TTFT p90 ms", "failed"],
               [[r["situation"], r["arm"], r["hit_rate"], r["ttft_mean_ms"], r["ttft_p90_ms"], r["failed"]]
                for r in rows])
    md += "\n\n" + "\n".join(lines) + "\n"
    variant, title = knob_variant(args.model, args.engine)
    publish(record, variant, {"rows": rows}, md, args.out, "Controller vs static settings", title)


if __name__ == "__main__":
    main()

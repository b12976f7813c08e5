"""`make eval`: lm-evaluation-harness against our OpenAI API, and the fidelity of compressed checkpoints.

1. Reference agreement: the loglikelihood and multiple-choice tasks through lm-eval's `hf` model (transformers on
   the checkpoint) and through `local-completions` against a server (ours, dense, started here; or `--url`, e.g.
   `make serve`'s). Per-sample log-likelihoods must agree within 1e-3 and the accuracies must be equal; the run
   exits 1 otherwise.
2. Answer fidelity: the generate_until tasks (shared headers, so most requests resume from a checkpoint)
   against a fresh local server per fixed setting (dense; dasc nr and wr at W16/64/128; INT8 at W16/W64; the
   count-matched random selector at the nr W values): accuracy, agreement of greedy outputs with the dense run,
   and the share of sequences a compressed checkpoint served (engine telemetry).
3. Logprob fidelity (direct API, `drift.py`): the copy prompts one after another against another fresh server
   per setting; per-token KL and top-1 agreement against dense on the requests a compressed checkpoint served.

Each part replaces its block in docs/fidelity.md (`--out`) and its record in loadtest/results/eval/.
`--limit N` (documents per task) and `--settings a,b` make a quick pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time

from app.models.loader import resolve_model_dir
from app.models.tokenizer import Tokenizer
from loadtest.common import REPO, start_run, table
from loadtest.eval import drift
from loadtest.eval.compare import generation_agreement, loglik_agreement
from loadtest.eval.harness import api_args, evaluate, hf_args
from loadtest.eval.server import engine_status, local_server
from loadtest.sections import publish

REFERENCE_TASKS = ["dasc_code_mc", "dasc_code_loglik"]
FIDELITY_TASKS = ["dasc_code_copy", "dasc_code_next"]
TOLERANCE = 1e-3
SETTINGS = {
    "dense": {},
    **{f"nr-W{w}": {"w_max": w, "policy": "nr"} for w in (16, 64, 128)},
    **{f"wr-W{w}": {"w_max": w, "policy": "wr"} for w in (16, 64, 128)},
    **{f"int8-W{w}": {"w_max": w, "quant": "int8"} for w in (16, 64)},
    **{f"random-W{w}": {"w_max": w, "selector": "random:0"} for w in (16, 64, 128)},
}
RESULTS = REPO / "loadtest" / "results" / "eval"  # beside, not among, the benchmark records of docs/benchmarks.md
LOGS = RESULTS / "logs"


def reference(model: str, url: str | None, limit: int | None, out: str | None, threads: int) -> bool:
    model_dir = resolve_model_dir(model)
    run = _start("eval_reference", {"model": model, "tasks": REFERENCE_TASKS, "limit": limit, "url": url})
    t0 = time.perf_counter()
    hf = evaluate("hf", hf_args(model_dir), REFERENCE_TASKS, limit, batch_size=4)
    t_hf = time.perf_counter() - t0
    if url:
        api = evaluate("local-completions", api_args(url, model, model_dir), REFERENCE_TASKS, limit)
    else:
        with local_server(model, {}, LOGS / "reference.log", threads=threads) as served:
            api = evaluate("local-completions", api_args(served, model, model_dir), REFERENCE_TASKS, limit)
    rows, results, ok = [], {}, True
    for task in REFERENCE_TASKS:
        agree = loglik_agreement(hf["samples"][task], api["samples"][task])
        acc_hf, acc_api = hf["results"][task]["acc,none"], api["results"][task]["acc,none"]
        passed = agree["max_abs_diff"] <= TOLERANCE and acc_hf == acc_api
        ok &= passed
        results[task] = {**agree, "acc_hf": acc_hf, "acc_api": acc_api, "passed": passed}
        rows.append([task, len(hf["samples"][task]), acc_hf, acc_api, agree["compared"],
                     f"{agree['max_abs_diff']:.2e}", agree["greedy_flags_differ"], agree["same_pick"],
                     "pass" if passed else "FAIL"])
    body = table(["task", "docs", "acc (hf)", "acc (API)", "log-likelihoods", "max abs diff", "is_greedy differ",
                  "same pick", f"within {TOLERANCE:g}"], rows)
    body += f"\n\nhf run {t_hf:.0f} s; server: {url or 'local, dense, started by the script'}."
    publish(run, model, results, body, out, "Reference agreement: lm-eval hf against local-completions",
            title=f"{model}", directory=RESULTS)
    return ok


def fidelity(model: str, names: list[str], limit: int | None, out: str | None, concurrent: int,
             threads: int) -> None:
    model_dir = resolve_model_dir(model)
    tok = Tokenizer.from_dir(model_dir)
    prompts = tok.encode_batch(drift.copy_prompts(limit))
    run = _start("eval_fidelity", {"model": model, "tasks": FIDELITY_TASKS, "limit": limit,
                                      "settings": {n: SETTINGS[n] for n in names}, "num_concurrent": concurrent,
                                      "server_threads": threads})
    per = {}
    for name in names:
        t0 = time.perf_counter()
        with local_server(model, SETTINGS[name], LOGS / f"{name}.log", threads=threads) as url:
            lm = evaluate("local-completions", api_args(url, model, model_dir, concurrent), FIDELITY_TASKS, limit)
            snap = engine_status(url)
        with local_server(model, SETTINGS[name], LOGS / f"{name}-drift.log", threads=threads) as url:
            steps = drift.run(url, model, prompts)
        per[name] = {"lm": lm, "snapshot": snap, "drift": steps, "seconds": time.perf_counter() - t0}
        print(f"{name}: {json.dumps(lm['results'])} in {per[name]['seconds']:.0f} s", flush=True)
    base = per[names[0]]
    rows, results = [], {}
    for name in names:
        lm, snap = per[name]["lm"], per[name]["snapshot"]
        admitted = snap["sequences_admitted"] or 1
        res = {task: {"exact_match": lm["results"][task]["exact_match,none"],
                      "agreement": generation_agreement(base["lm"]["samples"][task], lm["samples"][task])}
               for task in FIDELITY_TASKS}
        res["compressed_share"] = snap["sequences_compressed_hit"] / admitted
        res["hit_share"] = snap["sequences_hit"] / admitted
        res["drift"] = drift.summarize(base["drift"], per[name]["drift"])
        res["seconds"] = round(per[name]["seconds"], 1)
        results[name] = res
        d = res["drift"]
        rows.append([name, *[res[t]["exact_match"] for t in FIDELITY_TASKS],
                     *[res[t]["agreement"] for t in FIDELITY_TASKS], res["hit_share"], res["compressed_share"],
                     f"{d['compressed']}/{d['requests']}", _num(d["kl_mean"]), _num(d["top1_agreement"]),
                     _num(d["greedy_agreement"])])
    body = table(["setting", "copy EM", "next EM", "copy = dense", "next = dense", "hit share", "compressed share",
                  "drift: compressed", "KL / token", "top-1 agree", "greedy = dense"], rows)
    total = sum(per[n]["seconds"] for n in names)
    body += (f"\n\n{names[0]} is the baseline of the agreement columns. Shares are of the sequences the engine "
             "admitted during the lm-eval run; the drift columns cover the direct-API requests a compressed "
             "checkpoint served (16 greedy tokens, top-20 logprobs). "
             f"Wall time {total / 60:.0f} min for {len(names)} settings.")
    publish(run, model, results, body, out, "Answer fidelity under compression", title=f"{model}",
            directory=RESULTS)


def _start(script: str, config: dict):
    """The run's record, with the command line that really ran (`loadtest.eval.run`, not `loadtest.<script>`)."""
    return dataclasses.replace(start_run(script, config),
                               command=shlex.join(["python", "-m", "loadtest.eval.run", *sys.argv[1:]]))


def _num(x):
    return "-" if x is None else x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kda-tiny")
    p.add_argument("--url", default=None, help="a running server for the reference run (default: start one)")
    p.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, the first is the baseline")
    p.add_argument("--parts", default="reference,fidelity")
    p.add_argument("--concurrent", type=int, default=4, help="lm-eval's concurrent requests")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server: more oversubscribe a "
                   "small shared CPU, where OpenMP's waits made a 2-thread server many times slower")
    p.add_argument("--out", default=None, help="the doc to write the blocks into (docs/fidelity.md)")
    args = p.parse_args(argv)
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    parts = args.parts.split(",")
    ok = True
    if "reference" in parts:
        ok = reference(args.model, args.url, args.limit, args.out, args.threads)
    if "fidelity" in parts:
        fidelity(args.model, names, args.limit, args.out, args.concurrent, args.threads)
    if not ok:
        print("reference agreement FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

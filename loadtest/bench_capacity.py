"""Capacity benchmark of dasc checkpoints under a fixed memory budget:
`python -m loadtest.bench_capacity --model kda-tiny [--out docs/benchmarks.md]`.

Protocol (paper C.2, scaled to this CPU): the checkpoint budget equals 128 dense slots (127 usable). The
workload has one phase per capacity boundary: phase W holds Q(W) = ceil(N(W) / 0.85) distinct prompts,
where N(W) is the slot count of ragged fp32 dasc-nr at that W_max (dense for the first phase). Every arm
runs every phase as: fresh engine (flush) -> untimed fill (each prompt once) -> seeded shuffle -> timed
replay (all prompts submitted at once, one output token). Only replay requests count: token-weighted hit
rate (Eq. 9), mean and p90 TTFT, input tokens/s. Prompt-end checkpoints only (no interval, no
generation-end checkpoints), LRU eviction.

Quality (separate, model-level): for held-out prefixes the dense state after the prefix is stored and
loaded through each arm's codec (and refreshed by wr), then the next 32 true tokens are scored (mean NLL,
the "continuation loss") and 16 greedy tokens are compared with dense (greedy agreement).

Results: loadtest/results/bench_capacity_cpu.json, variant the model; --out DOC replaces that variant's block in
DOC (loadtest/sections.py).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

import torch

from app.cache.checkpoint import DenseCodec
from app.dasc.codec import DascCodec
from app.dasc.horizons import model_geometry, model_horizons
from app.dasc.layout import slots_for_budget
from app.dasc.policy import local_rows, refresh_local_units
from app.dasc.selection import make_plan
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.models.batch import BatchLayout, ContiguousKV
from app.models.loader import load_model, resolve_model_dir
from app.models.tokenizer import Tokenizer
from loadtest.bench_engine import corpus_ids
from loadtest.common import start_run, table
from loadtest.sections import publish

W_MAXES = (16, 64, 128, 512)
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def arms(w_maxes, random_seed: int) -> list[dict]:
    out = [{"name": "dense", "w_max": None}]
    for w in w_maxes:
        for quant in ("none", "int8"):
            for policy in ("nr", "wr"):
                out.append({"name": f"W{w}-{policy}-{'int8' if quant == 'int8' else 'fp32'}", "w_max": w,
                            "policy": policy, "quant": quant})
        out.append({"name": f"W{w}-nr-fp32-random", "w_max": w, "policy": "nr", "quant": "none",
                    "selector": f"random:{random_seed}"})
    return out


def engine_for(model, tok, arm: dict, budget_mb: float) -> Engine:
    cfg = EngineConfig(checkpoint_budget_mb=budget_mb, interval=0, store_generation_end=False, kv_slots=400_000,
                       max_running=64, chunk_size=512, max_tokens_per_step=4096, w_max=arm["w_max"],
                       policy=arm.get("policy", "nr"), quant=arm.get("quant", "none"),
                       selector=arm.get("selector", "decay"))
    return Engine(model, tok, cfg)


def run_phase(model, tok, arm, budget_mb, prompts, seed) -> dict:
    engine = engine_for(model, tok, arm, budget_mb)
    engine.generate(prompts, ONE)  # untimed fill
    order = prompts[:]
    random.Random(seed).shuffle(order)
    before = engine.snapshot()
    t0 = time.perf_counter()
    outs = [o[0] for o in engine.generate(order, ONE)]
    wall = time.perf_counter() - t0
    after = engine.snapshot()
    ttfts = sorted(o.ttft_s for o in outs)
    prompt_tokens = sum(o.prompt_tokens for o in outs)
    return {"slots": engine.cache.checkpoints.num_slots, "bytes_per_slot": engine.codec.bytes_per_slot,
            "hit_rate": sum(o.cached_tokens for o in outs) / prompt_tokens,
            "ttft_mean_ms": statistics.fmean(ttfts) * 1e3, "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3,
            "input_tok_s": prompt_tokens / wall,
            "wr_replay_tokens": after["wr_replay_tokens"] - before["wr_replay_tokens"],
            "wr_replay_s": after["wr_replay_s"] - before["wr_replay_s"]}


@torch.no_grad()
def quality(model, tok, arm, prefixes, continuations) -> dict:
    """Continuation NLL and greedy agreement vs dense, through the arm's codec (and wr refresh).

    As in the engine, the checkpoint holds the state after prefix[:-1]; the last prefix token is recomputed
    from the loaded state, then the true continuation is scored (teacher forced) and 16 greedy tokens drawn."""
    if arm["w_max"] is None:
        return {"continuation_nll": None, "dense_nll": None, "greedy_agreement": 1.0}
    plan = make_plan(model_geometry(model), model_horizons(model), arm["w_max"], arm.get("selector", "decay"))
    codec = DascCodec(model.empty_states(1), plan, "ragged", arm.get("quant", "none"))
    codec.allocate(1)
    rows = local_rows(plan)
    nll, dense_nll, agree = [], [], []
    for prefix, cont in zip(prefixes, continuations):
        cached = prefix[:-1]
        kv, dense_state = ContiguousKV(), model.empty_states(1)
        _, dense_state = model(torch.tensor(cached), BatchLayout((len(cached),), (0,)), kv, dense_state)
        codec.store(0, dense_state)
        state = codec.load(0)
        if arm.get("policy") == "wr":
            storage = {layer: kv._store[(layer, 0)] for layer in model.attention_layers}
            refresh_local_units(model, [cached], storage, [torch.arange(len(cached))], state, plan, rows)
        feed = [prefix[-1]] + cont[:-1]
        nll.append(_nll(model, kv, state, len(cached), feed, cont))
        dense_nll.append(_nll(model, kv, dense_state, len(cached), feed, cont))
        agree.append(_agreement(_greedy(model, kv, dense_state, len(cached), prefix[-1]),
                                _greedy(model, kv, state, len(cached), prefix[-1])))
    return {"continuation_nll": statistics.fmean(nll), "dense_nll": statistics.fmean(dense_nll),
            "greedy_agreement": statistics.fmean(agree)}


def _fork(kv: ContiguousKV) -> ContiguousKV:
    out = ContiguousKV()
    out._store = {k: v.clone() for k, v in kv._store.items()}
    return out


def _nll(model, kv, state, start, feed, target) -> float:
    logits, _ = model(torch.tensor(feed), BatchLayout((len(feed),), (start,)), _fork(kv), state.clone(),
                      all_logits=True)
    return torch.nn.functional.cross_entropy(logits, torch.tensor(target)).item()


def _greedy(model, kv, state, start, token, n=16) -> list[int]:
    cache, st, out = _fork(kv), state.clone(), []
    for pos in range(start, start + n):
        logits, st = model(torch.tensor([token]), BatchLayout((1,), (pos,)), cache, st)
        token = int(logits[0].argmax())
        out.append(token)
    return out


def _agreement(a: list[int], b: list[int]) -> float:
    """Fraction of positions before the first disagreement (1.0: the whole continuation matches)."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return n / len(a)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kda-tiny")
    p.add_argument("--w-max", type=int, nargs="+", default=list(W_MAXES))
    p.add_argument("--prompt-len", type=int, nargs=2, default=[96, 160], help="range of prompt lengths")
    p.add_argument("--max-phase-prompts", type=int, default=600)
    p.add_argument("--phases", type=int, default=None, help="keep only the first N capacity boundaries")
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 123, 7])
    p.add_argument("--quality-prompts", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="write the figure here (PNG)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    dense_bytes = DenseCodec(model.empty_states(1)).bytes_per_slot
    budget_mb = 128 * dense_bytes / 2**20  # 128 dense physical slots
    all_arms = arms(args.w_max, 1234)
    # phase sizes from the capacity boundaries (ragged fp32 nr at each W_max)
    caps = [("dense", slots_for_budget(128 * dense_bytes, dense_bytes))]
    for w in args.w_max:
        plan = make_plan(model_geometry(model), model_horizons(model), w)
        per_slot = DascCodec(model.empty_states(1), plan).bytes_per_slot
        caps.append((f"W{w}", slots_for_budget(128 * dense_bytes, per_slot)))
    phases = [(name, min(math.ceil(n / 0.85), args.max_phase_prompts)) for name, n in caps][: args.phases]
    source = corpus_ids(tok, sum(q for _, q in phases) * args.prompt_len[1] + 192 * args.quality_prompts)
    rng = random.Random(0)
    phase_prompts, pos = [], 0
    for _, q in phases:
        prompts = []
        for _ in range(q):
            n = rng.randint(*args.prompt_len)
            prompts.append(source[pos : pos + n])
            pos += n
        phase_prompts.append(prompts)
    qual_prefixes = [source[pos + 192 * i : pos + 192 * i + 160] for i in range(args.quality_prompts)]
    qual_conts = [source[pos + 192 * i + 160 : pos + 192 * i + 192] for i in range(args.quality_prompts)]
    config = {"model": args.model, "budget_mb": round(budget_mb, 3), "dense_bytes_per_slot": dense_bytes,
              "phases": phases, "prompt_len": args.prompt_len, "seeds": args.seeds}
    print(json.dumps(config), flush=True)
    record = start_run("bench_capacity", config, argv)
    results = []
    for arm in all_arms:
        per_seed = []
        for seed in args.seeds:
            phase_rows = [run_phase(model, tok, arm, budget_mb, prompts, seed) for prompts in phase_prompts]
            per_seed.append(_pool(phase_rows, [len(pp) for pp in phase_prompts]))
        row = {"arm": arm["name"], **{k: statistics.fmean(r[k] for r in per_seed) for k in per_seed[0]}}
        row.update(quality(model, tok, arm, qual_prefixes, qual_conts))
        results.append(row)
        print(json.dumps(row), flush=True)
    dense = results[0]
    for r in results:
        r["ttft_vs_dense"] = r["ttft_mean_ms"] / dense["ttft_mean_ms"] - 1
        r["throughput_vs_dense"] = r["input_tok_s"] / dense["input_tok_s"] - 1
    md = "Means over seeds of replay-only metrics pooled over all phases; quality on held-out prefixes.\n\n"
    md += table(["arm", "slots", "bytes/slot", "hit rate", "TTFT mean ms", "TTFT p90 ms", "input tok/s",
                 "TTFT vs dense", "tok/s vs dense", "wr replay tok", "cont. NLL", "dense NLL", "greedy agree"],
                [[r["arm"], int(r["slots"]), int(r["bytes_per_slot"]), r["hit_rate"], r["ttft_mean_ms"],
                  r["ttft_p90_ms"], r["input_tok_s"], f"{r['ttft_vs_dense']:+.1%}", f"{r['throughput_vs_dense']:+.1%}",
                  int(r["wr_replay_tokens"]), "-" if r["continuation_nll"] is None else r["continuation_nll"],
                  "-" if r["dense_nll"] is None else r["dense_nll"], r["greedy_agreement"]] for r in results])
    if args.plot:
        _plot(results, args.plot)
        md += f"\n\n![capacity]({args.plot.split('/', 1)[-1] if args.plot.startswith('docs/') else args.plot})\n"
    publish(record, args.model, {"rows": results}, md, args.out, "Capacity: dasc vs dense at a fixed budget")


def _pool(rows: list[dict], weights: list[int]) -> dict:
    """Combine phases: request-weighted means (hit rate token-weighted via prompt counts is close enough)."""
    total = sum(weights)
    return {k: sum(r[k] * w for r, w in zip(rows, weights)) / total for k in rows[0]}


def _plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = [r["arm"] for r in results]
    for ax, key, label in zip(axes, ("slots", "hit_rate", "ttft_mean_ms"), ("slots", "hit rate", "mean TTFT (ms)")):
        ax.bar(range(len(results)), [r[key] for r in results],
               color=["gray" if n == "dense" else ("tab:orange" if "random" in n else "tab:blue") for n in names])
        ax.set_xticks(range(len(results)), names, rotation=90, fontsize=6)
        ax.set_title(label)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

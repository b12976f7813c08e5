"""Where a lossy checkpoint sits and what is recomputed after loading it:
`python -m loadtest.bench_placement --model kda-tiny [--suffix 16] [--out docs/benchmarks.md]`.

Why: dasc-nr zero-fills the units whose horizon is below W_max. Those units hold the last few tokens, so a hit
that loads a checkpoint at `prompt_len - 1` and recomputes one token starts generation with them nearly empty.
`EngineConfig.recompute_tail` (k = ceil(recompute_tail * W_max) tokens) moves the prompt-end checkpoint of a dasc
setting k tokens before the end and makes a dasc load leave at least k + 1 tokens to recompute with the full
model, which rebuilds the short units. This script measures k against fidelity and cost.

Protocol, per model: held-out prompts (`app.calibrate.held_out_prompts`, the allowance's prompt set: prefixes of
256, 640 and 1152 tokens), each a prefix plus `--suffix` new tokens (0: the same prompt again). Every arm is a
fresh engine that serves every prefix once (one output token; this stores its prompt-end checkpoint), then
every prompt as a hit, teacher-forced along the dense run's greedy tokens (GREEDY_TOKENS of them); the dense
reference is a cold engine (no cache) whose picks are its own argmax. Per arm, from the logits the engine
computed at each forced position:
  - top-1: the share of positions whose argmax is the dense token;
  - greedy: the share of prompts whose every position agrees (then a greedy run reproduces the dense tokens
    exactly: both see the same inputs) and the mean share before the first disagreement;
  - KL(dense || arm) per token, mean and max;
  - hit rate (cached prompt tokens over prompt tokens) and the tokens recomputed per hit (the TTFT cost).
Arms: dense checkpoints, then at each W_max and storage (fp32, INT8) nr with k in {0 (the old placement), 16,
32, 64, W, 2W, 4W} and wr with k 0 (the paper's refresh, for reference). No interval or generation-end checkpoints.
The figures are deterministic. Timing (`--timing-repeats`): the TTFT of one hit of a 640-token prompt served
alone, nr fp32, per k; median of the repeats, and its ratio to k 0 and to a cold run, in the same run.

Results: loadtest/results/bench_placement_cpu.json, variant `<model>/suffix<N>`; --out DOC replaces that
variant's block in DOC (loadtest/sections.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from app.calibrate import held_out_prompts
from app.dasc.allowance import GREEDY_TOKENS
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.models.loader import load_model, resolve_model_dir
from app.models.tokenizer import Tokenizer
from loadtest.common import median, start_run, table
from loadtest.sections import publish

W_MAXES = (16, 64, 128)
FIXED_TAILS = (0, 16, 32, 64)
PRIME = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
FORCED = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=1.0, ignore_eos=True)  # logits come back


def arms(w_maxes) -> list[dict]:
    out = [{"name": "dense", "w_max": None, "policy": "nr", "quant": "none", "tail": 0}]
    for w in w_maxes:
        for quant in ("none", "int8"):
            storage = "int8" if quant == "int8" else "fp32"
            for k in tails(w):
                out.append({"name": f"nr-W{w}-{storage}-k{k}", "w_max": w, "policy": "nr", "quant": quant, "tail": k})
            out.append({"name": f"wr-W{w}-{storage}-k0", "w_max": w, "policy": "wr", "quant": quant, "tail": 0})
    return out


def tails(w_max: int) -> list[int]:
    return sorted(set(FIXED_TAILS) | {w_max, 2 * w_max, 4 * w_max})


def engine_for(model, tok, arm: dict | None, n: int) -> Engine:
    """Room for every prompt at once and every checkpoint it stores (none is evicted); None: a cold engine."""
    common = dict(max_running=n, store_generation_end=False, interval=0)
    if arm is None:
        return Engine(model, tok, EngineConfig(enable_cache=False, **common))
    return Engine(model, tok, EngineConfig(w_max=arm["w_max"], policy=arm["policy"], quant=arm["quant"],
                                           recompute_tail=arm["tail"] / (arm["w_max"] or 1), checkpoint_slots=4 * n,
                                           **common))


class Forcing:
    """Wraps `engine.run_works`: a registered request is fed its given tokens (or, given None, its own argmax)
    instead of samples, and the log-softmax of the logits at each of its positions is kept."""

    def __init__(self, engine: Engine) -> None:
        self.tokens: dict[str, list[int] | None] = {}
        self.logprobs: dict[str, list[torch.Tensor]] = {}
        run = engine.run_works

        def forcing(works):
            picked, logits = run(works)
            for w in works:
                rid = w.seq.request_id
                if rid not in self.tokens or id(w.seq) not in logits:
                    continue
                row = torch.log_softmax(logits.pop(id(w.seq)).float(), -1)
                self.logprobs.setdefault(rid, []).append(row)
                want = self.tokens[rid]
                picked[id(w.seq)] = int(row.argmax()) if want is None else want[len(w.seq.output_ids)]
            return picked, logits

        engine.run_works = forcing


def forced_run(engine: Engine, prompts: list[list[int]], tokens: list[list[int]] | None):
    """Serve every prompt along `tokens` (None: its own argmax) -> (per prompt [T, vocab] log-probs, outputs)."""
    forcing = Forcing(engine)
    ids = []
    for i, p in enumerate(prompts):
        ids.append(engine.add_request(p, FORCED))
        forcing.tokens[ids[-1]] = None if tokens is None else tokens[i]
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return [torch.stack(forcing.logprobs[r]) for r in ids], [final[r] for r in ids]


def measure(model, tok, arm: dict, prefixes, prompts, dense_lp, dense_tokens) -> dict:
    engine = engine_for(model, tok, arm, len(prompts))
    engine.generate(prefixes, PRIME)
    before = engine.snapshot()
    lps, outs = forced_run(engine, prompts, dense_tokens)
    after = engine.snapshot()
    want = [max(0, len(x) - 1 - engine.cfg.tail) for x in prefixes]
    if [o.cached_tokens for o in outs] != want:
        raise RuntimeError(f"{arm['name']}: the hits did not resume from their prefixes' prompt-end checkpoints")
    first_miss, top1, kl = [], [], []
    for lp, ref, toks in zip(lps, dense_lp, dense_tokens):
        agree = (lp.argmax(-1) == torch.tensor(toks)).tolist()
        first_miss.append(agree.index(False) if False in agree else len(agree))
        top1 += agree
        kl += (ref.exp() * (ref - lp)).sum(-1).clamp_min(0).tolist()
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(o.cached_tokens for o in outs)
    return {"arm": arm["name"], "w_max": arm["w_max"], "policy": arm["policy"], "quant": arm["quant"],
            "tail": arm["tail"], "greedy_exact": sum(m == GREEDY_TOKENS for m in first_miss) / len(prompts),
            "greedy_prefix": statistics.fmean(m / GREEDY_TOKENS for m in first_miss),
            "top1": statistics.fmean(top1), "kl_mean": statistics.fmean(kl), "kl_max": max(kl),
            "hit_rate": cached / prompt_tokens, "recomputed_per_hit": (prompt_tokens - cached) / len(prompts),
            "replayed_tokens": after["replayed_tokens"] - before["replayed_tokens"],
            "wr_replay_tokens": after["wr_replay_tokens"] - before["wr_replay_tokens"]}


def ttft_row(model, tok, prompt: list[int], w_max: int, tails, repeats: int) -> dict:
    """Median TTFT (ms) of one hit of `prompt` served alone, per tail, and of a cold run."""
    cold = engine_for(model, tok, None, 1)
    out = {"cold": median([_ttft(cold, prompt) for _ in range(repeats)])}
    for k in tails:
        engine = engine_for(model, tok, {"w_max": w_max, "policy": "nr", "quant": "none", "tail": k}, 1)
        engine.generate([prompt], PRIME)
        out[k] = median([_ttft(engine, prompt) for _ in range(repeats)])
    return out


def _ttft(engine: Engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    engine.generate([prompt], PRIME)
    return (time.perf_counter() - t0) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kda-tiny")
    p.add_argument("--w-max", type=int, nargs="+", default=list(W_MAXES))
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--suffix", type=int, default=16, help="new tokens after the cached prefix (0: a repeat)")
    p.add_argument("--timing-repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    held = held_out_prompts(tok, args.prompts)
    prefixes = [h.prefix for h in held]
    prompts = [h.prefix + h.suffix[: args.suffix] for h in held]
    config = {"model": args.model, "prompts": args.prompts, "prefix_tokens": sorted({len(x) for x in prefixes}),
              "suffix": args.suffix, "greedy_tokens": GREEDY_TOKENS, "w_max": args.w_max,
              "fixed_tails": FIXED_TAILS, "relative_tails": [1, 2, 4],
              "threads": args.threads, "timing_repeats": args.timing_repeats}
    print(json.dumps(config), flush=True)
    record = start_run("bench_placement", config, argv)
    dense_lp, dense_outs = forced_run(engine_for(model, tok, None, len(prompts)), prompts, None)
    dense_tokens = [o.output_ids for o in dense_outs]
    rows = []
    for arm in arms(args.w_max):
        rows.append(measure(model, tok, arm, prefixes, prompts, dense_lp, dense_tokens))
        print(json.dumps(rows[-1]), flush=True)
    timing = []
    if args.timing_repeats:
        mid = next(h.prefix + h.suffix[: args.suffix] for h in held if len(h.prefix) == 640)
        for w in args.w_max:
            timing.append({"w_max": w, "ttft_ms": ttft_row(model, tok, mid, w, tails(w), args.timing_repeats)})
            print(json.dumps(timing[-1]), flush=True)
    publish(record, f"{args.model}/suffix{args.suffix}", {"rows": rows, "timing": timing}, _markdown(rows, timing),
            args.out, "Checkpoint placement and recompute tail after a lossy load",
            title=f"{args.model}, {'a repeated prompt' if args.suffix == 0 else f'{args.suffix} new tokens'}")


def _markdown(rows: list[dict], timing: list[dict]) -> str:
    md = ("Teacher-forced along the dense greedy tokens; k: prompt tokens recomputed before the last one after a "
          "lossy load (`recompute_tail`).\n\n")
    md += table(["arm", "greedy exact", "greedy prefix", "top-1", "KL mean", "KL max", "hit rate",
                 "recomputed/hit", "wr replay tok"],
                [[r["arm"], r["greedy_exact"], r["greedy_prefix"], r["top1"], r["kl_mean"], r["kl_max"], r["hit_rate"],
                  r["recomputed_per_hit"], r["wr_replay_tokens"]] for r in rows])
    if timing:
        tails = sorted({k for t in timing for k in t["ttft_ms"] if k != "cold"}, key=int)
        md += "\n\nTTFT of one hit served alone, nr fp32, median ms (ratio to k 0; cold run for scale):\n\n"
        md += table(["W_max", "cold", *[f"k{k}" for k in tails]],
                    [[f"W{t['w_max']}", t["ttft_ms"]["cold"],
                      *[(f"{t['ttft_ms'][k]:.3g} (x{t['ttft_ms'][k] / t['ttft_ms'][0]:.2f})" if k in t["ttft_ms"]
                         else "-") for k in tails]] for t in timing])
    return md


if __name__ == "__main__":
    main()

"""Engine benchmark: `python -m loadtest.bench_engine --model kda-tiny [--repeats 5] [--out docs/benchmarks.md]`.

In one run, on one checkpoint:
1. TTFT for prompts of 256..2048 tokens: cold (no cache), hit at the prompt end, hit that replays from an
   earlier interval checkpoint (the prompt shares all but its last `--diverge` tokens with a cached one), and
   for each hit the time to prefill only its uncached suffix with the model alone (state and KV ready), which
   is the floor a cache hit can reach. Each hit and its floor are timed --hit-samples times per repeat, in
   pairs (the floor right after its hit, so a slow spell of the machine hits both; a replay on a freshly
   filled engine each time); a cell's ratio is the median of the paired ratios. Every engine timed has
   first served an unrelated prompt of the same length (warm, as in serving). Also transformers'
   `generate` (1 new token) as the baseline.
2. Decode tokens/s against batch size, ours vs transformers' `generate` on equal-length prompts; each repeat
   times both (and, with --compile-decode, the uncompiled engine), and a ratio is the median of the repeats'
   own ratios.
3. Serving throughput on a mixed batch: 16 requests with prompt lengths and output budgets drawn from a seeded
   generator, end to end (prefill included), ours (continuous batching) vs `generate` on the same 16 as one
   left-padded static batch, which runs until its longest request is done; output tokens per second counts
   each request's own budget.
Every figure is the median of --repeats runs; ratios are against baselines measured in the same run. Sections 2
and 3 build each engine once and reuse it in every repeat, as a server keeps its engine; with --compile-decode
they time compiled engines (decode steps; on the CPU also the prefill passes, which section 1 then times too).
4. host: the engine's host work per sequence per step, and serving: the serving path's cost per token at one
   stream (loadtest/engine_host.py).

Results: loadtest/results/bench_engine_<cpu|cuda>.json, one variant per section, `<model>[-bfloat16][-graphs]
[-compiled]/<section>` (e.g. `kda-tiny-compiled/decode`); --out DOC replaces those variants' blocks in DOC
(loadtest/sections.py).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.models.batch import BatchLayout, ContiguousKV
from app.models.loader import cast_model, load_model, resolve_model_dir
from app.models.tokenizer import Tokenizer
from app.training.corpus import read_source, split_files, stdlib_files
from loadtest.common import median, start_run, table, timed
from loadtest.engine_host import PROMPT, bench_host, bench_serving
from loadtest.sections import publish


class Place(NamedTuple):
    """Where the engines, the floor and the baseline run: `cpu` float32, or e.g. `cuda` bfloat16; `graphs`:
    the engines replay decode steps from CUDA graphs; `compiled`: their decode steps go through torch.compile."""

    device: str = "cpu"
    dtype: str = "float32"
    graphs: bool = False
    compiled: bool = False

    def config(self, **kw) -> EngineConfig:
        cpu_compiled = self.compiled and self.device == "cpu"  # (compiled prefill passes are the CPU's)
        return EngineConfig(device=self.device, dtype=self.dtype, decode_graphs=self.graphs,
                            compile_decode=self.compiled, compile_prefill=cpu_compiled,
                            compile_background=False, **kw)

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


CPU = Place()

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
SAMPLED = dict(temperature=0.7, top_p=0.9)  # the decode_sampled section's settings, ours and generate's
SECTIONS = {"ttft": "TTFT", "decode": "decode, greedy", "decode_sampled": "decode, sampled", "mixed": "mixed batch",
            "host": "host work per sequence", "serving": "serving path per token"}
SERVING_ARMS = ("local", "local-stream", "ray")


def corpus_ids(tok: Tokenizer, n: int) -> list[int]:
    _, held_out = split_files(stdlib_files())
    ids: list[int] = []
    for f in held_out:
        ids += tok.encode(read_source(f))
        if len(ids) >= n:
            return ids[:n]
    raise RuntimeError("held-out corpus too small")


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    out = engine.generate([prompt], ONE)[0][0]
    return out.ttft_s, out.cached_tokens


@torch.no_grad()
def suffix_prefill(model, prompt: list[int], cached: int, place: Place = CPU) -> float:
    """Model-only time to compute prompt[cached:] given the state and KV after prompt[:cached] (the model
    places its tensors on its inputs' device, as in the engine's worker)."""
    kv, states = ContiguousKV(), model.empty_states(1)
    if cached:
        _, states = model(torch.tensor(prompt[:cached], device=place.device), BatchLayout((cached,), (0,)), kv, states)
    n = len(prompt) - cached
    place.sync()
    t, _ = timed(lambda: model(torch.tensor(prompt[cached:], device=place.device), BatchLayout((n,), (cached,)), kv,
                               states)[0].argmax().item())
    return t


@torch.no_grad()
def hf_generate_time(ref, prompts: list[list[int]], new_tokens: int, place: Place = CPU,
                     sampled: bool = False) -> float:
    """`generate` on one batch, left-padded (pad id 0, masked) where lengths differ, for `new_tokens` steps;
    greedy, or sampling as `SAMPLED` (top_k off, which `generate` would otherwise set to 50)."""
    how = dict(do_sample=True, top_k=0, **SAMPLED) if sampled else dict(do_sample=False)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=ref.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=ref.device)
    t, _ = timed(lambda: (ref.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                       min_new_tokens=new_tokens, pad_token_id=0, **how), place.sync()))
    return t


def filled(model, tok, interval: int, prompt: list[int], warm: list[int] = (), place: Place = CPU) -> Engine:
    """A cache-enabled engine that has served `prompt` once (its prompt-end and interval checkpoints) and,
    first, the unrelated prompt `warm`: a warm engine, as in serving (a fresh engine's first touches of its
    pools and code paths would otherwise be charged to the hit being timed)."""
    engine = Engine(model, tok, place.config(interval=interval, chunk_size=2048, max_tokens_per_step=4096,
                                             checkpoint_slots=64))
    if warm:
        ttft(engine, list(warm))
    ttft(engine, prompt)
    return engine


def bench_ttft(model, tok, ref, lengths, repeats, interval, diverge, hit_samples, place: Place = CPU) -> list[dict]:
    source = corpus_ids(tok, max(lengths) * (repeats + 2) * 2)
    rows = []
    for L in lengths:
        cold, end_hit, replay, floor_end, floor_replay, hf, cached_end, cached_replay = ([] for _ in range(8))
        ratio_end, ratio_replay = [], []
        spare = source[-L:]  # shares no prefix with any base or branch below: warms engines up
        for r in range(repeats):
            base = source[(2 * r) * L : (2 * r + 1) * L]
            other = source[(2 * r + 1) * L : (2 * r + 2) * L]
            cold_engine = Engine(model, tok, place.config(enable_cache=False, chunk_size=2048,
                                                          max_tokens_per_step=4096))
            ttft(cold_engine, spare)
            cold.append(ttft(cold_engine, base)[0])
            hot = filled(model, tok, interval, base, spare, place)
            # each the same work (a prompt-end hit stores nothing new), paired with its floor
            pairs = [_paired(lambda hot=hot, base=base: ttft(hot, base),
                             lambda c, base=base: suffix_prefill(model, base, c, place))
                     for _ in range(hit_samples)]
            _collect(pairs, end_hit, floor_end, cached_end, ratio_end)
            # a replay stores its branch point, so a second one would hit there: a freshly filled engine each
            branch = base[: L - diverge] + other[:diverge]
            def replay_ttft(base=base, branch=branch, spare=spare):
                return ttft(filled(model, tok, interval, base, spare, place), branch)

            pairs = [_paired(replay_ttft, lambda c, branch=branch: suffix_prefill(model, branch, c, place))
                     for _ in range(hit_samples)]
            _collect(pairs, replay, floor_replay, cached_replay, ratio_replay)
            hf.append(hf_generate_time(ref, [base], 1, place))
        row = {"prompt_len": L, "cold_ms": median(cold) * 1e3, "hf_generate_ms": median(hf) * 1e3,
               "hit_end_ms": median(end_hit) * 1e3, "hit_end_cached": median(cached_end),
               "hit_end_floor_ms": median(floor_end) * 1e3,
               "hit_replay_ms": median(replay) * 1e3, "hit_replay_cached": median(cached_replay),
               "hit_replay_floor_ms": median(floor_replay) * 1e3,
               "hit_end_over_floor": median(ratio_end), "hit_replay_over_floor": median(ratio_replay)}
        row["cold_over_hf"] = row["cold_ms"] / row["hf_generate_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _paired(hit, floor) -> tuple[float, float, int]:
    """(hit seconds, floor seconds, cached tokens): the floor timed right after its hit."""
    t, cached = hit()
    return t, floor(cached), cached


def _collect(pairs, hits: list, floors: list, cached: list, ratios: list) -> None:
    """One repeat: the medians of its hits and floors, its cached length, and every paired ratio."""
    hits.append(median([t for t, _, _ in pairs]))
    floors.append(median([f for _, f, _ in pairs]))
    cached.append(pairs[0][2])
    ratios.extend(t / f for t, f, _ in pairs)


class Engines:
    """Engines built once per configuration and reused by every repeat (a compiled engine's start compiles each
    batch bucket from scratch, minutes on two cores); the decode and mixed sections run them without a cache."""

    def __init__(self, model, tok) -> None:
        self.model, self.tok, self._built = model, tok, {}

    def get(self, cfg: EngineConfig) -> Engine:
        if cfg not in self._built:
            self._built[cfg] = Engine(self.model, self.tok, cfg)
        return self._built[cfg]


def bench_decode(model, tok, ref, batches, repeats, new_tokens=64, prompt_len=64, place: Place = CPU,
                 sampled: bool = False, engines: Engines | None = None) -> list[dict]:
    source = corpus_ids(tok, prompt_len * max(batches))
    engines = engines or Engines(model, tok)
    rows = []
    for b in batches:
        prompts = [source[i * prompt_len : (i + 1) * prompt_len] for i in range(b)]
        how = SAMPLED if sampled else {"temperature": 0.0}
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, **how)
        ours, eager, theirs = [], [], []
        for _ in range(repeats):
            places = [place, place._replace(compiled=False)] if place.compiled else [place]
            for where, rates in zip(places, [ours, eager]):  # compiled: the eager engine too, as its baseline
                engine = engines.get(where.config(enable_cache=False, max_running=max(batches)))
                engine.generate(prompts, ONE)  # warm-up: a first prefill of this shape pays one-time costs
                first = timed(engine.generate, prompts, ONE)[0]
                full = timed(engine.generate, prompts, params)[0]
                rates.append(b * (new_tokens - 1) / (full - first))
            hf_first = hf_generate_time(ref, prompts, 1, place, sampled)
            hf_full = hf_generate_time(ref, prompts, new_tokens, place, sampled)
            theirs.append(b * (new_tokens - 1) / (hf_full - hf_first))
        # ratios: the median of each repeat's own ratio, so a slow spell of the machine hits both sides of it
        ratios = [o / t for o, t in zip(ours, theirs)]
        row = {"batch": b, "ours_tok_s": median(ours), "hf_tok_s": median(theirs), "speedup": median(ratios),
               "repeat_ratios": ratios}
        if eager:
            row["eager_tok_s"] = median(eager)
            row["over_eager"] = median([o / e for o, e in zip(ours, eager)])
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_mixed(model, tok, ref, repeats, batch=16, prompt_lens=(32, 512), new_tokens=(16, 128), seed=0,
                place: Place = CPU, engines: Engines | None = None) -> dict:
    rng = random.Random(seed)
    source = corpus_ids(tok, prompt_lens[1] * batch)
    lens = [rng.randint(*prompt_lens) for _ in range(batch)]
    budgets = [rng.randint(*new_tokens) for _ in range(batch)]
    prompts = [source[i * prompt_lens[1] : i * prompt_lens[1] + n] for i, n in enumerate(lens)]
    useful = sum(budgets)
    ours, theirs = [], []
    engine = (engines or Engines(model, tok)).get(place.config(enable_cache=False, max_running=batch))
    for _ in range(repeats):
        for p, b in zip(prompts, budgets):
            engine.add_request(p, SamplingParams(max_tokens=b, temperature=0.0, ignore_eos=True))
        t, _ = timed(_drain, engine)
        ours.append(useful / t)
        theirs.append(useful / hf_generate_time(ref, prompts, max(budgets), place))
    row = {"batch": batch, "prompt_lens": lens, "budgets": budgets, "ours_tok_s": median(ours),
           "hf_tok_s": median(theirs)}
    row["speedup"] = row["ours_tok_s"] / row["hf_tok_s"]
    print(json.dumps(row), flush=True)
    return row


def _drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kda-tiny")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--interval", type=int, default=128)
    p.add_argument("--diverge", type=int, default=96, help="replay case: tokens after the shared prefix")
    p.add_argument("--hit-samples", type=int, default=5,
                   help="hits (and their floors) timed this many times per repeat, median taken")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu | cuda: engines, floor and baseline all run there")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--decode-graphs", action="store_true", help="engines replay decode steps from CUDA graphs")
    p.add_argument("--compile-decode", action="store_true",
                   help="engines run compiled decode steps (decode, mixed, host and serving sections; the decode "
                        "sections also time eager engines)")
    p.add_argument("--sections", nargs="+", default=["ttft", "decode", "mixed", "host"], choices=list(SECTIONS))
    p.add_argument("--host-batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--serving-arms", nargs="+", default=list(SERVING_ARMS), choices=SERVING_ARMS)
    p.add_argument("--out", default=None, help="replace this run's blocks in this markdown file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    place = Place(args.device, args.dtype, args.decode_graphs, args.compile_decode)
    dtype = getattr(torch, args.dtype)
    model, tok = cast_model(load_model(model_dir).to(args.device), dtype).eval(), Tokenizer.from_dir(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    record = start_run("bench_engine", {k: v for k, v in vars(args).items() if k != "out"}, argv,
                       "cuda" if args.device.startswith("cuda") else "cpu")
    # with --compile-decode the TTFT section's engines run compiled prefill passes (on the CPU): packages from the cache
    ttft_rows = bench_ttft(model, tok, ref, args.lengths, args.repeats, args.interval, args.diverge,
                           args.hit_samples, place) \
        if "ttft" in args.sections else []
    engines = Engines(model, tok)
    decode_rows = bench_decode(model, tok, ref, args.batches, args.repeats, place=place, engines=engines) \
        if "decode" in args.sections else []
    sampled_rows = bench_decode(model, tok, ref, args.batches, args.repeats, place=place, sampled=True,
                                engines=engines) if "decode_sampled" in args.sections else []
    mixed = bench_mixed(model, tok, ref, args.repeats, place=place, engines=engines) \
        if "mixed" in args.sections else None
    source = corpus_ids(tok, PROMPT * max(args.host_batches + [2]))
    host = bench_host(model, tok, source, args.host_batches, args.repeats, place) if "host" in args.sections else []
    serving = [bench_serving(args.model, model, tok, source, args.repeats, place, args.serving_arms)] \
        if "serving" in args.sections else []
    results = {"ttft": ttft_rows, "decode": decode_rows, "decode_sampled": sampled_rows,
               "mixed": [mixed] if mixed else [], "host": host, "serving": serving}
    options = [(tag, words) for tag, words, on in [(args.dtype, args.dtype, args.dtype != "float32"),
                                                   ("graphs", "decode graphs", args.decode_graphs),
                                                   ("compiled", "compiled decode", args.compile_decode)] if on]
    name = Path(args.model).name
    label, words = "-".join([name, *(t for t, _ in options)]), ", ".join([name, *(w for _, w in options)])
    for section in (s for s in SECTIONS if s in args.sections):
        publish(record, f"{label}/{section}", {"rows": results[section]}, _markdown(section, results[section], args),
                args.out, "Engine: TTFT, decode and mixed batches", f"{words}: {SECTIONS[section]}")


def _markdown(section: str, rows: list[dict], args) -> str:
    """One section's legend and table."""
    if section == "ttft":
        return _ttft_markdown(rows, args)
    if section == "mixed":
        return _mixed_markdown(rows[0], args)
    if section == "host":
        return _host_markdown(rows, args)
    if section == "serving":
        return _serving_markdown(rows[0], args)
    return _decode_markdown(rows, section == "decode_sampled", args)


def _ttft_markdown(rows: list[dict], args) -> str:
    legend = ("TTFT in ms (median over %d repeats of the median of %d samples per repeat for hits and floors). "
              "*floor*: model-only prefill of the uncached suffix, timed right after each hit; *ratio*: median of "
              "those paired hit / floor ratios.\n\n" % (args.repeats, args.hit_samples))
    return legend + table(
        ["prompt", "cold", "HF generate", "hit@end", "cached", "floor", "ratio", "hit replay", "cached", "floor",
         "ratio"],
        [[r["prompt_len"], r["cold_ms"], r["hf_generate_ms"], r["hit_end_ms"], r["hit_end_cached"],
          r["hit_end_floor_ms"], r["hit_end_over_floor"], r["hit_replay_ms"], r["hit_replay_cached"],
          r["hit_replay_floor_ms"], r["hit_replay_over_floor"]] for r in rows])


def _host_markdown(rows: list[dict], args) -> str:
    legend = ("Host work per sequence per step, prefix cache on (loadtest/engine_host.py): *engine step* and "
              "*model-only step* (the worker's %s decode step rerun on the engine's last inputs) in ms, medians "
              "over %d repeats of 8 blocks of 4 steps, each block followed by its model-only twin; *host*: median "
              "of the blocks' (engine step - model-only step) / batch.\n\n"
              % ("compiled" if args.compile_decode else "eager padded", args.repeats))
    return legend + table(["batch", "engine step ms", "model-only ms", "host us/seq", "tok/s", "history bucket"],
                          [[r["batch"], r["step_ms"], r["model_ms"], r["host_us_per_seq"], r["tok_s"],
                            r["history_bucket"]] for r in rows])


def _serving_markdown(m: dict, args) -> str:
    legend = ("One 128-token answer to a 64-token prompt at one stream, ms per token (prefill included; median of "
              "%d answers per path; loadtest/engine_host.py): in the engine, through `app.api.local` (not streamed, "
              "streamed) and through the Ray service (one replica); *over engine*: the serving path's cost per "
              "token.\n\n" % (args.repeats * 6))
    rows = [[arm, m[arm], m[arm] - m["engine"]] for arm in ("engine", *SERVING_ARMS) if arm in m]
    return legend + table(["path", "ms/token", "over engine ms/token"], rows)


def _mixed_markdown(m: dict, args) -> str:
    legend = ("Mixed batch, end to end (median of %d): %d requests, prompt lengths %d-%d, output budgets %d-%d "
              "tokens (%d in all); HF generate runs them as one left-padded static batch for the longest budget.\n\n"
              % (args.repeats, m["batch"], min(m["prompt_lens"]), max(m["prompt_lens"]), min(m["budgets"]),
                 max(m["budgets"]), sum(m["budgets"])))
    return legend + table(["requests", "ours tok/s", "HF generate tok/s", "ratio"],
                          [[m["batch"], m["ours_tok_s"], m["hf_tok_s"], m["speedup"]]])


def _decode_markdown(rows: list[dict], sampled: bool, args) -> str:
    how = "greedy" if not sampled else (
        "sampling with temperature %(temperature)s, top-p %(top_p)s, top-k off, ours and HF alike" % SAMPLED)
    eager = ["ours eager", "compiled / eager"] if args.compile_decode else []
    hf_single = next((r["hf_tok_s"] for r in rows if r["batch"] == 1), None)
    return ("Decode tokens/s, %s (64-token prompts, 64 new tokens, median of %d). *HF generate*: one static batch of "
            "the same prompts; *HF one at a time*: its batch-1 rate, what a server without batching delivers at any "
            "load; *ratio*: the median of each repeat's own ours / HF generate%s:\n\n"
            % (how, args.repeats, "; *ours eager*: the same engine without compiled decode steps, timed in the "
               "same repeats (*compiled / eager*, a median of paired ratios too)" if eager else "")) + table(
        ["batch", "ours", *eager, "HF generate", "ratio", "ratio vs HF one at a time"],
        [[r["batch"], r["ours_tok_s"], *([r["eager_tok_s"], r["over_eager"]] if eager else []), r["hf_tok_s"],
          r["speedup"], r["ours_tok_s"] / hf_single if hf_single else "-"] for r in rows])


if __name__ == "__main__":
    main()

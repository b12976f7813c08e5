"""Speculative decoding (prompt lookup) against plain decoding, and what rolling recurrent state back costs:
`python -m loadtest.bench_spec [--model kda-tiny gdn-tiny] [--batches 1 4 16] [--compiled] [--out docs/benchmarks.md]`.

Workloads, prompts cut from the standard-library files the zoo's training held out:
  - edit: a 40-line snippet, a marker line, then the snippet's first two lines again: the answer repeats much of
    the prompt, as a code edit does (the zoo models copy it, so drafts are accepted);
  - free: the snippet's first line only: free generation, where drafts rarely match.
Arms, each a fresh engine without the prefix cache (decode is what is measured): plain (the engine's default,
eager decode path), spec (`spec: ngram`, default depth 4, replay rollback) and, with --compiled, plain with
`compile_decode` (its compile happens before timing). Each arm decodes `--max-tokens` tokens per sequence
(ignore_eos) at batch B, greedy and sampled (temperature 0.8, seeded). The arms run side by side, one engine step
each in turn, so that they share the machine's moods (this VM's speed drifts by 10% and more between seconds).
Each arm's clock sums its own steps while all its B sequences decode: from the step after the last first token
(prefill is not timed) to the step in which its first sequence finishes; tokens/s counts the tokens emitted
meanwhile. (Sequences that speculate well finish early; what follows is a smaller batch decoding, which measures
the closed batch's tail, not speculation. A server keeps its batch full with new requests.) Repeated `--repeats`
times: medians, and the median of the per-repeat ratios spec / plain (same prompts, same seconds).
Greedy spec output is checked token for token against plain (the run fails otherwise); for sampled output (coupled
to plain decoding's draws) the share of sequences equal to plain's is printed.

*accepted / verify* is accepted drafts per verify piece (vLLM's mean acceptance length, less 1). *tokens / step*
is the tokens a sequence emitted per step it took part in, steps without drafts included: the speedup a verify
step as cheap as a decode step would give. The targets printed: at batch 1 on edit, speedup >= 0.8 x tokens /
step (the mechanism costs at most a fifth of what it saves); on free, >= 0.97x at every batch.

Rollback bytes per draft token, per sequence: replay keeps each verified token's key, cumulative gate and
delta-rule correction per head (fp32) and its raw conv input; snapshot keeps a whole state (H x K x V fp32 and the
conv window) per drafted position. For the zoo models also measured (bytes the worker kept / drafts); for
Kimi-Linear-48B and Qwen3-Next-80B computed from their geometry (the plan tool's reading of config.json, on the
generated stand-in checkpoints of loadtest/fake_checkpoints.py).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from app.calibrate import held_out_prompts
from app.dasc import plan as plan_tool
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.engine.speculative import rollback_bytes_per_token
from app.models.loader import load_model, resolve_model_dir
from app.models.tokenizer import Tokenizer
from loadtest import fake_checkpoints
from loadtest.common import median, start_run, table
from loadtest.sections import publish

PRODUCTION = {"Kimi-Linear-48B": fake_checkpoints.write_kimi_linear_48b,
              "Qwen3-Next-80B": fake_checkpoints.write_qwen3_next_80b}
MARKER = "\n# the same code again, edited:\n"


def workloads(tok: Tokenizer, n: int) -> dict[str, list[list[int]]]:
    blocks = [tok.decode(p.prefix + p.suffix + p.continuation) for p in held_out_prompts(tok, n)]
    edit, free = [], []
    for text in blocks:
        lines = text.splitlines()[1:41]  # the first line may start mid-line
        snippet = "\n".join(lines)
        edit.append(tok.encode(snippet + MARKER + "\n".join(lines[:2]) + "\n"))
        free.append(tok.encode(lines[0] + "\n"))
    return {"edit": edit, "free": free}


class _Run:
    """One arm's requests of one repeat: its clock and counts (see `decode_rates`)."""

    def __init__(self, engine: Engine, prompts: list[list[int]], params: SamplingParams) -> None:
        self.engine = engine
        self.ids = [engine.add_request(p, params) for p in prompts]
        self.started, self.final = set(), {}
        self.counted = self.seq_steps = 0
        self.clock = 0.0
        self.window = "before"  # before -> open (every sequence decodes) -> closed (one finished)

    def step(self) -> None:
        t = time.perf_counter()
        outs = self.engine.step()
        dt = time.perf_counter() - t
        if self.window == "open":
            self.clock += dt
            for out in outs:
                if out.new_token_ids:
                    self.counted += len(out.new_token_ids)
                    self.seq_steps += 1
        for out in outs:
            self.started.add(out.request_id)
            if out.finished:
                self.final[out.request_id] = out.output_ids
        if self.window == "open" and self.final:
            self.window = "closed"
        elif self.window == "before" and len(self.started) == len(self.ids):
            self.window = "open"


def decode_rates(engines: dict[str, Engine], prompts: list[list[int]], params: SamplingParams) -> dict:
    """Per arm: tokens per second while all its sequences decode (from the step after the last first token to the
    step in which the first one finishes, timing only its own steps), its outputs, and the tokens each sequence
    emitted per step in that window (1 for plain decoding). The arms step in turn, one step each, in an order
    that rotates every round, so they share whatever the machine does meanwhile. (Reversing it instead made the
    first and last arms of three step twice in a row at every turn, on warm caches: plain read 2-4% fast against
    spec when spec drafted nothing.)"""
    runs = {arm: _Run(e, prompts, params) for arm, e in engines.items()}
    order = list(runs.values())
    while any(r.engine.has_unfinished() for r in order):
        for r in order:
            if r.engine.has_unfinished():
                r.step()
        order = order[1:] + order[:1]  # rotate: no arm always steps first, and none steps twice in a row
    return {arm: (r.counted / r.clock, [r.final[i] for i in r.ids], r.counted / max(r.seq_steps, 1))
            for arm, r in runs.items()}


def bench_model(name: str, batches, max_tokens: int, repeats: int, compiled: bool,
                max_batch: int | None = None) -> tuple[list[dict], dict]:
    d = resolve_model_dir(name)
    tok = Tokenizer.from_dir(d)
    model = load_model(d)
    prompts = workloads(tok, max(batches))
    arms = {"plain": {}, "spec": {"spec": "ngram", **({} if max_batch is None else {"spec_max_batch": max_batch})}}
    if compiled:
        arms["compiled"] = {"compile_decode": True, "compile_background": False}
    rows = []
    modes = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, seed=1)}
    for b in batches:
        engines = {arm: Engine(model, tok, EngineConfig(kv_slots=65536, max_running=b, enable_cache=False,
                                                        **kn)) for arm, kn in arms.items()}
        for e in engines.values():  # warm-up (and the compiled arm's compile)
            e.generate(prompts["edit"][:b], SamplingParams(max_tokens=4, temperature=0.0))
        for wl, ps in prompts.items():
            for mode, kw in modes.items():
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)
                rates = {arm: [] for arm in arms}
                per_step, same = [], []
                before = engines["spec"].snapshot()
                for _ in range(repeats):
                    outs = {}
                    for arm, (rate, outs[arm], tokens_per_step) in decode_rates(engines, ps[:b], params).items():
                        rates[arm].append(rate)
                        if arm == "spec":
                            per_step.append(tokens_per_step)
                    if mode == "greedy" and outs["spec"] != outs["plain"]:
                        raise AssertionError(f"{name} b{b} {wl}: greedy output with speculation differs from plain")
                    same.append(sum(s == p for s, p in zip(outs["spec"], outs["plain"])) / b)
                after = engines["spec"].snapshot()
                verifies = after["spec_verifies"] - before["spec_verifies"]
                drafted = after["spec_drafted_tokens"] - before["spec_drafted_tokens"]
                accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
                row = {"model": name, "batch": b, "workload": wl, "mode": mode,
                       **{f"{arm}_tok_s": median(r) for arm, r in rates.items()},
                       "speedup": median([s / p for s, p in zip(rates["spec"], rates["plain"])]),
                       "drafted": drafted, "accepted": accepted,
                       "mean_accepted": accepted / verifies if verifies else 0.0,
                       "tokens_per_step": median(per_step), "same_as_plain": min(same)}
                if compiled:
                    row["speedup_vs_compiled"] = median([s / c for s, c in zip(rates["spec"], rates["compiled"])])
                rows.append(row)
                print(row, flush=True)
    measured = measure_rollback_bytes(model, tok, prompts["edit"][:4], max_tokens)
    return rows, measured


def measure_rollback_bytes(model, tok, prompts, max_tokens: int) -> dict:
    """Bytes the worker kept per draft token in a greedy edit run, for each rollback mode."""
    out = {}
    for mode in ("replay", "snapshot"):
        engine = Engine(model, tok, EngineConfig(kv_slots=65536, enable_cache=False, spec="ngram", spec_rollback=mode))
        kept = drafted = 0
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            before = engine.telemetry.spec_drafted
            engine.step()
            kept += engine.worker.rollback_bytes()
            drafted += engine.telemetry.spec_drafted - before
        out[mode] = kept / drafted if drafted else None
    geo = [model.model.layers[i].mixer.geometry for i in model.linear_layers]
    out["computed"] = rollback_bytes_per_token([g.units for g in geo], geo[0].conv_channels, geo[0].conv_window,
                                               model.model.embed_tokens.weight.element_size())
    return out


def production_bytes() -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, write in PRODUCTION.items():
            ckpt = plan_tool.read_checkpoint(write(f"{tmp}/{name}", ballast=False))
            out[name] = rollback_bytes_per_token(list(ckpt.geometry), ckpt.conv_channels, ckpt.conv_window,
                                                 plan_tool.CONV_ELEM_BYTES)
    return out


def _markdown(rows: list[dict], zoo: dict, prod: dict, compiled: bool) -> str:
    headers = ["model", "batch", "workload", "mode", "plain tok/s", "spec tok/s", "speedup", "accepted / verify",
               "tokens / step", "= plain", "target"]
    if compiled:
        headers[5:5] = ["compiled tok/s"]
        headers.insert(7 + 1, "vs compiled")
    body = []
    for r in rows:
        target = (f">= {0.8 * r['tokens_per_step']:.2f}x" if (r["batch"] == 1 and r["workload"] == "edit")
                  else ">= 0.97x" if r["workload"] == "free" else "")
        ok = "" if not target else (" met" if r["speedup"] >= float(target.split()[1][:-1]) else " MISSED")
        line = [r["model"], r["batch"], r["workload"], r["mode"], f"{r['plain_tok_s']:.0f}", f"{r['spec_tok_s']:.0f}",
                f"{r['speedup']:.2f}x", f"{r['mean_accepted']:.2f}", f"{r['tokens_per_step']:.2f}",
                f"{r['same_as_plain']:.2f}", target + ok]
        if compiled:
            line[5:5] = [f"{r['compiled_tok_s']:.0f}"]
            line.insert(8, f"{r['speedup_vs_compiled']:.2f}x")
        body.append(line)
    text = table(headers, body)
    brows = [[m, f"{v['replay']:.0f}" if v.get("replay") else "-", f"{v['snapshot']:.0f}" if v.get("snapshot") else "-",
              v["computed"]["replay"], v["computed"]["snapshot"],
              f"{v['computed']['snapshot'] / v['computed']['replay']:.1f}x"] for m, v in {**zoo, **prod}.items()]
    text += "\n\nRollback state per draft token, one sequence (measured: bytes the worker kept / drafts):\n\n"
    text += table(["model", "replay measured", "snapshot measured", "replay computed", "snapshot computed",
                   "snapshot / replay"], brows)
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", nargs="+", default=["kda-tiny", "gdn-tiny"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compiled", action="store_true", help="also plain decoding with compile_decode")
    p.add_argument("--spec-max-batch", type=int, default=None,
                   help="the spec arm's spec_max_batch (default: the engine's); a run with it is a variant of its own")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    run = start_run("bench_spec", {"models": args.model, "batches": args.batches, "max_tokens": args.max_tokens,
                                   "repeats": args.repeats, "threads": args.threads, "compiled": args.compiled,
                                   "spec_max_batch": args.spec_max_batch})
    rows, zoo = [], {}
    for name in args.model:
        r, zoo[name] = bench_model(name, args.batches, args.max_tokens, args.repeats, args.compiled,
                                   args.spec_max_batch)
        rows += r
    prod = production_bytes()
    variant = "decode" if args.spec_max_batch is None else f"decode-max-batch-{args.spec_max_batch}"
    publish(run, variant, {"rows": rows, "rollback_bytes": {**zoo, **{k: {"computed": v} for k, v in prod.items()}}},
            _markdown(rows, zoo, {k: {"computed": v} for k, v in prod.items()}, args.compiled), args.out,
            "Speculative decoding", None if args.spec_max_batch is None else
            f"With spec_max_batch {args.spec_max_batch} (drafts at every batch size up to it)")


if __name__ == "__main__":
    main()

"""Step-thread benchmark: `python -m loadtest.bench_async [--threads 2] [--repeats 5] [--out docs/benchmarks.md]`.

Serves the same concurrent requests through `AsyncEngine` with the engine built three ways: in the main
thread and handed over (how replicas built it before); built by the step thread from a factory (how they
build it now); and in the main thread with torch limited to one thread while building (the check of the
cause: the main thread then never starts OpenMP worker threads). Each run is a fresh process, since what
differs is which threads of the process started OpenMP teams; the forms alternate, and each run times
several rounds after a warm-up round.

The cause (GNU OpenMP, which torch's CPU wheels use): each thread that starts a parallel region gets its own
pool of worker threads, and libgomp counts all of them. Once the count exceeds the CPUs (the main thread's
idle workers plus the step thread's team), every team waits for work with a short "throttled" spin and then
sleeps, so each of the step thread's parallel ops pays for waking its workers.

Results: loadtest/results/bench_async_cpu.json, variant `<model>/threads-<N>`; --out DOC replaces that variant's
block in DOC (loadtest/sections.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import torch

from loadtest.common import median, start_run, table, timed
from loadtest.sections import publish

FORMS = ("main thread", "step thread", "main thread, 1 thread")


def _one_run(model: str, form: str, requests: int, tokens: int, rounds: int, threads: int) -> list[float]:
    """Inside a child process: seconds per round of `requests` concurrent greedy requests."""
    from app.engine.async_engine import AsyncEngine
    from app.engine.config import EngineConfig
    from app.engine.engine import Engine
    from app.engine.request import SamplingParams
    from app.models.loader import load_model, resolve_model_dir
    from app.models.tokenizer import Tokenizer
    from loadtest.bench_engine import corpus_ids

    torch.set_num_threads(threads)
    model_dir = resolve_model_dir(model)
    tok = Tokenizer.from_dir(model_dir)
    make = lambda: Engine(load_model(model_dir), tok, EngineConfig(max_running=requests, enable_cache=False))  # noqa: E731
    if form == "main thread, 1 thread":  # the main thread starts no OpenMP workers
        torch.set_num_threads(1)
        engine = AsyncEngine(make())
        torch.set_num_threads(threads)  # what the step thread's first parallel op takes
    else:
        engine = AsyncEngine(make if form == "step thread" else make())
    source = corpus_ids(tok, 64 * requests)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def serve_round():
        async def one(prompt):
            async for _ in engine.generate(prompt, params):
                pass
        await asyncio.gather(*[one(source[i * 64 : (i + 1) * 64]) for i in range(requests)])

    asyncio.run(serve_round())  # warm-up
    times = [timed(asyncio.run, serve_round())[0] for _ in range(rounds)]
    engine.shutdown()
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gdn-tiny")
    p.add_argument("--threads", type=int, default=2, help="torch threads (1: the forms should not differ)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per process")
    p.add_argument("--repeats", type=int, default=5, help="processes per form, alternating")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_one_run(args.model, args.child, args.requests, args.tokens, args.rounds, args.threads)))
        return
    torch.set_num_threads(args.threads)
    record = start_run("bench_async", {k: v for k, v in vars(args).items() if k not in ("out", "child")}, argv)
    runs: dict[str, list[float]] = {f: [] for f in FORMS}
    for _ in range(args.repeats):
        for form in FORMS:
            out = subprocess.run([sys.executable, "-m", "loadtest.bench_async", *(argv or sys.argv[1:]),
                                  "--child", form], check=True, capture_output=True, text=True).stdout
            runs[form].append(median(json.loads(out.strip().splitlines()[-1])))
            print(form, f"{runs[form][-1]:.3f} s", flush=True)
    base = median(runs[FORMS[0]])
    rows = [[form, median(t), min(t), max(t), base / median(t)] for form, t in runs.items()]
    md = ("Seconds to serve %d concurrent greedy requests of 64 prompt tokens and %d new tokens each (per "
           "process: median of %d rounds after a warm-up; median, min and max over %d processes per form). "
           "*speed-up*: main-thread median / this median.\n\n"
           % (args.requests, args.tokens, args.rounds, args.repeats))
    md += table(["engine built in", "median s", "min s", "max s", "speed-up"], rows) + "\n"
    publish(record, f"{Path(args.model).name}/threads-{args.threads}", {"seconds": runs}, md, args.out,
            "AsyncEngine: engine built in the main thread vs in its step thread",
            f"{Path(args.model).name}, {args.threads} torch thread{'s' if args.threads > 1 else ''}")


if __name__ == "__main__":
    main()

"""bench_engine's `host` and `serving` sections: where a decode token's time goes besides the model.

host: the engine's host work per sequence per step, with the prefix cache on. B sequences (64-token prompts from
the held-out corpus) decode together; each repeat times blocks of `block` engine steps, each followed at once by as
many model-only steps: the worker's padded decode step (eager, or the compiled package) rerun on the inputs of the
engine's last step, prebuilt (`DecodeGraphs.rerun_last`). Host work per sequence = (engine step - model-only
step) / B: the scheduler, the step's inputs, picks, outputs, checkpoints and telemetry, and what they cost the
model step in caches. The row is the median over every block of every repeat (a block and its model-only twin
are timed within milliseconds of each other, which this VM's drifting speed needs).

serving: milliseconds per token of one 128-token answer to a 64-token prompt, at one stream: in the engine
(`Engine.generate`), through `app.api.local` (not streamed, and streamed), and through the Ray service (`serve run`
of configs/config.yaml with one replica of the same thread count), each the median of `SAMPLES` answers per
repeat and of its repeats; servers started by loadtest/peer/servers.py. The time includes the prompt's prefill,
the same in every arm.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import httpx

from app.engine.engine import Engine
from app.engine.graphs import bucket
from app.engine.request import SamplingParams
from loadtest.common import median, timed

PROMPT, NEW = 64, 128
SAMPLES = 6  # answers per repeat and path


def bench_host(model, tok, prompts_source: list[int], batches, repeats: int, place, blocks: int = 8, block: int = 4,
               say=print) -> list[dict]:
    rows = []
    for b in batches:
        budget = 16 + (repeats * blocks + 1) * block
        engine = Engine(model, tok, place.config(max_running=b, kv_slots=b * (PROMPT + budget) + 64,
                                                 max_tokens_per_step=max(2048, 4 * b)))
        graphs = engine.worker.graphs
        if graphs is None:
            raise RuntimeError("the host row needs the padded decode step (one worker, no routed experts)")
        params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
        for i in range(b):
            engine.add_request(prompts_source[i * PROMPT : (i + 1) * PROMPT], params)
        while engine.scheduler.waiting or any(s.num_computed < s.num_tokens - 1 for s in engine.scheduler.running):
            engine.step()
        for _ in range(8):  # warm: every sequence decodes
            engine.step()
        step_s, floor_s, host = [], [], []
        for _ in range(repeats * blocks):
            before = graphs.replays
            t_step = timed(_repeat, engine.step, block)[0] / block
            if graphs.replays - before != block or graphs.last[0] != bucket(b):
                raise RuntimeError("a timed step was not a pure decode step of the whole batch")
            t_floor = timed(_repeat, graphs.rerun_last, block)[0] / block
            step_s.append(t_step)
            floor_s.append(t_floor)
            host.append((t_step - t_floor) / b)
        row = {"batch": b, "step_ms": median(step_s) * 1e3, "model_ms": median(floor_s) * 1e3,
               "host_us_per_seq": median(host) * 1e6, "tok_s": b / median(step_s),
               "history_bucket": graphs.last[1]}
        rows.append(row)
        say(row)
    return rows


def bench_serving(model_name: str, model, tok, prompts_source: list[int], repeats: int, place, arms,
                  say=print) -> dict:
    """ms per token of one answer: in the engine, then each server arm of `arms` (local, local-stream, ray)."""
    from loadtest.peer import servers
    from loadtest.serve_harness import free_port

    prompt = prompts_source[:PROMPT]
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    engine = Engine(model, tok, place.config())
    engine.generate([prompts_source[PROMPT : 2 * PROMPT]], params)  # warm
    out = {"engine": median([timed(engine.generate, [prompt], params)[0]
                             for _ in range(repeats * SAMPLES)]) / NEW * 1e3}
    say({"engine_ms_per_token": out["engine"]})
    knobs = {"compile_decode": place.compiled, "compile_prefill": place.compiled, "compile_background": False}
    for arm in ("local", "ray"):
        if not {arm, f"{arm}-stream"} & set(arms):
            continue
        with tempfile.TemporaryDirectory() as logdir:
            server = servers.start(f"ours-{arm}", model_name, free_port(), Path(logdir), local_engine=knobs,
                                   ray_engine=knobs)
            try:
                for stream in (False, True):
                    key = f"{arm}-stream" if stream else arm
                    if key in arms:
                        times = asyncio.run(_answers(server.url, prompt, repeats, stream))
                        out[key] = median(times) / NEW * 1e3
                        say({f"{key}_ms_per_token": out[key]})
            finally:
                server.stop()
    return out


def _repeat(fn, n: int) -> None:
    for _ in range(n):
        fn()


async def _answers(url: str, prompt: list[int], repeats: int, stream: bool) -> list[float]:
    body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "stream": stream}
    times = []
    async with httpx.AsyncClient(timeout=600) as c:
        for r in range(repeats * SAMPLES + 1):  # the first answer warms the server
            t0 = time.perf_counter()
            if stream:
                async with c.stream("POST", f"{url}/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    async for _ in resp.aiter_lines():
                        pass
            else:
                (await c.post(f"{url}/v1/completions", json=body)).raise_for_status()
            if r:
                times.append(time.perf_counter() - t0)
    return times

"""The engine on a CUDA GPU against the CPU engine, and TP over NCCL. Skipped on machines without CUDA.

This module imports only the engine (no Ray, FastAPI or pydantic), so a GPU machine with torch and Triton
can run it straight from a checkout: `make gpu-check`, or `PYTHONPATH=. python -m pytest tests/engine/test_cuda.py
tests/kernels/test_pack.py` with that machine's own torch.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch

from app.engine.async_engine import AsyncEngine
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.engine.tp import build_engine
from app.models.loader import load_model
from tests.helpers import load_zoo, record_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _prompts(tok):
    ids = tok.encode(open(__file__).read())
    return [ids[:200], ids[:260], ids[40:240]]


@pytest.fixture
def no_tf32(monkeypatch):
    """Full fp32 matmuls on the GPU, as on the CPU."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.mark.parametrize("name, w_max, quant, policy", [
    ("kda-tiny", None, "none", "nr"), ("gdn-tiny", None, "none", "nr"), ("kda-tiny", 16, "none", "nr"),
    ("kda-tiny", 16, "int8", "nr"), ("gdn-tiny", 128, "int8", "nr"), ("kda-tiny", 16, "int8", "wr")])
def test_cuda_engine_matches_cpu_engine(name, w_max, quant, policy, no_tf32):
    """Same greedy tokens and cached lengths on the GPU as on the CPU (dasc checkpoints through the Triton
    pack/unpack kernels on CUDA), logits within 1e-3; within 1e-2 after INT8 loads: the states the two
    devices store differ by float rounding (~1e-7), and an element that sits at an INT8 rounding boundary
    moves by a whole step (its row's absmax / 127) on one side. The kernels themselves are bit-exact on
    equal inputs (tests/kernels/test_pack.py)."""
    _, tok = load_zoo(name)
    prompts = _prompts(tok)
    cfg = dict(interval=64, w_max=w_max, quant=quant, policy=policy)
    outs, logits = {}, {}
    for device in ("cpu", "cuda"):
        engine = Engine(load_model(name), tok, EngineConfig(device=device, **cfg))
        logits[device] = record_logits(engine)
        outs[device] = [[o[0] for o in engine.generate(prompts, GREEDY)] for _ in range(2)]
        engine.check_integrity()
    assert [[o.output_ids for o in run] for run in outs["cuda"]] == [[o.output_ids for o in run] for run in outs["cpu"]]
    assert [o.cached_tokens for o in outs["cuda"][1]] == [o.cached_tokens for o in outs["cpu"][1]]
    assert all(o.cached_tokens > 0 for o in outs["cuda"][1])
    cpu, gpu = logits["cpu"], logits["cuda"]
    assert cpu.keys() == gpu.keys()
    assert max((cpu[k] - gpu[k]).abs().max().item() for k in cpu) < (1e-2 if quant == "int8" else 1e-3)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name", ["kda-tiny", "gdn-tiny"])
def test_cuda_decode_graphs_match_eager_steps(name, compiled, no_tf32):
    """Captured decode graphs (app/engine/graphs.py), of the eager or the compiled step, give the eager GPU
    engine's tokens and logits, through padded buckets, checkpoint hits and batch sizes that change as requests
    finish."""
    _, tok = load_zoo(name)
    ids = tok.encode(open(__file__).read())
    prompts = [ids[i * 37 : i * 37 + 20 + 23 * i] for i in range(9)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs, logits, engines = {}, {}, {}
    for graphs in (False, True):
        engine = engines[graphs] = Engine(load_model(name), tok, EngineConfig(
            device="cuda", interval=32, max_running=6, decode_graphs=graphs, compile_decode=graphs and compiled,
            padded_decode=graphs))
        logits[graphs] = record_logits(engine)
        outs[graphs] = [[o[0].output_ids for o in engine.generate(prompts, params)] for _ in range(2)]
        engine.check_integrity()
    assert outs[True] == outs[False]
    assert logits[True].keys() == logits[False].keys()
    assert max((logits[True][k] - v).abs().max().item() for k, v in logits[False].items()) < 1e-3
    stats = engines[True].snapshot()["decode_graphs"]
    assert stats["captured"] and stats["steps"] > 20 and len(stats["buckets"]) >= 2
    assert stats["compiled"] == compiled


@pytest.mark.parametrize("name", ["kda-tiny", "gdn-tiny"])
def test_cuda_bfloat16_hits_equal_cold(name):
    model, tok = load_zoo(name)
    prompts = _prompts(tok)
    engine = Engine(model, tok, EngineConfig(device="cuda", dtype="bfloat16", interval=64))
    assert engine.model.model.embed_tokens.weight.is_cuda
    cold = [o[0] for o in engine.generate(prompts, GREEDY)]
    hot = [o[0] for o in engine.generate(prompts, GREEDY)]
    assert all(o.cached_tokens > 0 for o in hot)
    assert [o.output_ids for o in hot] == [o.output_ids for o in cold]


@pytest.mark.parametrize("codec", [dict(), dict(w_max=16.0, quant="int8")], ids=["dense", "int8"])
def test_cuda_host_tier_is_pinned_and_answers_as_the_pools(codec, no_tf32):
    """The host tier on CUDA: entries live in pinned host memory (their copies run on a side stream), and a prompt
    the one-slot pool let go of resumes from the tier with the answer it got when the pool still held it."""
    model, tok = load_zoo("kda-tiny")
    first, second, _ = _prompts(tok)
    answers = []
    for host_mb in (0.0, 32.0):
        engine = Engine(model, tok, EngineConfig(device="cuda", checkpoint_slots=1 if host_mb else 8,
                                                 host_mb=host_mb, **codec))
        outs = [engine.generate([p], GREEDY)[0][0] for p in (first, second, first)]
        answers.append([(o.output_ids, o.cached_tokens) for o in outs])
        engine.check_integrity()
    assert answers[1] == answers[0] and answers[1][2][1] > 0
    store = engine.worker.host
    assert store.entries and all(t.is_pinned() for rows, own, _ in store.entries.values() for t in [*rows,
                                                                                                     *own.values()])
    assert engine.snapshot()["host_tier_promotions"] >= 1


def test_cuda_async_streaming_with_forks(no_tf32):
    """The step loop in its own thread on the GPU: n=2 forks the active state; streamed greedy tokens equal
    the synchronous engine's."""
    _, tok = load_zoo("kda-tiny")
    prompts = _prompts(tok)
    ref = Engine(load_model("kda-tiny"), tok, EngineConfig(device="cuda", w_max=16, interval=64))
    want = [o[0].output_ids for o in ref.generate(prompts, GREEDY)]
    engine = AsyncEngine(Engine(load_model("kda-tiny"), tok, EngineConfig(device="cuda", w_max=16, interval=64)))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2)

    async def one(prompt):
        last = {}
        async for out in engine.generate(prompt, params):
            last[out.index] = out.output_ids
        return last

    async def run():
        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        got = asyncio.run(run())
    finally:
        engine.shutdown()
    assert [[g[0], g[1]] for g in got] == [[w, w] for w in want]


def test_cli_generate_on_cuda():
    cli = subprocess.run([sys.executable, "-m", "app.cli", "generate", "--prompt", "def f(x):", "--device", "cuda",
                          "--max-tokens", "4", "--ignore-eos", "--json"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert cli.returncode == 0, cli.stderr
    out = json.loads(cli.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 4 and out["prompt_tokens"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("placement", ["off", "balanced"])
def test_tp2_over_nccl_equals_tp1(placement):
    cfg = EngineConfig(device="cuda", checkpoint_slots=8, interval=32, w_max=16, max_running=8, kv_slots=4096)
    one = build_engine("kda-tiny", cfg, 1)
    prompts = _prompts(one.tokenizer)
    outs1 = [one.generate([p], GREEDY)[0][0].output_ids for p in prompts]
    two = build_engine("kda-tiny", cfg, 2, placement)
    try:
        assert [two.generate([p], GREEDY)[0][0].output_ids for p in prompts] == outs1
    finally:
        two.tp_group.close()

"""`AsyncEngine.cache_call` (a peer's export and its filing, issue 40): it holds the engine's cache lock alone,
which the step thread lets go of while the worker runs a forward, so an export of a stored entry does not wait for
the step in flight; `call` (which may change the cache) still does. The export taken during a forward is the one
taken between steps, byte for byte."""

from __future__ import annotations

import asyncio
import threading

import torch

from app.engine.async_engine import AsyncEngine
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from tests.engine.test_host_tier import _prompts
from tests.helpers import load_zoo

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_an_export_runs_during_a_forward_and_a_call_waits_for_it():
    model, tok = load_zoo("kda-tiny")
    first, second = _prompts(tok, 2)
    engine = AsyncEngine(Engine(model, tok, EngineConfig(compile_decode=False, compile_prefill=False)))
    try:
        asyncio.run(_finish(engine, first))
        limit = len(first) - 1 - engine.engine.cfg.tail
        between = engine.call(lambda e: e.export_entry(first, limit, None))
        inside, gate, run = threading.Event(), threading.Event(), engine.engine.worker.run

        def held_run(batch):  # the forward of the next step waits until the test lets it go
            inside.set()
            assert gate.wait(30)
            return run(batch)

        engine.engine.worker.run = held_run
        loop = threading.Thread(target=lambda: asyncio.run(_finish(engine, second)))
        loop.start()
        assert inside.wait(30), "the step reached its forward"
        during = engine.cache_call(lambda e: e.export_entry(first, limit, None))  # returns with the forward held
        called = threading.Thread(target=engine.call, args=(lambda e: None,))
        called.start()
        called.join(0.5)
        assert called.is_alive(), "call waits for the step in flight"
        gate.set()
        loop.join(60)
        called.join(30)
        assert during["tokens"] == between["tokens"] and set(during["tensors"]) == set(between["tensors"])
        assert all(torch.equal(during["tensors"][n], t) for n, t in between["tensors"].items())
        engine.call(lambda e: e.check_integrity())
    finally:
        engine.shutdown()


async def _finish(engine: AsyncEngine, prompt: list[int]) -> None:
    async for _ in engine.generate(prompt, GREEDY):
        pass

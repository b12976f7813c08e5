"""AsyncEngine on the CPU: streaming through the background step loop, and an engine built by that loop's
thread from a factory (the form the replicas use)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from app.engine.async_engine import AsyncEngine
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from tests.helpers import load_zoo

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


async def _collect(engine: AsyncEngine, prompts: list[list[int]]) -> list[list[int]]:
    async def one(prompt):
        tokens = []
        async for out in engine.generate(prompt, GREEDY):
            tokens += out.new_token_ids
        return tokens
    return await asyncio.gather(*[one(p) for p in prompts])


def test_factory_engine_is_built_in_the_step_thread_and_streams_like_the_sync_engine():
    model, tok = load_zoo("gdn-tiny")
    prompts = [tok.encode(f"request {i} asks for a story about the sea") for i in range(4)]
    want = [o[0].output_ids for o in Engine(model, tok, EngineConfig()).generate(prompts, GREEDY)]
    built_in = []

    def make() -> Engine:
        built_in.append(threading.current_thread())
        return Engine(model, tok, EngineConfig())

    engine = AsyncEngine(make)
    try:
        assert built_in == [engine._thread] and built_in[0] is not threading.main_thread()
        assert asyncio.run(_collect(engine, prompts)) == want
        assert engine.snapshot()["requests_finished"] == 4
    finally:
        engine.shutdown()


def test_factory_error_reaches_the_constructor():
    def make() -> Engine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(make)

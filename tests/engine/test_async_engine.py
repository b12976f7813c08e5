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


def test_a_request_not_streamed_gets_its_first_output_then_the_rest_merged_into_one():
    """stream=False: each sequence's first output when it is made, then one output at its end that joins every
    later one: the tokens, text and logprobs of a streamed run of the same request, in two hand-overs."""
    model, tok = load_zoo("kda-tiny")
    prompt = tok.encode("def merge(a, b):")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=2, logprobs=2, prompt_logprobs=1)
    engine = AsyncEngine(Engine(model, tok, EngineConfig()))

    async def run(stream: bool) -> list:
        return [out async for out in engine.generate(prompt, params, stream=stream)]

    try:
        streamed, merged = asyncio.run(run(True)), asyncio.run(run(False))
    finally:
        engine.shutdown()
    assert len(streamed) == 20 and len(merged) == 4
    for index in (0, 1):
        whole = [o for o in streamed if o.index == index]
        first, rest = [o for o in merged if o.index == index]
        assert first.new_token_ids == whole[0].new_token_ids and not first.finished
        assert first.new_token_ids + rest.new_token_ids == [t for o in whole for t in o.new_token_ids]
        assert first.new_text + rest.new_text == rest.text == whole[-1].text
        assert first.new_logprobs + rest.new_logprobs == [lp for o in whole for lp in o.new_logprobs]
        assert rest.finished and rest.output_ids == whole[-1].output_ids and rest.ttft_s == first.ttft_s
    assert merged[0].prompt_logprobs == streamed[0].prompt_logprobs is not None

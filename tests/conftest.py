"""Fixtures of the whole session: the compiled packages of kda-tiny, built once by a cold start in the background
(tests/engine/test_background_compile.py checks what that start did; other tests start warm on its directory)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from app.engine.aot import ArtifactCache
from app.engine.async_engine import AsyncEngine
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from tests.helpers import load_zoo

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def compiled_config(root) -> EngineConfig:
    return EngineConfig(max_running=1, chunk_size=16, interval=32, compile_decode=True, compile_prefill=True,
                        compile_cache_dir=str(root))


def answer(engine: AsyncEngine, prompt: list[int]) -> list[int]:
    async def run():
        ids = []
        async for out in engine.generate(prompt, GREEDY):
            ids += out.new_token_ids
        return ids

    return asyncio.run(run())


@pytest.fixture(scope="session")
def compiled_kda(tmp_path_factory):
    """A cold start, observed: what it reports at once, its eager answer and the compile child's scheduling policy
    while the child waits for the cache's compile lock (held here until then: any other process compiling into the
    cache would hold it the same way), then, the lock let go and no request sent, the report once every package is
    in force, and an answer then. Its cache directory then serves the session's tests of warm starts: the packages of
    kda-tiny's batch bucket 1 and of its prefill pieces of one 16-token chunk (`compiled_config`).

    Yields (cache directory, model, tokenizer, prompt, the eager engine's greedy tokens, what was seen)."""
    model, tok = load_zoo("kda-tiny")
    root = tmp_path_factory.mktemp("compiled")
    prompt = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    plain = Engine(model, tok, EngineConfig(max_running=1, chunk_size=16, interval=32, padded_decode=False))
    want = plain.generate([prompt], GREEDY)[0][0].output_ids
    held = ArtifactCache(root, 64).compiling()
    held.__enter__()
    engine = AsyncEngine(lambda: Engine(model, tok, compiled_config(root)))
    seen = {"at_start": engine.snapshot()["compile"]}
    child = engine.engine.compiled.compiles.proc
    policy_by = time.monotonic() + 30  # the child sets its policy first thing, once its interpreter is up
    while os.sched_getscheduler(child.pid) != os.SCHED_IDLE and time.monotonic() < policy_by and child.poll() is None:
        time.sleep(0.05)
    seen["policy"] = os.sched_getscheduler(child.pid)
    seen["eager"] = answer(engine, prompt)
    seen["while_held"] = engine.snapshot()["compile"]
    held.__exit__(None, None, None)
    end = time.monotonic() + 600
    while engine.snapshot()["compile"]["state"] == "building":
        assert time.monotonic() < end, "the packages were not built in time"
        time.sleep(0.5)
    snap = engine.snapshot()
    seen |= {"done": snap["compile"], "decode": snap["decode_graphs"], "prefill": snap["compiled_prefill"],
             "compiled": answer(engine, prompt), "child_rc": child.wait(30),
             "reports_read": engine.engine.compiled.compiles.wait(30)}
    seen["work_left"] = list(root.glob(".work-*"))
    engine.shutdown()
    yield root, model, tok, prompt, want, seen



"""AsyncEngine under bad requests, overload and faults, over a real kda-tiny engine: one request failing while
it is added fails alone; the bounded queue refuses at once (Overloaded); a queue deadline that passes before a
request starts answers QueueTimeout; a reader that stops reading is cut off (OutputOverflow) with its slots
freed; drain, shutdown and a step raising EngineUnavailable end every request cleanly and refuse new ones.

`_Gate` holds the engine lock (through `AsyncEngine.call`) so that the step loop cannot take its next turn:
what must happen before a request starts is arranged while the loop is held, without timing."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from app.engine.async_engine import AsyncEngine
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.errors import EngineUnavailable, OutputOverflow, Overloaded, QueueTimeout
from app.engine.request import SamplingParams
from tests.helpers import load_zoo

PROMPT = list(range(3, 30))
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(kv_slots=4096, checkpoint_slots=8, max_running=4)
WAIT_S = 120  # generous bound on conditions that must come true; never a pass/fail timing


@pytest.fixture(scope="module")
def zoo():
    return load_zoo("kda-tiny")


@pytest.fixture
def make(zoo):
    made = []

    def build(cfg: EngineConfig = CONFIG, **kwargs) -> AsyncEngine:
        made.append(AsyncEngine(Engine(*zoo, cfg), **kwargs))
        return made[-1]

    yield build
    for engine in made:
        engine.shutdown()


class _Gate:
    """Holds the step loop between turns (a thread keeps the engine lock) until released."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._open, held = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=engine.call, args=(lambda _: (held.set(), self._open.wait()),))
        self._thread.start()
        held.wait()

    def release(self) -> None:
        self._open.set()
        self._thread.join()


async def _run(engine: AsyncEngine, params: SamplingParams = SHORT, **kwargs) -> list[int]:
    tokens = []
    async for out in engine.generate(PROMPT, params, **kwargs):
        tokens += out.new_token_ids
    return tokens


async def _until(condition, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < end, f"never: {what}"
        await asyncio.sleep(0.01)


def _clean(engine: AsyncEngine) -> None:
    """Nothing left in the engine (once the loop took the aborts handed to it), and every slot owned once or
    free."""
    end = time.monotonic() + WAIT_S
    while engine.call(lambda e: e.has_unfinished() or bool(e._seqs)):
        assert time.monotonic() < end, "requests left in the engine"
        time.sleep(0.01)
    engine.call(lambda e: e.check_integrity())


def test_a_request_that_fails_while_added_fails_alone(make):
    engine = make()

    async def main():
        bad = SamplingParams(**{**SHORT.__dict__, "n": 2})
        object.__setattr__(bad, "seed", "not a number")  # past validation: add_request raises
        with pytest.raises(RuntimeError, match="request failed"):
            await _run(engine, bad)
        huge = SamplingParams(**SHORT.__dict__)
        object.__setattr__(huge, "seed", 2**64)  # the seed of issue 20: served (modulo 2**64)
        assert len(await _run(engine, huge)) == 4
        assert len(await _run(engine)) == 4

    asyncio.run(main())
    engine.check_alive()
    _clean(engine)


def test_a_duplicate_request_id_in_flight_is_refused(make):
    engine = make()

    async def main():
        first = engine.generate(PROMPT, LONG, request_id="x")
        await first.__anext__()
        with pytest.raises(ValueError, match="duplicate"):
            await _run(engine, request_id="x")
        await first.aclose()

    asyncio.run(main())
    _clean(engine)


def test_the_bounded_queue_refuses_at_once_and_recovers(make):
    engine = make(EngineConfig(kv_slots=4096, checkpoint_slots=8, max_waiting=2))

    async def main():
        gate = _Gate(engine)
        queued = [asyncio.create_task(_run(engine)) for _ in range(2)]
        await _until(lambda: len(engine._streams) == 2, "two requests queued")
        with pytest.raises(Overloaded):
            await _run(engine)
        gate.release()
        assert engine.snapshot()["rejected"] == 1  # the tuner does not judge a window with refusals
        assert [len(t) for t in await asyncio.gather(*queued)] == [4, 4]
        assert len(await _run(engine)) == 4  # nothing waits now: admitted again

    asyncio.run(main())
    _clean(engine)


def test_max_waiting_zero_is_unbounded(make):
    engine = make(EngineConfig(kv_slots=4096, checkpoint_slots=8, max_waiting=0))

    async def main():
        gate = _Gate(engine)
        queued = [asyncio.create_task(_run(engine)) for _ in range(5)]
        await _until(lambda: len(engine._streams) == 5, "five requests queued")
        gate.release()
        assert [len(t) for t in await asyncio.gather(*queued)] == [4] * 5

    asyncio.run(main())


def test_queue_deadlines(make):
    engine = make()

    async def main():
        with pytest.raises(QueueTimeout):
            await _run(engine, deadline=time.time() - 1)  # passed on arrival
        gate = _Gate(engine)
        deadline = time.time() + 0.2
        late = asyncio.create_task(_run(engine, deadline=deadline))
        await _until(lambda: time.time() > deadline and len(engine._streams) == 1,
                     "the deadline passed while the request was queued")
        gate.release()
        with pytest.raises(QueueTimeout):
            await late
        # a request that started before its deadline runs to its end
        stream = engine.generate(PROMPT, SHORT, request_id="started", deadline=time.time() + 600)
        tokens = (await stream.__anext__()).new_token_ids
        engine._streams["started"].deadline = time.time() - 1
        async for out in stream:
            tokens += out.new_token_ids
        assert len(tokens) == 4

    asyncio.run(main())
    _clean(engine)


def test_a_reader_that_stops_reading_is_cut_off_and_its_slots_freed(make):
    engine = make(max_buffered_outputs=4)

    async def main():
        stream = engine.generate(PROMPT, LONG, request_id="slow")
        await stream.__anext__()
        await _until(lambda: "slow" not in engine._streams, "the request was cut off")
        with pytest.raises(OutputOverflow):
            await stream.__anext__()  # the unread outputs were dropped: the error comes next
        assert len(await _run(engine)) == 4

    asyncio.run(main())
    _clean(engine)


def test_a_reader_whose_event_loop_closed_does_not_stop_the_engine(make):
    """The reader's loop closes under an open request (no async-generator shutdown): the step thread cannot post
    to it any more, and aborts that request instead of dying."""
    engine = make()
    gone = asyncio.new_event_loop()
    stream = engine.generate(PROMPT, LONG, request_id="orphan")
    gone.run_until_complete(stream.__anext__())
    gone.close()
    assert len(asyncio.run(_run(engine))) == 4
    engine.check_alive()
    _clean(engine)
    assert "orphan" not in engine._streams


def test_drain_lets_requests_finish_and_refuses_new_ones(make):
    engine = make()

    async def main():
        running = engine.generate(PROMPT, SHORT)
        tokens = (await running.__anext__()).new_token_ids
        drain = asyncio.create_task(engine.drain(timeout_s=WAIT_S))
        await _until(lambda: engine._draining, "draining")
        with pytest.raises(EngineUnavailable, match="draining"):
            await _run(engine)
        engine.check_alive()  # draining is alive
        async for out in running:
            tokens += out.new_token_ids
        await drain
        assert len(tokens) == 4

    asyncio.run(main())
    _clean(engine)


def test_drain_past_its_timeout_fails_the_rest(make):
    engine = make()

    async def main():
        stalled = engine.generate(PROMPT, LONG)
        await stalled.__anext__()  # then never read until drain gave up
        await engine.drain(timeout_s=0.1)
        with pytest.raises(EngineUnavailable, match="draining"):
            async for _ in stalled:
                pass

    asyncio.run(main())
    _clean(engine)


def test_check_alive_asks_the_worker(make):
    engine = make()
    engine.check_alive()

    def dead() -> None:
        raise EngineUnavailable("rank 1 died")

    engine.engine.worker.check_alive = dead
    with pytest.raises(EngineUnavailable, match="rank 1 died"):
        engine.check_alive()


def test_a_step_raising_engine_unavailable_breaks_the_engine_for_good(zoo, make):
    model, _ = zoo
    engine = make()

    def fail(module, args):
        raise EngineUnavailable("a TP rank died")

    async def main():
        hook = model.register_forward_pre_hook(fail)
        try:
            with pytest.raises(EngineUnavailable, match="TP rank died"):
                await _run(engine)
        finally:
            hook.remove()
        with pytest.raises(EngineUnavailable, match="broken"):
            await _run(engine)

    asyncio.run(main())
    with pytest.raises(EngineUnavailable):
        engine.check_alive()
    _clean(engine)


def test_after_shutdown_everything_fails_at_once(make):
    engine = make()

    async def main():
        inflight = engine.generate(PROMPT, LONG)
        await inflight.__anext__()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineUnavailable):
            await asyncio.wait_for(_drain(inflight), WAIT_S)  # no hang: the in-flight request fails
        with pytest.raises(EngineUnavailable, match="shut down"):
            await asyncio.wait_for(_run(engine), WAIT_S)

    asyncio.run(main())
    with pytest.raises(EngineUnavailable):
        engine.check_alive()
    _clean(engine)


async def _drain(stream) -> None:
    async for _ in stream:
        pass

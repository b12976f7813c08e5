"""Streaming wrapper: the engine's step loop runs in a background thread, requests stream through asyncio.

`generate()` yields a `RequestOutput` per new token of each of the request's sequences; leaving the loop
early (client gone) aborts the request. New requests and aborts are handed to the loop thread through a
short-held queue, so the event loop never waits for a model step. An exception inside a step is delivered
to every open request, so nothing hangs.

Given a factory instead of an engine, the loop thread builds the engine itself, and every parallel torch op
then runs in that thread. GNU OpenMP gives each thread that starts a parallel region its own worker pool; once
the pools hold more threads than there are CPUs, every team sleeps between regions, and each parallel op pays
for waking its workers. An engine built in the main thread (which then keeps idle workers) and stepped here ran
1.8x slower on a 2-core machine (loadtest/bench_async.py, docs/serving.md). Once the engine is built, the
objects alive then are frozen out of garbage collection (`_freeze_heap`), as vLLM does after its start-up.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import threading
import uuid
from collections.abc import AsyncIterator, Callable

from app.engine.engine import Engine
from app.engine.errors import EngineUnavailable
from app.engine.request import RequestOutput, SamplingParams


class AsyncEngine:
    def __init__(self, engine: Engine | Callable[[], Engine]) -> None:
        """`engine`, or a factory the loop thread calls first (its exception is raised here)."""
        self.engine = engine if isinstance(engine, Engine) else None
        self._engine_lock = threading.Lock()  # held for a whole step
        self._cv = threading.Condition()  # held briefly, guards the hand-over lists
        self._pending: list[tuple[list[int], SamplingParams, str]] = []
        self._aborts: list[str] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._probes: list[threading.Event] = []  # check_alive(): set by the loop thread when it comes round
        failed: list[BaseException] = []
        ready = threading.Event()

        def run() -> None:
            try:
                if self.engine is None:
                    self.engine = engine()
            except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
                failed.append(e)
            finally:
                ready.set()
            if not failed:
                _freeze_heap()
                self._loop()

        self._thread = threading.Thread(target=run, name="engine-loop", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs until every sequence of the request finished. Raises ValueError on bad input."""
        self.engine.validate(prompt_ids, params)
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        with self._cv:
            if self._stopped or not self._thread.is_alive():
                raise EngineUnavailable("the engine is shut down")
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
            self._pending.append((list(prompt_ids), params, request_id))
            self._cv.notify()
        remaining = params.n
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= item.finished
                yield item
        finally:
            with self._cv:
                self._queues.pop(request_id, None)
                if remaining:
                    self._aborts.append(request_id)
                    self._cv.notify()

    def snapshot(self) -> dict:
        """Engine telemetry (waits for the step in flight, if any)."""
        with self._engine_lock:
            return self.engine.snapshot()

    def call(self, fn, *args):
        """Run `fn(engine, *args)` between steps, e.g. to retune the cache."""
        with self._engine_lock:
            return fn(self.engine, *args)

    def check_alive(self, timeout_s: float = 10.0) -> None:
        """Raise EngineUnavailable unless the step thread is alive and comes round its loop within `timeout_s`
        (a step in flight finishes first). Cheap: no generation, no model call."""
        probe = threading.Event()
        with self._cv:
            if self._stopped or not self._thread.is_alive():
                raise EngineUnavailable("the engine's step thread is not running")
            self._probes.append(probe)
            self._cv.notify()
        if not probe.wait(timeout_s):
            raise EngineUnavailable(f"the engine's step thread did not come round within {timeout_s:g} s")

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopped or self._pending or self._aborts or self._probes
                           or self.engine.has_unfinished()):
                    self._cv.wait()
                for probe in self._probes:
                    probe.set()
                self._probes = []
                if self._stopped:
                    return
                pending, self._pending = self._pending, []
                aborts, self._aborts = self._aborts, []
            with self._engine_lock:
                for prompt, params, request_id in pending:
                    try:
                        self.engine.add_request(prompt, params, request_id)
                    except Exception as exc:  # noqa: BLE001 - fails this request only; the loop serves on
                        self._fail(request_id, exc)
                for request_id in aborts:
                    self.engine.abort(request_id)
                try:
                    outputs = self.engine.step() if self.engine.has_unfinished() else []
                except Exception as exc:  # deliver to every waiter and drop the engine's work
                    self._fail_all(exc)
                    continue
            with self._cv:
                targets = [(self._queues.get(o.request_id), o) for o in outputs]
            for target, out in targets:
                if target is not None:
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, out)

    def _fail(self, request_id: str, exc: Exception) -> None:
        with self._cv:
            target = self._queues.get(request_id)
        if target is not None:
            loop, queue = target
            error = exc if isinstance(exc, ValueError) else RuntimeError(f"request failed: {exc!r}")
            loop.call_soon_threadsafe(queue.put_nowait, error)

    def _fail_all(self, exc: Exception) -> None:
        with self._cv:
            queues = list(self._queues.items())
        for request_id, (loop, queue) in queues:
            self.engine.abort(request_id)
            loop.call_soon_threadsafe(queue.put_nowait, RuntimeError(f"engine step failed: {exc!r}"))


def _freeze_heap() -> None:
    """Move every object alive once the engine is built (imported modules, the model, compiled code: about 800k
    objects with compiled decode steps) out of the collector's generations. A full collection would otherwise
    walk all of them, holding the step loop (and the GIL) for the whole walk, whenever enough new objects have
    survived since the last one. At exit they go back to the collector, so that the interpreter's finalization
    frees them: nanobind (Triton's bindings, loaded by torch.compile and transformers) reports each of its objects
    still alive then as leaked."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once per process, however many engines
    atexit.register(gc.unfreeze)

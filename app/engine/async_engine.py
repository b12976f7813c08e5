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

Two locks: `_engine_lock`, held for a whole step (and by `call`), and the engine's `cache_lock`, held by the step
thread too except while the worker runs a step's forward, which reads and writes no stored entry (only KV slots
allocated for the step and its sequences' working states). `cache_call` takes the cache lock alone: reading the tree,
the queues and stored entries, and filing into the host tier (a peer's export and import, a replica's routing
stats) run between steps or during a forward, without waiting for the step in flight.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager

from app.engine.engine import Engine
from app.engine.errors import EngineError, EngineUnavailable, Overloaded, QueueTimeout
from app.engine.request import RequestOutput, SamplingParams
from app.engine.streams import Stream, post_all


class AsyncEngine:
    def __init__(self, engine: Engine | Callable[[], Engine], max_buffered_outputs: int = 1024) -> None:
        """`engine`, or a factory the loop thread calls first (its exception is raised here).
        `max_buffered_outputs`: the most outputs a request may have waiting unread (see `Stream`)."""
        self.engine = engine if isinstance(engine, Engine) else None
        self.max_buffered_outputs = max_buffered_outputs
        self._engine_lock = threading.Lock()  # held for a whole step
        self._cv = threading.Condition()  # held briefly, guards the hand-over lists and the streams
        self._pending: list[tuple[list[int], SamplingParams, str]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, Stream] = {}
        self._waiting = 0  # requests in the engine not yet started, as the loop last counted them
        self._stopped = False
        self._rejected = 0  # requests refused as Overloaded (telemetry: such a window is not judged by the tuner)
        self._draining = False
        self._broken: EngineUnavailable | None = None  # set when the loop ended for good
        self._probes: list[threading.Event] = []  # check_alive(): set by the loop thread when it comes round
        self._installs = False  # a compiled package landed: the loop comes round to put it in force
        failed: list[BaseException] = []
        ready = threading.Event()

        def run() -> None:
            try:
                if self.engine is None:
                    self.engine = engine()
                self.engine.open_forward = True  # steps let go of the cache lock during their forward
                if self.engine.compiled is not None:  # packages built in the background come in between steps
                    self.engine.compiled.set_wake(self._wake_for_install)
            except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
                failed.append(e)
            finally:
                ready.set()
            if not failed:
                _freeze_heap()
                self._run_loop()

        self._thread = threading.Thread(target=run, name="engine-loop", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       deadline: float | None = None, stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream outputs until every sequence of the request finished; with `stream` False, each sequence's
        first output and then the rest merged into one (`Stream.merge`). Raises ValueError on bad input,
        Overloaded when `max_waiting` requests wait to start already, EngineUnavailable when the engine is shut
        down, draining or broken, QueueTimeout when `deadline` (a `time.time()` value) passes before the request
        started, and OutputOverflow when the reader falls too far behind."""
        self.engine.validate(prompt_ids, params)
        if deadline is not None and time.time() >= deadline:
            raise QueueTimeout("the request's queue deadline passed before it arrived")
        request_id = request_id or uuid.uuid4().hex
        if self.engine.cache.disk is not None and self.engine.cfg.enable_cache:
            with self._cv:  # a request refused anyway (overloaded, draining, shut down) costs no disk read
                self._admit(request_id)
            await asyncio.to_thread(self._read_ahead, prompt_ids, params)
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue(), deadline, merge=not stream)
        with self._cv:
            self._admit(request_id)
            self._streams[request_id] = stream
            self._pending.append((list(prompt_ids), params, request_id))
            self._cv.notify()
        remaining = params.n
        try:
            while remaining:
                item = await stream.get()
                remaining -= item.finished
                yield item
        finally:
            with self._cv:
                if self._streams.get(request_id) is stream:  # not unregistered already (and the id reused)
                    del self._streams[request_id]
                if remaining:
                    self._aborts.append(request_id)
                    self._cv.notify()

    def _wake_for_install(self) -> None:
        with self._cv:
            self._installs = True
            self._cv.notify()

    def _admit(self, request_id: str) -> None:
        """Raise unless a new request may enter now (called holding `_cv`)."""
        if self._unavailable():
            raise EngineUnavailable(self._unavailable())
        if self._draining:
            raise EngineUnavailable("draining: the engine admits no new requests")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id}")
        limit = self.engine.cfg.max_waiting
        if limit and self._waiting + len(self._pending) >= limit:
            self._rejected += 1
            raise Overloaded(f"{limit} requests are waiting to start (max_waiting)")

    def _unavailable(self) -> str | None:
        """Why the step loop cannot serve (called holding `_cv`), or None."""
        if self._broken is not None:
            return f"the engine is broken: {self._broken}"
        if self._stopped or not self._thread.is_alive():
            return "the engine is shut down"
        return None

    def snapshot(self) -> dict:
        """Engine telemetry (waits for the step in flight, if any), with `rejected`: requests refused as
        overloaded so far."""
        with self._exclusive():
            return {**self.engine.snapshot(), "rejected": self._rejected}

    def call(self, fn, *args):
        """Run `fn(engine, *args)` between steps, e.g. to retune the cache."""
        with self._exclusive():
            return fn(self.engine, *args)

    def _read_ahead(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """A disk tier's entry for this prompt, read before the request is handed to the step thread (outside
        every lock; only the checks of what the cache holds and the filing take the cache lock), so that its
        admission finds it in the host tier and no step waits for a disk read."""
        engine = self.engine
        if params.prompt_logprobs is not None or (params.cache_lossless and not engine.cfg.checkpoint_settings.exact):
            return  # such a request resumes short of its end, or not at all: admission decides
        limit = max(0, len(prompt_ids) - 1 - engine.cfg.tail)
        salt = params.cache_salt
        above = self.cache_call(lambda e: e.cache.disk_wanted(prompt_ids, limit, salt))
        if above is None:
            return
        found = engine.cache.disk.find(prompt_ids, limit, salt, above=above)
        if found is not None:
            self.cache_call(lambda e: e.cache.file_found(found, salt))

    def cache_call(self, fn, *args):
        """Run `fn(engine, *args)` holding the engine's cache lock alone: between steps, or while the step thread runs
        a forward (see the module doc). `fn` may read the tree, the queues and stored entries and change the host
        tier, never the pools or the tree: a peer's export and its filing at the fetcher (`Engine.export_entry`,
        `Engine.import_entry`), a replica's routing stats."""
        with self.engine.cache_lock:
            return fn(self.engine, *args)

    @contextmanager
    def _exclusive(self):
        """Both locks, in their order: no step, no `cache_call` meanwhile."""
        with self._engine_lock, self.engine.cache_lock:
            yield

    def check_alive(self, timeout_s: float = 10.0) -> None:
        """Raise EngineUnavailable unless the step thread is alive and comes round its loop within `timeout_s`
        (a step in flight finishes first), and the worker, if it can tell (a TP group: its rank processes),
        is alive. Cheap: no generation, no model call. A draining engine is alive."""
        probe = threading.Event()
        with self._cv:
            if reason := self._unavailable():
                raise EngineUnavailable(reason)
            self._probes.append(probe)
            self._cv.notify()
        worker_check = getattr(self.engine.worker, "check_alive", None)
        if worker_check is not None:
            worker_check()
        if not probe.wait(timeout_s):
            raise EngineUnavailable(f"the engine's step thread did not come round within {timeout_s:g} s")

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Graceful stop: admit no new request (EngineUnavailable), wait up to `timeout_s` for the requests in
        flight to be read to their end, then fail the rest with EngineUnavailable and abort them. The step
        thread keeps running (shutdown() ends it)."""
        with self._cv:
            self._draining = True
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._cv:
                if not self._streams:
                    return
            await asyncio.sleep(0.05)
        self._fail_all(EngineUnavailable(f"draining: the request did not finish within {timeout_s:g} s"))

    async def stop(self, drain_timeout_s: float = 10.0) -> None:
        """A graceful stop, as every server of an engine makes it: drain (`drain`), write what the pools and the
        host tier hold to the disk tier, if there is one, so that the next start on its directory resumes them
        (`Engine.persist`, within `drain_timeout_s` more), then `shutdown`."""
        try:
            await self.drain(drain_timeout_s)
            await asyncio.to_thread(self.call, lambda e: e.persist(drain_timeout_s))
        finally:
            await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """End the step thread (requests still in flight fail with EngineUnavailable), then the disk tier's writer
        thread, if any, once it has written what is queued."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=10)
        if self.engine is not None:
            self.engine.close()
        disk = getattr(getattr(self.engine, "cache", None), "disk", None)
        if disk is not None:
            disk.close()

    # ------------------------------------------------------------------ the step thread
    def _run_loop(self) -> None:
        """The loop, and what ends it: shutdown, or an error that leaves the engine unable to step (a dead TP
        rank raises EngineUnavailable; anything raised outside a step is a bug of the loop itself). Either way
        every open request fails at once, and later calls are refused."""
        try:
            self._loop()
            exc = EngineUnavailable("the engine was shut down")
        except BaseException as e:  # noqa: BLE001 - the loop is over; its requests must not hang
            exc = e if isinstance(e, EngineUnavailable) else EngineUnavailable(f"the engine loop failed: {e!r}")
            with self._cv:
                self._broken = exc
        self._fail_all(exc)
        with self._cv:
            aborts, self._aborts = self._aborts, []
        with self._exclusive():  # bookkeeping only: no worker call
            for request_id in aborts:
                self.engine.abort(request_id)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopped or self._pending or self._aborts or self._probes or self._installs
                           or self.engine.has_unfinished()):
                    self._cv.wait()
                for probe in self._probes:
                    probe.set()
                self._probes = []
                if self._stopped:
                    return
                pending, self._pending = self._pending, []
                aborts, self._aborts = self._aborts, []
                installs, self._installs = self._installs, False
                self._waiting += len(pending)  # in transit: still counted until `_expire_and_count` recounts
            with self._exclusive():
                if installs:
                    self.engine.install_compiled()
                for prompt, params, request_id in pending:
                    try:
                        self.engine.add_request(prompt, params, request_id)
                    except Exception as exc:  # noqa: BLE001 - fails this request only; the loop serves on
                        self._fail(request_id, exc)
                for request_id in aborts:
                    self.engine.abort(request_id)
                self._expire_and_count()
                try:
                    outputs = self.engine.step() if self.engine.has_unfinished() else []
                except EngineUnavailable:
                    raise  # the engine cannot step any more: _run_loop fails everything
                except Exception as exc:  # noqa: BLE001 - the step's requests are aborted; fail every waiter
                    self._fail_all(RuntimeError(f"engine step failed: {exc!r}"))
                    continue
            self._deliver(outputs)

    def _expire_and_count(self) -> None:
        """Abort the requests that have not started by their deadline (QueueTimeout), and publish how many
        wait to start, for `_admit`'s bound. Holding the engine lock."""
        unstarted = self.engine.unstarted()
        now = time.time()
        with self._cv:
            streams = {rid: self._streams.get(rid) for rid in unstarted}
        expired = [rid for rid, s in streams.items() if s is not None and s.deadline is not None and s.deadline <= now]
        for rid in expired:
            self.engine.abort(rid)
            streams[rid].fail(QueueTimeout("the request did not start before its queue deadline"))
        with self._cv:
            self._waiting = len(unstarted) - len(expired)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand the step's outputs to their readers, one wake-up of each reader's event loop per step. A request
        whose reader fell too far behind or is gone is aborted, and its stream unregistered (its reader, if any,
        holds it and meets the error)."""
        with self._cv:
            targets = [(self._streams.get(o.request_id), o) for o in outputs]
        ready, cut = [], []
        for s, o in targets:
            if s is not None:
                item = s.offer(o, self.max_buffered_outputs)
                if item is False:
                    cut.append(o.request_id)
                elif item is not None:
                    ready.append((s, item))
        gone = post_all(ready)
        cut += list(dict.fromkeys(o.request_id for s, o in ready if s in gone))
        if cut:
            with self._cv:
                self._aborts += cut
                for request_id in cut:
                    self._streams.pop(request_id, None)

    def _fail(self, request_id: str, exc: Exception) -> None:
        with self._cv:
            stream = self._streams.get(request_id)
        if stream is not None:
            passes = isinstance(exc, (ValueError, EngineError))
            stream.fail(exc if passes else RuntimeError(f"request failed: {exc!r}"))

    def _fail_all(self, exc: Exception) -> None:
        """Fail every open request with `exc` and have the loop abort them (a request already aborted, or
        never added, is a no-op for the engine)."""
        with self._cv:
            streams = list(self._streams.items())
            self._aborts += [rid for rid, _ in streams]
            self._cv.notify()
        for _, stream in streams:
            stream.fail(exc)


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

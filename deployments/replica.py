"""`EngineReplica`: one engine (with its compressed state cache) per Serve replica.

- `generate(GenerateRequest)` streams `RequestOutput.wire()` dicts (call it with a streaming handle): deltas per
  chunk, the full text and token ids on the last.
- `record_routing_stats()` publishes the digest of the prefixes it holds KV for, the marks of its checkpoints (and of
  its host and disk tiers' entries, with their bytes and the measured load and read costs per byte), the engine's
  load (`app/engine/load.py`) and the latest prompt_cache_keys it served (hashed): what the router predicts a
  request's TTFT from.
- A background loop pushes a telemetry window to the tuning controller every `window_s` (with the setting it
  runs, which a recreated controller adopts) and applies the assignment it reads back (between engine steps;
  a codec change drops the old checkpoints). It retunes only when the assigned setting differs from the one it
  runs: a recreated controller restarts its version counter, and that alone must not flush the cache.
- `check_health()` (Serve calls it every `health_check_period_s`) probes the engine's step thread
  (`AsyncEngine.check_alive`, no generation): a replica whose engine cannot step fails it and Serve replaces it.
- `__del__` (Serve calls it on graceful shutdown, after waiting up to `graceful_shutdown_timeout_s` for the
  requests in flight) drains and stops the engine.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import OrderedDict

import torch
from ray import serve

from app.cache.digest import prefix_digest
from app.engine.async_engine import AsyncEngine
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.errors import EngineUnavailable
from app.engine.load import load_report
from app.engine.tp import build_engine
from deployments.controller import ControllerClient
from deployments.logs import through_serve
from deployments.messages import ExportRequest, FetchStatusRequest, GenerateRequest
from deployments.peer_fetch import PeerFetcher, pack, store_room

log = logging.getLogger("ray.serve")
SETTING_FIELDS = ("w_max", "policy", "interval", "lookback")
# snapshot blocks a replica reports besides its flat fields: the acceptance histogram's counts (/metrics'
# spec_decode_acceptance_length), the disk tier's counters (/metrics' dasc:disk_tier_*) and the background compile's
# progress (/status)
REPORTED_BLOCKS = ("spec_accepted_per_verify", "disk_tier", "compile")  # (and the replica's own `peer_fetch` counters)
KEYS_PUBLISHED = 1024  # the latest prompt_cache_keys (hashed) a replica served, published for the router
DISK_MARKS = 2048  # the disk tier's most recently used entries a replica publishes marks of


class EngineReplica:
    def __init__(self, model: str, engine: dict, digest_block: int, controller: dict, threads: int = 1,
                 tp_size: int = 1, placement: str = "off", alive_timeout_s: float = 10.0,
                 drain_timeout_s: float = 10.0) -> None:
        torch.set_num_threads(threads)
        through_serve("app.engine.compile")  # the background compile's progress, in the replica's log
        # built in the engine's step thread, where all its torch work runs (see AsyncEngine)
        self.engine = AsyncEngine(lambda: build_engine(model, EngineConfig(**engine), tp_size, placement))
        self.digest_block = digest_block
        self.alive_timeout_s, self.drain_timeout_s = alive_timeout_s, drain_timeout_s
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._ttfts: list[float] = []
        self._keys: OrderedDict[int, None] = OrderedDict()  # hashed prompt_cache_keys served lately, the newest last
        self._requests = 0
        self._waiting_peak = 0  # most requests waiting in the engine seen this window (sampled with routing stats)
        self._last = self.engine.snapshot()
        self._stats_version = 0
        self._applied_version = 0
        self._window_s = controller.get("window_s", 10.0)
        # telemetry always flows (for /metrics); the controller tunes only if enabled
        self._controller = ControllerClient(controller["actor"])
        self._task = asyncio.get_event_loop().create_task(self._telemetry_loop())
        context = serve.get_replica_context()
        self.fetcher = PeerFetcher(self.replica_id, self.engine, lambda: self._peer_handle(context),
                                   max_bytes=store_room())
        self._peers = None

    def _peer_handle(self, context):
        if self._peers is None:
            self._peers = serve.get_deployment_handle(context.deployment, context.app_name)
        return self._peers

    async def export_entry(self, request: ExportRequest) -> dict | None:
        """A peer's fetch (deployments/peer_fetch.py): the deepest checkpoint this engine holds for the prompt,
        exported between two steps or during a step's forward (`AsyncEngine.cache_call`), packed for the object
        store; None if it holds none; {"gone": True} if the router sent it here, another replica than the one it
        names (that one is gone: killed, or scaled down)."""
        if request.route_to != self.replica_id:
            return {"gone": True}
        asked = time.perf_counter()
        began, entry = await asyncio.to_thread(self.engine.cache_call, lambda e: (
            time.perf_counter(), e.export_entry(request.prompt_ids, request.limit, request.salt)))
        return None if entry is None else pack(entry) | {"waited_s": began - asked}  # its wait for the cache lock

    async def peer_fetch_status(self, request: FetchStatusRequest) -> dict:
        """This replica's peer fetches under way (`in_flight`: distinct entries being pulled) and its fetch counters,
        as of now (the /status figures are the latest telemetry window's)."""
        return {"replica": self.replica_id, "in_flight": self.fetcher.in_flight, "max_bytes": self.fetcher.max_bytes,
                **self.fetcher.stats()}

    async def generate(self, request: GenerateRequest):
        start, first = time.perf_counter(), True
        plan = (request.fetch or {}).get(self.replica_id)
        if plan is not None and self._can_fetch:
            await self.fetcher.fetch(request, self._tail(), plan)
        elif self.fetcher.in_flight:  # a fetch under way may bring this prompt's checkpoint (the router counts on it)
            await self.fetcher.join(request)
        if request.affinity is not None:
            self._keys[request.affinity] = None
            self._keys.move_to_end(request.affinity)
            while len(self._keys) > KEYS_PUBLISHED:
                self._keys.popitem(last=False)
        try:
            async for out in self.engine.generate(request.prompt_ids, request.params, request.request_id,
                                                  deadline=request.deadline, stream=request.stream):
                if first:
                    self._ttfts.append(time.perf_counter() - start)
                    first = False
                yield {**out.wire(), "replica": self.replica_id}
        except EngineUnavailable as exc:
            exc.replica = self.replica_id  # the ingress retries elsewhere and tells the router to skip this one
            raise
        self._requests += 1

    async def record_routing_stats(self) -> dict:
        def collect(engine: Engine):
            running, waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
            host = engine.cache.host
            tier = {"host_marks": host.marks(self.digest_block), "host_s_per_byte": host.load_s_per_byte} \
                if host is not None else {}
            tier |= {"can_fetch": self._can_fetch, "fetch_room": self.fetcher.max_bytes,
                     "state_bytes": engine.codec.bytes_per_slot,
                     "kv_bytes_per_token": engine.worker.kv.bytes_per_token,
                     "fetch_costs": self.fetcher.links.all()}
            return running, waiting, prefix_digest(engine.cache.tree, self.digest_block), {**load_report(engine),
                                                                                          **tier}

        # under the cache lock alone: read during a step's forward, the stats need not wait for it
        running, waiting, (digest, marks), load = await asyncio.to_thread(self.engine.cache_call, collect)
        disk = self.engine.engine.cache.disk
        if disk is not None:  # its own lock: hashing a restarted tier's index must not hold up a step
            load |= {"disk_marks": await asyncio.to_thread(disk.marks, self.digest_block, DISK_MARKS),
                     "disk_s_per_byte": disk.read_s_per_byte}
        self._waiting_peak = max(self._waiting_peak, waiting)
        self._stats_version += 1
        return {"queue": running + waiting, "digest": digest, "marks": marks, "version": self._stats_version,
                "keys": list(self._keys), **load}

    async def snapshot(self) -> dict:
        return await asyncio.to_thread(self.engine.snapshot)

    async def check_integrity(self) -> dict:
        """`Engine.check_integrity()` between steps (raises on a leaked KV or state slot), and what the engine
        holds: the reliability suite calls it after its disconnect storm."""

        def check(engine: Engine) -> dict:
            engine.check_integrity()
            snap = engine.snapshot()
            return {"replica": self.replica_id, "running": snap["running"], "waiting": snap["waiting"],
                    "kv_slots_free": engine.cache.kv.num_free, "state_slots_free": engine.scheduler.states.num_free}

        return await asyncio.to_thread(self.engine.call, check)

    async def check_health(self) -> None:
        """Serve's health check: raises (EngineUnavailable) unless the engine's step thread comes round its loop
        within `alive_timeout_s` (keep it below the deployment's health_check_timeout_s)."""
        await asyncio.to_thread(self.engine.check_alive, self.alive_timeout_s)

    async def stop_engine(self) -> str:
        """Stop this replica's engine (operators and tests: a replica that cannot step). Its health check then
        fails and Serve replaces it; requests reaching it meanwhile fail before their first token, so the
        ingress retries them on another replica. Returns this replica's id."""
        await asyncio.to_thread(self.engine.shutdown)
        return self.replica_id

    async def fail_next_step(self, reason: str) -> str:
        """Make this replica's next engine step raise RuntimeError(reason), as a device fault would (operators and
        tests: the requests of that step fail, and the engine serves on). Returns this replica's id."""
        def arm(engine: Engine) -> None:
            run = engine.worker.run

            def failing(batch):
                engine.worker.run = run
                raise RuntimeError(reason)

            engine.worker.run = failing

        await asyncio.to_thread(self.engine.call, arm)
        return self.replica_id

    async def __del__(self) -> None:
        """Graceful shutdown (Serve awaits an async `__del__`): Serve has waited up to graceful_shutdown_timeout_s
        for the requests in flight; the engine finishes what it still holds within `drain_timeout_s`
        (`AsyncEngine.drain`: new requests are refused meanwhile, the rest fail after it), then stops."""
        task, engine = getattr(self, "_task", None), getattr(self, "engine", None)
        if task is not None:
            task.cancel()
        if engine is None:
            return
        try:  # drains, persists what the pool and the host tier hold to the disk tier (if any), shuts down
            await engine.stop(self.drain_timeout_s)
        except Exception as exc:  # noqa: BLE001 - shutting down regardless
            log.warning("engine stop failed: %r", exc)
        group = getattr(engine.engine, "tp_group", None)
        if group is not None:  # TP ranks 1..T-1: stop them now rather than when they notice this process is gone
            await asyncio.to_thread(group.close)

    async def _telemetry_loop(self) -> None:
        while True:
            await asyncio.sleep(self._window_s)
            try:
                await self._push_and_apply()
            except Exception as exc:  # noqa: BLE001 - telemetry must never take the replica down
                log.warning("telemetry window failed: %r", exc)

    @property
    def _can_fetch(self) -> bool:
        """Whether this replica takes the router's fetches: `engine.peer_fetch`, one worker (a host tier to file in)."""
        engine = self.engine.engine
        return engine.cfg.peer_fetch and engine.cache.host is not None and getattr(engine, "tp_group", None) is None

    def _tail(self) -> int:
        return self.engine.engine.cfg.tail

    def _setting(self) -> dict:
        cfg = self.engine.engine.cfg
        return {k: getattr(cfg, k) for k in SETTING_FIELDS}

    async def _push_and_apply(self) -> None:
        snap = await asyncio.to_thread(self.engine.snapshot)
        last, self._last = self._last, snap
        ttfts, self._ttfts = self._ttfts, []
        requests, self._requests = self._requests, 0
        peak, self._waiting_peak = self._waiting_peak, 0
        window = {"replica": self.replica_id, "version": self._applied_version, "requests": requests,
                  "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
                  **cache_window(snap, last, self._tail()),
                  # overload: the peak waiting (routing-stats samples and now) and refusals (if the engine counts them)
                  "waiting": max(peak, snap["waiting"]), "rejected": snap.get("rejected", 0) - last.get("rejected", 0)}
        running = self._setting()
        await self._controller.call("report", window, reported(snap) | {"peer_fetch": self.fetcher.stats()}, running)
        version, setting = await self._controller.call("assignment", self.replica_id, running)
        if setting != running:
            await asyncio.to_thread(self.engine.call, lambda e: e.retune(**setting))
        self._applied_version = version


def reported(snap: dict) -> dict:
    """What a replica reports of its engine snapshot (/status, /metrics): the flat fields, and the blocks that
    /metrics reads (`REPORTED_BLOCKS`)."""
    return {k: v for k, v in snap.items() if not isinstance(v, dict) or k in REPORTED_BLOCKS}


def cache_window(snap: dict, last: dict, tail: int) -> dict:
    """A telemetry window's cache fields from two engine snapshots (`Engine.snapshot`) a window apart: hit rate,
    checkpoint occupancy (and `dispensable`, the share of slots held by lookback checkpoints that eviction takes
    first), evictions, wr replay time, the compression ratio; lookback checkpoints stored, first reused and evicted
    unused in the window; `branched`, the share of admitted requests that left a stored prompt's path before its end and
    replayed the shared part (what a longer lookback would have saved), and `branch_back`, how far before it (the
    median's power-of-two bucket); `lost`: the share of admitted requests
    that resumed behind a checkpoint evicted for room (cache pressure that costs something: evicting what nobody
    asks for again costs nothing); and `replayed`: the tokens an admitted request recomputed between its
    checkpoint and the end of its KV match, less those an evicted checkpoint or one a layout change discarded
    would have saved (the replay after a retune is not what intervals shorten) and less the nr recompute `tail`
    (which a hit replays by design): what interval checkpoints would shorten."""
    prompt = snap["prompt_tokens"] - last["prompt_tokens"]
    return {
        "hit_rate": (snap["cached_tokens"] - last["cached_tokens"]) / prompt if prompt else 0.0,
        "occupancy": snap["checkpoint_slots_used"] / max(snap["checkpoint_slots"], 1),
        "evictions": snap["checkpoint_evictions"] - last["checkpoint_evictions"],
        "wr_replay_s": snap["wr_replay_s"] - last["wr_replay_s"],
        "lost": _per(snap, last, "sequences_lost", "sequences_admitted"),
        "replayed": max(0.0, _per(snap, last, "replayed_tokens", "sequences_admitted")
                        - _per(snap, last, "lost_tokens", "sequences_admitted")
                        - _per(snap, last, "discarded_tokens", "sequences_admitted") - tail),
        "compression": snap["dasc"]["compression_ratio"] if snap.get("dasc") else 1.0,
        "dispensable": snap.get("checkpoint_slots_dispensable", 0) / max(snap["checkpoint_slots"], 1),
        **{f"lookback_{k}": _kind(snap, "lookback", f) - _kind(last, "lookback", f)
           for k, f in (("stored", "stored"), ("reused", "reused"), ("evicted", "evicted_unused"))},
        **_branched(snap, last),
    }


def _kind(snap: dict, kind: str, field: str) -> int:
    return snap.get("checkpoint_reuse_by_kind", {}).get(kind, {}).get(field, 0)


def _branched(snap: dict, last: dict) -> dict:
    """The window's `branched` share of admitted requests and their median `branch_back` bucket (0 if none)."""
    now, before = snap.get("sequences_branched", {}), last.get("sequences_branched", {})
    counts = {b: n - before.get(b, 0) for b, n in sorted(now.items()) if n > before.get(b, 0)}
    total, admitted = sum(counts.values()), snap.get("sequences_admitted", 0) - last.get("sequences_admitted", 0)
    seen, median = 0, 0
    for bucket, n in counts.items():
        seen += n
        if 2 * seen >= total:
            median = bucket
            break
    return {"branched": total / admitted if admitted > 0 else 0.0, "branch_back": float(median)}


def _per(snap: dict, last: dict, total: str, count: str) -> float:
    """The window's increase of counter `total` per increase of counter `count` (0 when `count` did not grow)."""
    n = snap.get(count, 0) - last.get(count, 0)
    return (snap.get(total, 0) - last.get(total, 0)) / n if n > 0 else 0.0

"""`EngineReplica`: one engine (with its compressed state cache) per Serve replica.

- `generate(GenerateRequest)` streams `RequestOutput.wire()` dicts (call it with a streaming handle): deltas per
  chunk, the full text and token ids on the last.
- `record_routing_stats()` publishes the queue length and the digest of prefixes it holds checkpoints for.
- A background loop pushes a telemetry window to the tuning controller every `window_s` and applies the
  assignment it reads back (between engine steps; a codec change drops the old checkpoints).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time

import torch
from ray import serve

from app.cache.digest import tree_digest
from app.engine.async_engine import AsyncEngine
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.tp import build_engine
from deployments import controller as controller_mod
from deployments.messages import GenerateRequest

log = logging.getLogger("ray.serve")


class EngineReplica:
    def __init__(self, model: str, engine: dict, digest_block: int, controller: dict, threads: int = 1,
                 tp_size: int = 1, placement: str = "off") -> None:
        torch.set_num_threads(threads)
        # built in the engine's step thread, where all its torch work runs (see AsyncEngine)
        self.engine = AsyncEngine(lambda: build_engine(model, EngineConfig(**engine), tp_size, placement))
        self.digest_block = digest_block
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._ttfts: list[float] = []
        self._requests = 0
        self._waiting_peak = 0  # most requests waiting in the engine seen this window (sampled with routing stats)
        self._last = self.engine.snapshot()
        self._stats_version = 0
        self._applied_version = 0
        self._controller_cfg = controller
        self._controller = None  # telemetry always flows (for /metrics); the controller tunes only if enabled
        self._task = asyncio.get_event_loop().create_task(self._telemetry_loop())

    async def generate(self, request: GenerateRequest):
        start, first = time.perf_counter(), True
        async for out in self.engine.generate(request.prompt_ids, request.params, request.request_id):
            if first:
                self._ttfts.append(time.perf_counter() - start)
                first = False
            yield {**out.wire(), "replica": self.replica_id}
        self._requests += 1

    async def record_routing_stats(self) -> dict:
        def collect(engine: Engine):
            return engine.snapshot(), tree_digest(engine.cache.tree, self.digest_block)

        snap, digest = await asyncio.to_thread(self.engine.call, collect)
        self._waiting_peak = max(self._waiting_peak, snap["waiting"])
        self._stats_version += 1
        return {"queue": snap["running"] + snap["waiting"], "digest": digest, "version": self._stats_version}

    async def snapshot(self) -> dict:
        return await asyncio.to_thread(self.engine.snapshot)

    async def _telemetry_loop(self) -> None:
        cfg = self._controller_cfg
        while True:
            await asyncio.sleep(cfg.get("window_s", 10.0))
            try:
                await self._push_and_apply()
            except Exception as exc:  # noqa: BLE001 - telemetry must never take the replica down
                log.warning("telemetry window failed: %r", exc)

    async def _push_and_apply(self) -> None:
        if self._controller is None:
            self._controller = controller_mod.get_or_create(**self._controller_cfg["actor"])
        snap = await asyncio.to_thread(self.engine.snapshot)
        last, self._last = self._last, snap
        ttfts, self._ttfts = self._ttfts, []
        requests, self._requests = self._requests, 0
        peak, self._waiting_peak = self._waiting_peak, 0
        prompt = snap["prompt_tokens"] - last["prompt_tokens"]
        window = {
            "replica": self.replica_id, "version": self._applied_version, "requests": requests,
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
            "hit_rate": (snap["cached_tokens"] - last["cached_tokens"]) / prompt if prompt else 0.0,
            "occupancy": snap["checkpoint_slots_used"] / max(snap["checkpoint_slots"], 1),
            "evictions": snap["checkpoint_evictions"] - last["checkpoint_evictions"],
            "wr_replay_s": snap["wr_replay_s"] - last["wr_replay_s"],
            # overload: the peak waiting (routing-stats samples and now) and refusals (if the engine counts them)
            "waiting": max(peak, snap["waiting"]), "rejected": snap.get("rejected", 0) - last.get("rejected", 0),
        }
        await self._controller.report.remote(window, {k: v for k, v in snap.items() if not isinstance(v, dict)})
        version, setting = await self._controller.assignment.remote(self.replica_id)
        if version != self._applied_version:
            await asyncio.to_thread(self.engine.call, lambda e: e.retune(**setting))
            self._applied_version = version

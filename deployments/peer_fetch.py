"""Peer fetches (issue 40): a replica pulls, before a request starts, the checkpoint a peer holds for its prompt, when
the router priced that below queueing at the holder and below recomputing (`routing_policy.choose`, which sets
`GenerateRequest.fetch`).

- The fetcher calls the holder's `export_entry` through a DeploymentHandle with an `ExportRequest` naming the
  holder, which our router sends to that replica alone. The holder's engine exports holding its cache lock alone
  (`AsyncEngine.cache_call`): during a step's forward or between steps, never waiting for a forward. It exports
  the deepest checkpoint of the request's salt the prompt starts with, from its pools, its host tier or its disk
  tier, with its prefix's KV, as host tensors (`Engine.export_entry`). They travel as raw bytes (`pack`, numpy
  uint8 views: Ray's object store takes them out of band, without pickling tensors) and come back as tensors
  (`unpack`).
- The fetcher files the entry into its host tier (`Engine.import_entry`: fingerprints, salt and tokens checked;
  under the cache lock alone, as the export), and the request's admission then loads it as any host-tier hit.
- Shared: a request whose entry (same holder, salt and prefix) is being fetched already waits for that fetch, and
  so does one that came without a plan but whose prompt starts with an entry being fetched (the router counts that
  entry as this replica's from the moment it sent the first request: `expected_marks`).
- Bounded: a fetch gives up after `timeout_s`; at most `max_inflight` run at once (more: the request recomputes);
  an entry's bytes are capped by the router (`RouterKnobs.fetch_max_bytes`) and by the object store: a replica
  takes entries of at most its node's object-store capacity / (2 x max_inflight) (`store_room`: every fetch in
  flight, holder's copy and fetcher's copy, within half the store, so fetches never push the store into spilling
  on their own), publishes that room, and the router plans no fetch above the fetcher's or the holder's. Any
  failure (timeout, a holder that died mid-fetch or is gone, nothing held any more, a refused entry, an entry
  beyond the room) is counted by reason and costs the request a recompute, never an error.
- Measured: each fetch's bytes and seconds, less the time the holder waited for its cache lock (it reports it: the
  router prices the holder's step bookkeeping apart), per holder; `LinkCosts` fits a fixed cost and a cost per
  byte, which the replica publishes for the router (`fetch_costs`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import numpy as np
import torch

from app.cache.disk_format import DTYPES, NAMES
from deployments.messages import ExportRequest, GenerateRequest

FETCH_TIMEOUT_S = 5.0
MAX_INFLIGHT = 2
SAMPLES = 32  # fetches per holder kept for the cost fit


def store_room(max_inflight: int = MAX_INFLIGHT) -> int | None:
    """The largest entry this node's Ray object store takes for a fetch: its capacity / (2 x max_inflight); None
    outside Ray or when the node does not say."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        node = ray.get_runtime_context().get_node_id()
        capacity = next(n["Resources"].get("object_store_memory") for n in ray.nodes() if n["NodeID"] == node)
    except Exception:  # noqa: BLE001 - not in a Ray worker, or the node is not listed: no cap of our own
        return None
    return int(capacity // (2 * max_inflight)) if capacity else None


def pack(entry: dict) -> dict:
    """`Engine.export_entry`'s entry with each tensor as (dtype name, shape, its bytes as a numpy uint8 array)."""
    tensors = {n: (NAMES[t.dtype], list(t.shape), t.detach().contiguous().cpu().view(torch.uint8).numpy().reshape(-1))
               for n, t in entry["tensors"].items()}
    return {**entry, "tensors": tensors}


def unpack(wire: dict) -> dict:
    """`pack`'s inverse (the tensors view the arrays Ray delivered, copied only if read-only)."""
    tensors = {}
    for name, (dtype, shape, raw) in wire["tensors"].items():
        raw = np.asarray(raw, dtype=np.uint8)
        raw = raw if raw.flags.writeable else raw.copy()
        tensors[name] = torch.from_numpy(raw).view(DTYPES[dtype]).reshape(shape)
    return {**wire, "tensors": tensors}


def nbytes(entry: dict) -> int:
    return sum(t.nbytes for t in entry["tensors"].values())


class LinkCosts:
    """Per holder, the latest fetches' (bytes, seconds), fitted as seconds = fixed + per_byte x bytes (least squares;
    with one size only, `per_byte` is the default and `fixed` takes the rest)."""

    def __init__(self, default_per_byte: float = 1e-9) -> None:
        self.default_per_byte = default_per_byte
        self._samples: dict[str, deque] = {}

    def add(self, peer: str, size: int, seconds: float) -> None:
        self._samples.setdefault(peer, deque(maxlen=SAMPLES)).append((size, seconds))

    def fit(self, peer: str) -> tuple[float, float] | None:
        samples = self._samples.get(peer)
        if not samples:
            return None
        xs, ys = [s for s, _ in samples], [t for _, t in samples]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        per_byte = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else self.default_per_byte
        per_byte = max(per_byte, 0.0)
        return max(my - per_byte * mx, 0.0), per_byte

    def all(self) -> dict[str, tuple[float, float]]:
        return {peer: self.fit(peer) for peer in self._samples}


class PeerFetcher:
    """One replica's fetches. `peers()`: a DeploymentHandle to the engine replicas (made on first use); `engine`:
    the replica's AsyncEngine."""

    def __init__(self, replica_id: str, engine, peers, timeout_s: float = FETCH_TIMEOUT_S,
                 max_inflight: int = MAX_INFLIGHT, max_bytes: int | None = None) -> None:
        self.replica_id, self.engine, self._peers = replica_id, engine, peers
        self.timeout_s, self.max_inflight, self.max_bytes = timeout_s, max_inflight, max_bytes
        self.links = LinkCosts()
        self._pending: dict[tuple, asyncio.Future] = {}  # fetches under way, by (holder, salt, depth, prefix hash)
        self.counters = {"fetches": 0, "fetched_bytes": 0, "fetch_s": 0.0, "joined": 0, "failed": {}}

    async def fetch(self, request: GenerateRequest, tail: int, plan: tuple) -> bool:
        """Pull the checkpoint `plan` (this replica's in `request.fetch`: holder, bytes, depth) names into the engine's
        host tier; False (counted) if it did not come.
        Requests whose fetch is already under way (the same holder, salt and prefix) wait for that one instead of
        pulling the same entry again (or recomputing it because the in-flight cap is reached)."""
        holder, depth = plan[0], (plan[2] if len(plan) > 2 else 0)
        if holder == self.replica_id:
            return self._fail("self")
        if self.max_bytes is not None and len(plan) > 1 and plan[1] > self.max_bytes:
            return self._fail("too_large")  # beyond the object store's room for it
        limit = len(request.prompt_ids) - 1 - tail
        depth = min(depth or limit, limit)
        key = (holder, request.params.cache_salt, depth, hash(tuple(request.prompt_ids[:depth])))
        joined = self._pending.get(key)
        if joined is not None:
            self.counters["joined"] += 1
            return await asyncio.shield(joined)
        if self.in_flight >= self.max_inflight:
            return self._fail("busy")
        self._pending[key] = asyncio.get_running_loop().create_future()
        try:
            done = await self._pull(request, holder, limit)
        finally:
            future = self._pending.pop(key)
        future.set_result(done)
        return done

    async def join(self, request: GenerateRequest) -> bool:
        """Wait for a fetch under way whose entry `request`'s prompt starts with (same salt), if any: a request the
        router sent here expecting the checkpoint another request is fetching (it counts that one's entry as this
        replica's already) must not start before it lands. False if there was none or it failed."""
        for (_, salt, depth, prefix), future in list(self._pending.items()):
            if salt == request.params.cache_salt and len(request.prompt_ids) > depth and \
                    hash(tuple(request.prompt_ids[:depth])) == prefix:
                self.counters["joined"] += 1
                return await asyncio.shield(future)
        return False

    async def _pull(self, request: GenerateRequest, holder: str, limit: int) -> bool:
        ask = ExportRequest(holder, request.prompt_ids, limit, request.params.cache_salt)
        start = time.perf_counter()
        response = self._peers().export_entry.remote(ask)
        try:
            wire = await asyncio.wait_for(asyncio.shield(_result(response)), self.timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            return self._fail("timeout")
        except Exception:  # noqa: BLE001 - the holder died or failed mid-fetch: recompute
            return self._fail("holder")
        if wire is None:
            return self._fail("not_held")
        if wire.get("gone"):  # the holder is no longer there: the router sent the call elsewhere
            return self._fail("holder")
        entry = unpack(wire)
        why = await asyncio.to_thread(self.engine.cache_call, lambda e: e.import_entry(entry, request.prompt_ids,
                                                                                 request.params.cache_salt))
        if why is not None:
            return self._fail(why)
        seconds, size = time.perf_counter() - start, nbytes(entry)
        # the link's cost, without the holder's wait for its cache lock (the router prices that apart)
        self.links.add(holder, size, max(0.0, seconds - float(wire.get("waited_s", 0.0))))
        self.counters["fetches"] += 1
        self.counters["fetched_bytes"] += size
        self.counters["fetch_s"] += seconds
        return True

    @property
    def in_flight(self) -> int:
        """Distinct entries being pulled now (each fetch under way holds one `_pending` future)."""
        return len(self._pending)

    def _fail(self, reason: str) -> bool:
        self.counters["failed"][reason] = self.counters["failed"].get(reason, 0) + 1
        return False

    def stats(self) -> dict:
        return {**self.counters, "failed": dict(self.counters["failed"]), "fetch_costs": self.links.all()}


async def _result(response):
    return await response

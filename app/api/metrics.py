"""Prometheus metrics of the API: request counts and TTFT observed at the front door, plus engine and
controller state published as gauges at scrape time (one label set per replica; a replica the controller no
longer lists, because it died or was replaced, leaves them at the next scrape)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ENGINE_GAUGES = {
    "hit_rate": "token-weighted prefix cache hit rate (cached prompt tokens / prompt tokens)",
    "checkpoint_slots": "checkpoint slots in the pool",
    "checkpoint_slots_used": "checkpoint slots holding a checkpoint",
    "checkpoint_bytes_per_slot": "bytes one checkpoint occupies",
    "checkpoint_evictions": "checkpoints evicted so far",
    "checkpoint_stores": "checkpoints stored so far",
    "checkpoint_loads": "checkpoints loaded (cache hits) so far",
    "replayed_tokens": "tokens recomputed from an earlier checkpoint so far",
    "wr_replay_tokens": "tokens replayed by dasc-wr refreshes so far",
    "running": "sequences running",
    "waiting": "sequences waiting",
    "prompt_tokens": "prompt tokens seen",
    "cached_tokens": "prompt tokens served from the cache",
}


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("dasc_requests", "API requests by route and outcome", ["route", "outcome"],
                                registry=self.registry)
        self.retries = Counter("dasc_retries", "requests retried on another replica after theirs failed before "
                               "the first token", registry=self.registry)
        self.ttft = Histogram("dasc_ttft_seconds", "time to first token seen by the API", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.engine = {k: Gauge(f"dasc_engine_{k}", doc, ["replica"], registry=self.registry)
                       for k, doc in ENGINE_GAUGES.items()}
        self.controller = Gauge("dasc_controller", "tuning controller state", ["field"], registry=self.registry)
        self._replicas: set[str] = set()  # replicas with label sets in the engine gauges

    def render(self, snapshots: dict[str, dict], controller: dict | None = None) -> str:
        """The registry as Prometheus text, with the engine gauges set from `snapshots` (the replicas alive now,
        by id) and the controller gauge from `controller` (flat numeric fields)."""
        for gone in self._replicas - snapshots.keys():
            for gauge in self.engine.values():
                try:
                    gauge.remove(gone)
                except KeyError:  # this gauge never had a value for it
                    pass
        self._replicas = set(snapshots)
        for replica, snap in snapshots.items():
            for key, gauge in self.engine.items():
                value = snap.get(key)
                if isinstance(value, (int, float)):
                    gauge.labels(replica=replica).set(value)
        for key, value in (controller or {}).items():
            if isinstance(value, bool):
                value = float(value)
            if isinstance(value, (int, float)):
                self.controller.labels(field=key).set(value)
        return generate_latest(self.registry).decode()

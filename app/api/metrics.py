"""Prometheus metrics of the API, in two families.

- vLLM's metrics under our prefix (`dasc:time_to_first_token_seconds`, `dasc:prompt_tokens_total`, ...: the names,
  types, buckets and `model_name` / `engine` labels of vLLM v1, so its dashboards work after a prefix change).
  Per-request latencies and token counts are observed where each generation's outputs flow, by a
  `GenerationMeter` the backend runs over them; running / waiting and the prefix cache's queries and hits come
  from the engine snapshots at scrape time. `engine` is the replica that served ("local" without Ray).
- Our own (`dasc_requests`, `dasc_ttft_seconds`, `dasc_engine_*`, `dasc_controller`): engine and controller
  state as gauges, one label set per replica alive now (a replica the controller no longer lists, because it
  died or was replaced, leaves them at the next scrape).

Counters never decrease. The prefix cache counters are derived from the snapshots' running totals, which a
replica's engine restarts from 0: each scrape adds what a replica's total grew by since the previous one (all
of it when it went down, as after a restart), and a replica that left keeps its series at the last value, so a
sum over `engine` never drops either.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from app.engine.request import RequestOutput

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# vLLM v1's buckets (vllm/v1/metrics/loggers.py)
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
LABELS = ("model_name", "engine")
LOCAL = "local"  # the engine label of outputs no replica named (the local backend)
# snapshot running totals -> the vLLM counter each one feeds (in tokens, as vLLM v1 counts the prefix cache)
SNAPSHOT_COUNTERS = {"prompt_tokens": "prefix_cache_queries", "cached_tokens": "prefix_cache_hits",
                     "spec_verifies": "spec_decode_num_drafts", "spec_drafted_tokens": "spec_decode_num_draft_tokens",
                     "spec_accepted_tokens": "spec_decode_num_accepted_tokens"}
# cache tiers below the pools (app/cache/host_tier.py): snapshot fields `<tier>_tier_<field>`
TIERS = ("host",)
TIER_COUNTERS = {"hits": "hits: lookups that found a deeper checkpoint there", "demotions": "checkpoints demoted there "
                 "(with their prefix's KV)", "promotions": "entries loaded back into the pools",
                 "promoted_tokens": "prefill tokens those promotions saved", "evictions": "entries evicted for room"}
# the disk tier: running totals of its /status block, its counts by reason, and what it holds now
DISK_COUNTERS = {"writes": "entries written behind", "written_bytes": "bytes written behind"}
DISK_REASONS = {"rejected": "files refused (torn, corrupted, unauthenticated, foreign, mismatched, shape)",
                "skipped_writes": "entries not written (a full queue, a full or unwritable disk)"}
DISK_GAUGES = {"queued": ("queue_length", "entries waiting to be written behind"),
               "stored_files": ("files", "files in the directory (at the last sweep, plus writes since)"),
               "stored_bytes": ("bytes", "bytes in the directory (at the last sweep, plus writes since)")}
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
ACCEPTED_BUCKETS = tuple(float(a) for a in range(17))  # accepted drafts per verify piece: 0 .. MAX_SPEC_TOKENS
ENGINE_GAUGES = {
    "hit_rate": "token-weighted prefix cache hit rate (cached prompt tokens / prompt tokens)",
    "checkpoint_slots": "checkpoint slots in the pool",
    "checkpoint_slots_used": "checkpoint slots holding a checkpoint",
    "checkpoint_slots_dispensable": "of them, lookback checkpoints with a reused checkpoint below (evicted first)",
    "checkpoint_bytes_per_slot": "bytes one checkpoint occupies",
    "checkpoint_evictions": "checkpoints evicted so far",
    "checkpoint_stores": "checkpoints stored so far",
    "checkpoint_loads": "checkpoints loaded (cache hits) so far",
    "replayed_tokens": "tokens recomputed from an earlier checkpoint so far",
    "lost_tokens": "of them, tokens a checkpoint evicted for room would have saved",
    "discarded_tokens": "of them, beyond those, tokens checkpoints a layout change discarded would have saved",
    "wr_replay_tokens": "tokens replayed by dasc-wr refreshes so far",
    "running": "sequences running",
    "waiting": "sequences waiting",
    "prompt_tokens": "prompt tokens seen",
    "cached_tokens": "prompt tokens served from the cache",
}


class ApiMetrics:
    def __init__(self, model_name: str = LOCAL) -> None:
        """`model_name`: the served model name, the value of every vLLM-named metric's `model_name` label."""
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dasc_requests", "API requests by route and outcome", ["route", "outcome"],
                                registry=r)
        self.retries = Counter("dasc_retries", "requests retried on another replica after theirs failed before "
                               "the first token", registry=r)
        self.ttft = Histogram("dasc_ttft_seconds", "time to first token seen by the API", buckets=TTFT_BUCKETS,
                              registry=r)
        self.engine = {k: Gauge(f"dasc_engine_{k}", doc, ["replica"], registry=r) for k, doc in ENGINE_GAUGES.items()}
        self.controller = Gauge("dasc_controller", "tuning controller state", ["field"], registry=r)
        self.response_store = Histogram("dasc_response_store_seconds", "Responses API: time of one operation on the "
                                        "response store (get, put, delete), as the API awaits it", ["op"],
                                        buckets=STORE_BUCKETS, registry=r)
        self._replicas: set[str] = set()  # replicas with label sets in the gauges

        self.time_to_first_token = Histogram("dasc:time_to_first_token_seconds", "Histogram of time to first "
                                             "token in seconds.", LABELS, buckets=VLLM_TTFT_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("dasc:time_per_output_token_seconds", "Histogram of time per output "
                                               "token in seconds (vLLM's older name of the inter-token latency).",
                                               LABELS, buckets=VLLM_ITL_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("dasc:inter_token_latency_seconds", "Histogram of inter-token latency "
                                             "in seconds.", LABELS, buckets=VLLM_ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram("dasc:e2e_request_latency_seconds", "Histogram of e2e request latency "
                                             "in seconds.", LABELS, buckets=VLLM_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("dasc:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r)
        self.generation_tokens = Counter("dasc:generation_tokens", "Number of generation tokens processed.", LABELS,
                                         registry=r)
        self.request_success = Counter("dasc:request_success", "Count of successfully processed requests.",
                                       LABELS + ("finished_reason",), registry=r)
        self.num_requests_running = Gauge("dasc:num_requests_running", "Number of requests in model execution "
                                          "batches.", LABELS, registry=r)
        self.num_requests_waiting = Gauge("dasc:num_requests_waiting", "Number of requests waiting to be "
                                          "processed.", LABELS, registry=r)
        self.prefix_cache_queries = Counter("dasc:prefix_cache_queries", "Prefix cache queries, in terms of number "
                                            "of queried tokens.", LABELS, registry=r)
        self.prefix_cache_hits = Counter("dasc:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                         "tokens.", LABELS, registry=r)
        # speculative decoding (vLLM v1's names): verify pieces, drafts verified, drafts accepted; and the
        # distribution of accepted drafts per verify piece
        self.spec_decode_num_drafts = Counter("dasc:spec_decode_num_drafts", "Number of verified draft sequences.",
                                              LABELS, registry=r)
        self.spec_decode_num_draft_tokens = Counter("dasc:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                                    LABELS, registry=r)
        self.spec_decode_num_accepted_tokens = Counter("dasc:spec_decode_num_accepted_tokens", "Number of accepted "
                                                       "draft tokens.", LABELS, registry=r)
        self.spec_decode_acceptance_length = Histogram("dasc:spec_decode_acceptance_length", "Accepted draft tokens "
                                                       "per verified draft sequence.", LABELS,
                                                       buckets=ACCEPTED_BUCKETS, registry=r)
        # cache tiers below the pools: what each holds now, and running totals (`TIER_COUNTERS`)
        tier_labels = LABELS + ("tier",)
        self.tier_entries = Gauge("dasc:cache_tier_entries", "Checkpoints held in a cache tier below the pools.",
                                  tier_labels, registry=r)
        self.tier_bytes = Gauge("dasc:cache_tier_bytes", "Bytes held in a cache tier, by kind (state or kv).",
                                tier_labels + ("kind",), registry=r)
        self.tier_counters = {k: Counter(f"dasc:cache_tier_{k}", f"Cache tier {doc}.", tier_labels, registry=r)
                              for k, doc in TIER_COUNTERS.items()}
        # the disk tier (app/cache/disk_tier.py; /status `disk_tier`): hits count under `dasc:cache_tier_hits`
        self.disk_counters = {k: Counter(f"dasc:disk_tier_{k}", f"Disk tier {doc}.", LABELS, registry=r)
                              for k, doc in DISK_COUNTERS.items()}
        self.disk_reasons = {k: Counter(f"dasc:disk_tier_{k}", f"Disk tier {doc}, by reason.", LABELS + ("reason",),
                                        registry=r) for k, doc in DISK_REASONS.items()}
        self.disk_gauges = {k: Gauge(f"dasc:disk_tier_{name}", f"Disk tier {doc}.", LABELS, registry=r)
                            for k, (name, doc) in DISK_GAUGES.items()}
        self._totals: dict[str, dict] = {}  # per replica ever seen: its last snapshot running totals

    def meter(self, n: int, stream: bool = True) -> GenerationMeter:
        """A meter for one generation of `n` sequences, started now (`stream`: see `GenerationMeter`)."""
        return GenerationMeter(self, n, stream)

    def render(self, snapshots: dict[str, dict], controller: dict | None = None) -> str:
        """The registry as Prometheus text, with the engine metrics set from `snapshots` (the replicas alive now,
        by id) and the controller gauge from `controller` (flat numeric fields)."""
        for gone in self._replicas - snapshots.keys():
            for gauge in self.engine.values():
                _remove(gauge, gone)
            _remove(self.num_requests_running, self.model_name, gone)
            _remove(self.num_requests_waiting, self.model_name, gone)
            for gauge in self.disk_gauges.values():
                _remove(gauge, self.model_name, gone)
            for tier in TIERS:
                _remove(self.tier_entries, self.model_name, gone, tier)
                for kind in ("state", "kv"):
                    _remove(self.tier_bytes, self.model_name, gone, tier, kind)
        self._replicas = set(snapshots)
        for replica, snap in snapshots.items():
            for key, gauge in self.engine.items():
                value = snap.get(key)
                if isinstance(value, (int, float)):
                    gauge.labels(replica=replica).set(value)
            self.num_requests_running.labels(self.model_name, replica).set(snap.get("running", 0))
            self.num_requests_waiting.labels(self.model_name, replica).set(snap.get("waiting", 0))
            self._count(replica, snap)
        for key, value in (controller or {}).items():
            if isinstance(value, bool):
                value = float(value)
            if isinstance(value, (int, float)):
                self.controller.labels(field=key).set(value)
        return generate_latest(self.registry).decode()

    def _count(self, replica: str, snap: dict) -> None:
        """Add what each of `replica`'s running totals grew by since its last snapshot; a total below the last
        one means its engine restarted from 0, so all of it is new."""
        last = self._totals.setdefault(replica, {})
        counters = [(key, getattr(self, name).labels(self.model_name, replica))
                    for key, name in SNAPSHOT_COUNTERS.items()]
        for tier in TIERS:
            if f"{tier}_tier_entries" not in snap:
                continue
            self.tier_entries.labels(self.model_name, replica, tier).set(snap[f"{tier}_tier_entries"])
            for kind in ("state", "kv"):
                self.tier_bytes.labels(self.model_name, replica, tier, kind).set(snap[f"{tier}_tier_{kind}_bytes"])
            counters += [(f"{tier}_tier_{k}", c.labels(self.model_name, replica, tier))
                         for k, c in self.tier_counters.items()]
        disk = snap.get("disk_tier")
        if isinstance(disk, dict):
            flat = {"disk_tier.hits": disk.get("hits")}
            counters.append(("disk_tier.hits", self.tier_counters["hits"].labels(self.model_name, replica, "disk")))
            for k, c in self.disk_counters.items():
                flat[f"disk_tier.{k}"] = disk.get(k)
                counters.append((f"disk_tier.{k}", c.labels(self.model_name, replica)))
            for k, c in self.disk_reasons.items():
                for reason, n in (disk.get(k) or {}).items():
                    flat[f"disk_tier.{k}.{reason}"] = n
                    counters.append((f"disk_tier.{k}.{reason}", c.labels(self.model_name, replica, reason)))
            for k, g in self.disk_gauges.items():
                if isinstance(disk.get(k), int):
                    g.labels(self.model_name, replica).set(disk[k])
            snap = {**snap, **flat}
        for key, counter in counters:
            total = snap.get(key)
            if not isinstance(total, int):
                continue
            before = last.get(key, 0)
            counter.inc(total - before if total >= before else total)
            last[key] = total
        hist = snap.get("spec_accepted_per_verify")
        if isinstance(hist, dict):
            before = last.get("spec_accepted_per_verify", {})
            restarted = any(n < before.get(a, 0) for a, n in hist.items())
            for a, n in hist.items():
                for _ in range(n if restarted else n - before.get(a, 0)):
                    self.spec_decode_acceptance_length.labels(self.model_name, replica).observe(int(a))
            last["spec_accepted_per_verify"] = dict(hist)


def _remove(gauge: Gauge, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:  # this gauge never had a value for these labels
        pass


class GenerationMeter:
    """Observes one generation (one prompt's `n` sequences) as its outputs flow, in the backend's `generate`.

    The first output gives the time to first token; every later output with new tokens of a sequence gives an
    inter-token latency (the gap since that sequence's previous output: one per engine step, as vLLM observes
    it); each sequence's final output adds its generated tokens and its finish reason; the last one the e2e
    latency and the prompt's tokens (once per prompt, as `usage.prompt_tokens` counts them). A generation that
    never finishes (aborted, failed) counts its TTFT and gaps only. A generation that is not streamed gets each
    sequence's later outputs merged into one (`AsyncEngine.generate`): its gap is spread evenly over its tokens,
    one observation per token."""

    def __init__(self, metrics: ApiMetrics, n: int, stream: bool = True) -> None:
        self.metrics, self.open, self.stream = metrics, n, stream
        self.start = time.perf_counter()
        self._last: dict[int, float] = {}  # sequence index -> when its latest tokens came
        self._first = True

    def observe(self, out: RequestOutput) -> None:
        now, m = time.perf_counter(), self.metrics
        labels = (m.model_name, out.replica or LOCAL)
        if self._first:
            m.ttft.observe(now - self.start)
            m.time_to_first_token.labels(*labels).observe(now - self.start)
            self._first = False
        if out.new_token_ids:
            if out.index in self._last:
                k = 1 if self.stream else len(out.new_token_ids)
                gap = (now - self._last[out.index]) / k
                for _ in range(k):
                    m.inter_token_latency.labels(*labels).observe(gap)
                    m.time_per_output_token.labels(*labels).observe(gap)
            self._last[out.index] = now
        if out.finished:
            m.generation_tokens.labels(*labels).inc(len(out.output_ids))
            m.request_success.labels(*labels, out.finish_reason).inc()
            self.open -= 1
            if self.open == 0:
                m.e2e_request_latency.labels(*labels).observe(now - self.start)
                m.prompt_tokens.labels(*labels).inc(out.prompt_tokens)

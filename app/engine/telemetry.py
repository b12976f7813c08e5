"""Engine telemetry: per-request latencies and lengths, engine-wide cache counters, one snapshot dict.

Hit rate is token-weighted (paper Eq. 9): sum of cached prompt tokens over sum of prompt tokens.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from app.engine.load import StepCost
from app.engine.request import Sequence


@dataclass(frozen=True)
class RequestStats:
    request_id: str
    prompt_len: int
    cached_len: int
    replayed: int
    output_len: int
    ttft_s: float
    tpot_s: float | None
    finish_reason: str


class Telemetry:
    def __init__(self, window: int = 1024) -> None:
        self.recent: deque[RequestStats] = deque(maxlen=window)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.replayed_tokens = 0
        self.lost_tokens = 0  # of them, those a checkpoint evicted for room would have saved
        self.discarded_tokens = 0  # of them, beyond those, what checkpoints a layout change discarded would have saved
        self.lost = 0  # sequences that resumed behind a checkpoint evicted for room
        # sequences that left a stored prompt's path before its end, by distance (rounded up to a power of two)
        self.branch_back: dict[int, int] = {}
        self.output_tokens = 0
        self.finished = 0
        self.steps = 0
        self.wr_replay_tokens = 0
        self.wr_replay_s = 0.0
        self.admitted = 0  # sequences, each counted once
        self.hits = 0  # of them, those that resumed from a checkpoint
        self.compressed_hits = 0  # of them, those that resumed from a lossy one (or forked from one that did)
        self.spec_drafted = 0  # speculative decoding: draft tokens verified
        self.spec_accepted = 0  # of them, accepted
        self.spec_verifies = 0  # verify pieces
        self.spec_accepted_hist: dict[int, int] = {}  # accepted drafts per verify piece -> pieces
        self.step_cost = StepCost()  # step time against tokens per step (what a router predicts TTFT from)
        self.warm_requests = 0  # the server's own requests that store a next turn's checkpoint (`SamplingParams.warm`)
        self.warm_tokens = 0  # the prompt tokens they computed

    def on_verify(self, drafted: int, accepted: int) -> None:
        self.spec_drafted += drafted
        self.spec_accepted += accepted
        self.spec_verifies += 1
        self.spec_accepted_hist[accepted] = self.spec_accepted_hist.get(accepted, 0) + 1

    def on_admit(self, seq: Sequence) -> None:
        """Count a sequence's prompt and hit once, at its first admission (a warm request apart: `warm`)."""
        if seq.params.warm:
            self.warm_requests += 1
            self.warm_tokens += seq.prompt_len - seq.cached_len
            return
        self.prompt_tokens += seq.prompt_len
        self.cached_tokens += seq.cached_len
        self.replayed_tokens += seq.replayed
        self.lost_tokens += seq.lost
        self.discarded_tokens += seq.discarded
        self.lost += seq.lost > 0
        if seq.branch_back is not None:
            bucket = 1 << max(0, seq.branch_back - 1).bit_length()
            self.branch_back[bucket] = self.branch_back.get(bucket, 0) + 1
        self.admitted += 1
        self.hits += seq.cached_len > 0
        self.compressed_hits += seq.compressed_hit

    def on_finish(self, seq: Sequence) -> RequestStats | None:
        if seq.params.warm:
            return None
        ttft = (seq.first_token_time or seq.finish_time) - seq.arrival
        n = len(seq.output_ids)
        tpot = (seq.finish_time - seq.first_token_time) / (n - 1) if n > 1 and seq.first_token_time else None
        stats = RequestStats(seq.request_id, seq.prompt_len, seq.cached_len, seq.replayed, n, ttft, tpot,
                             seq.finish_reason or "")
        self.recent.append(stats)
        self.output_tokens += n
        self.finished += 1
        return stats

    def snapshot(self, cache, states, running: int, waiting: int) -> dict:
        """Everything a replica or controller reads, as plain numbers."""
        ttfts = [r.ttft_s for r in self.recent]
        pool = cache.checkpoints
        c = cache.counters
        return {
            "requests_finished": self.finished,
            "warm_requests": self.warm_requests, "warm_tokens": self.warm_tokens,
            "sequences_admitted": self.admitted,
            "sequences_hit": self.hits,
            "sequences_compressed_hit": self.compressed_hits,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "replayed_tokens": self.replayed_tokens,
            "lost_tokens": self.lost_tokens,
            "discarded_tokens": self.discarded_tokens,
            "sequences_lost": self.lost,
            "sequences_branched": dict(sorted(self.branch_back.items())),
            "output_tokens": self.output_tokens,
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
            "ttft_p90_s": _quantile(ttfts, 0.9),
            "checkpoint_slots": pool.num_slots,
            "checkpoint_slots_used": pool.num_used,
            "checkpoint_slots_free": pool.num_free,
            "checkpoint_bytes_per_slot": pool.bytes_per_slot,
            "checkpoint_bytes_allocated": pool.allocated_bytes,
            "checkpoint_stores": c.stores,
            "checkpoint_stores_by_kind": dict(c.by_kind),
            "checkpoint_reuse_by_kind": c.reuse([n for n in cache.tree.nodes() if n.checkpoint is not None]),
            "checkpoint_slots_dispensable": cache.dispensable(),
            "checkpoint_loads": c.loads,
            "checkpoint_evictions": c.checkpoint_evictions,
            "checkpoint_skipped_stores": c.skipped_stores,
            "kv_slots_free": cache.kv.num_free,
            "kv_evicted_tokens": c.kv_evicted_tokens,
            "running": running,
            "waiting": waiting,
            "state_slots_free": states.num_free,
            "steps": self.steps,
            "wr_replay_tokens": self.wr_replay_tokens,
            "wr_replay_s": self.wr_replay_s,
            "spec_drafted_tokens": self.spec_drafted,
            "spec_accepted_tokens": self.spec_accepted,
            "spec_verifies": self.spec_verifies,
            "spec_accepted_per_verify": dict(sorted(self.spec_accepted_hist.items())),
            **tier_fields("host", cache.host),
        }


def tier_fields(name: str, tier) -> dict:
    """A cache tier's flat snapshot fields (`<name>_tier_*`; none when the tier is off): entries and bytes held
    by kind, running totals of hits (promotions, and the few that found no room to load), demotions,
    promotions, the prefill tokens promotions saved, evictions and layout drops, and the measured load cost."""
    if tier is None:
        return {}
    s = tier.stats()
    return {f"{name}_tier_{k}": v for k, v in (
        ("entries", s["entries"]), ("state_bytes", s["state_bytes"]), ("kv_bytes", s["kv_bytes"]),
        ("budget_bytes", s["budget_bytes"]), ("hits", s["promotions"] + s["failed"]),
        ("demotions", s["demotions"]), ("promotions", s["promotions"]), ("promoted_tokens", s["promoted_tokens"]),
        ("evictions", s["evictions"]), ("layout_drops", s["layout_drops"]), ("load_s_per_byte", s["load_s_per_byte"]))}


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

"""The tuner's terms (deployments/tuner.py): a `Setting` (codec, checkpoint interval, lookback), the operator's
`TunerKnobs` (the ladder of settings it may climb and the thresholds it judges by) and a replica's telemetry
`Window`."""

from __future__ import annotations

from dataclasses import dataclass

from app.dasc.allowance import W_VALUES, setting_label


@dataclass(frozen=True)
class Setting:
    w_max: float | None = None  # None: dense checkpoints
    policy: str = "nr"
    interval: int = 0
    lookback: int = 0

    @property
    def codec(self) -> str:
        """What the allowance rules on: dense, nr-W16, wr-W512, ..."""
        return setting_label(self.w_max, self.policy)

    @property
    def label(self) -> str:
        return (self.codec + (f"/I{self.interval}" if self.interval else "")
                + (f"/L{self.lookback}" if self.lookback else ""))


@dataclass(frozen=True)
class TunerKnobs:
    max_w_nr: float = 128
    max_w_wr: float = 512
    w_values: tuple[float, ...] = W_VALUES
    interval: int = 0
    trial_windows: int = 2
    warmup_windows: int = 1
    refill_windows: int = 3
    refill_rise: float = 0.05  # a trial replica's hit rate rising more than this per window is still refilling
    min_requests: int = 4
    hysteresis: float = 0.05
    pressure_lost: float = 0.1  # share of a window's requests resuming behind an evicted checkpoint: pressure
    pressure_occupancy: float | None = None  # None: only lost hits are pressure (a full pool may just fit)
    cooldown_windows: int = 10
    allowed: tuple[str, ...] | None = None  # labels the allowance permits; None: none measured, only dense
    max_running: int | None = None  # a window with more requests waiting than this is not judged
    fit_occupancy: float = 1.0  # dense would fit: occupancy x compression at most this on every replica
    replay_trigger: float = 64.0  # mean tokens replayed per request that starts an interval trial
    judge_requests: int = 1  # requests a trial (and its control) is judged on, at least (the service: 16)
    max_trial_windows: int = 12  # judged windows after which a trial is decided on what it has
    intervals: tuple[int, ...] = (32, 64, 128, 256)  # checkpoint intervals the controller may pick
    lookback: int = 0  # the configured lookback (the ladder's)
    lookbacks: tuple[int, ...] = (16, 64, 256)  # lookbacks the controller may pick (and 0); empty: it keeps its own
    branch_trigger: float = 0.1  # share of requests branching before a stored prompt end that starts a lookback trial
    lookback_min_evicted: int = 8  # lookback checkpoints evicted unused in the latest windows that turn it off
    lookback_reuse_floor: float = 0.05  # loaded share of them below which lookback 0 is set

    def permits(self, setting: Setting) -> bool:
        return setting.w_max is None or (self.allowed is not None and setting.codec in self.allowed)

    def ladder(self, interval: int | None = None, lookback: int | None = None) -> list[Setting]:
        """Dense, then per W_max: nr within the nr cap if allowed, else wr within the wr cap if allowed; each at
        `interval` and `lookback` (default: the configured ones)."""
        interval = self.interval if interval is None else interval
        lookback = self.lookback if lookback is None else lookback
        rungs = [Setting(None, "nr", interval, lookback)]
        for w in self.w_values:
            options = [Setting(w, "nr", interval, lookback)] if w <= self.max_w_nr else []
            options += [Setting(w, "wr", interval, lookback)] if w <= self.max_w_wr else []
            rungs += [s for s in options if self.permits(s)][:1]
        return rungs

    def interval_for(self, replayed: float) -> int:
        """The largest candidate interval at most the tokens requests replay (the smallest if none is): a next
        turn then resumes within one interval of where it leaves the cached path, for one checkpoint store per
        interval of prompt and answer. (Measured on bench_controller's chat situation, mean replay 72 tokens: I64
        was the fastest static setting and I32, half the replay, the slowest, its stores and evictions costing
        more than the shorter replays saved.)"""
        fitting = [i for i in self.intervals if i <= replayed]
        return max(fitting) if fitting else min(self.intervals)

    def lookback_for(self, branch_back: float) -> int:
        """The smallest candidate lookback that covers `branch_back` tokens (the largest if none does): a prompt
        that leaves the path that far before its end then finds a checkpoint at or above where it branched."""
        covering = [b for b in self.lookbacks if b >= branch_back]
        return min(covering) if covering else max(self.lookbacks)


@dataclass(frozen=True)
class Window:
    """One replica's telemetry over one window."""

    replica: str
    version: int
    requests: int
    ttft_mean_s: float | None
    hit_rate: float
    occupancy: float
    evictions: int
    wr_replay_s: float = 0.0
    waiting: int = 0  # requests queued in the replica's engine (the peak the replica saw in the window)
    rejected: int = 0  # requests the replica refused in the window (admission control)
    replayed: float = 0.0  # mean tokens per admitted request recomputed between its checkpoint and its KV match's end
    lost: float = 0.0  # share of admitted requests that resumed behind a checkpoint evicted for room
    compression: float = 1.0  # dense checkpoint bytes over the running setting's
    dispensable: float = 0.0  # share of slots held by lookback checkpoints eviction takes first
    lookback_stored: int = 0  # lookback checkpoints stored in the window
    lookback_evicted: int = 0  # lookback checkpoints evicted in the window without ever being loaded
    lookback_reused: int = 0  # lookback checkpoints loaded for the first time in the window
    branched: float = 0.0  # share of admitted requests that left a stored prompt's path before its end and replayed
    branch_back: float = 0.0  # how far before it (tokens; the median's power-of-two bucket)

"""The tuning algorithm of the controller, as plain Python (the Ray actor in `controller.py` wraps it).

Settings climb a ladder of compression: dense, then dasc-nr at each W_max up to the operator's nr cap,
then dasc-wr above it up to the wr cap (answer quality cannot be measured live, so the operator bounds how
aggressive each policy may be). Every window (window_s seconds) each replica reports TTFT, hit rate,
checkpoint occupancy, evictions, the share of requests that resumed behind a checkpoint evicted for room (`lost`)
and wr replay time.

- Under cache pressure (at least `pressure_lost` of a replica's requests resumed behind an evicted checkpoint; or,
  if `pressure_occupancy` is set, occupancy at or above it) and with no trial running, the next rung above the
  current setting is tried on ONE replica (the trial replica) while the others keep the current setting (the
  control). Evictions alone are not pressure: a pool that evicts only what nobody asks for again (finished
  conversations) would gain nothing from holding more.
- The first `warmup_windows` windows of a trial are not judged: a new W_max starts from an emptied
  checkpoint cache (a layout change drops the old checkpoints), so those windows measure refilling, not the
  setting (the control's windows of that period are skipped too). Warm-up goes on, for at most
  `refill_windows` more windows, while the trial replica's hit rate is still below its own before the trial or
  still rising (by more than `refill_rise` over its previous window: a setting that holds more checkpoints ends
  above the old hit rate, and crossing it is not being refilled; bench_controller's overflow situation once
  rejected nr-W64 on a window at hit rate 0.27 on its way to 0.52).
- After `trial_windows` further windows with at least `min_requests` requests each, and at least
  `judge_requests` requests in all (windows accumulate until then, for at most `max_trial_windows`: a window of a
  few long chat turns says little), the trial replica's mean TTFT, weighted by requests, is compared with the
  control's over the same windows (with a single replica: with its own latest windows before the trial, as many
  as hold `judge_requests`; a trial starts only once they do). It is promoted to every replica only if it wins by
  more than `hysteresis`; otherwise it is rejected and not retried for `cooldown_windows` windows (hysteresis
  both ways: no flapping).
- When a compressed setting runs and dense checkpoints would fit (every replica's occupancy times its
  compression ratio at most `fit_occupancy`, no evictions), dense is tried the same way ("relax"); it is promoted
  unless it loses by more than `hysteresis` (at equal TTFT dense is preferred: its answers are the model's).
- When requests recompute many tokens between their checkpoint and the end of their KV match (`replayed`, mean
  per request over the replicas' latest windows holding `judge_requests` requests, at or above `replay_trigger`:
  a conversation's next turn resumes far behind where the last answer ended), the largest checkpoint interval at
  most that is tried ("interval"), judged like a climb.
- Lookback checkpoints (`EngineConfig.lookback`: one checkpoint that many tokens before each prompt end, where
  the next prompt sharing all of this one but its last tokens, a few-shot header's next query, resumes). When at
  least `branch_trigger` of the requests in the replicas' latest windows left a stored prompt's path before its
  end and replayed what they shared with it (`branched`; a repeat, or a request resuming at the branch checkpoint
  an earlier sharer cut, does not count) and a longer lookback from `lookbacks` would have covered how far before
  (`branch_back`), that lookback is tried ("lookback", judged like a climb). When lookback checkpoints are evicted
  without ever being loaded (at least `lookback_min_evicted` in those windows, fewer than `lookback_reuse_floor` of
  that many loaded, and requests do not branch), lookback 0 is set everywhere at once, without a trial
  ("lookback_off", decision "set"): those checkpoints took pool room and served no hit, so dropping them cannot
  cost one, and a trial's windows (bench_controller's overflow spent three on one) are better spent on the ladder.
  (Checkpoints discarded by a layout change do not count.) The fit test leaves out the lookback checkpoints
  eviction takes first (`dispensable`: a reused checkpoint lies below them, so they would save nothing more).
Every change bumps a version; replicas poll their assignment and apply it between engine steps. Each decision
is logged with its evidence (the windows' means that started the trial; the TTFTs that judged it): /status.

Answer quality is the operator's decision, not a side effect: the ladder keeps only the settings the model's
allowance permits (`allowed`, measured by `python -m app.calibrate MODEL`; docs/serving.md, "Answer quality:
the allowance"). Where nr at a W_max is not allowed but wr is (and the wr cap permits it), the rung is wr.
`allowed=None` means no allowance was measured: only dense, so the controller never changes answers.
And a window in which a replica queued more than `max_running` requests or rejected any is not judged (nor
taken as a baseline): its TTFT measures the overload, not the setting.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import asdict, dataclass, field, replace

from deployments.tuner_terms import Setting, TunerKnobs, Window


@dataclass
class Trial:
    setting: Setting
    replica: str
    ttft: list[tuple[float, int]] = field(default_factory=list)  # (window mean TTFT, its requests)
    control: list[tuple[float, int]] = field(default_factory=list)
    ticks: int = 0  # windows closed since the trial started
    baseline_hit: float | None = None  # the trial replica's hit rate before the trial
    last_hit: float | None = None  # the trial replica's hit rate in its latest usable window of the trial
    kind: str = "climb"  # climb (more compression), relax (less) or interval
    evidence: dict = field(default_factory=dict)  # the windows' means that started it


class Tuner:
    def __init__(self, knobs: TunerKnobs, initial: Setting | None = None, enabled: bool = True,
                 allowance: dict | None = None) -> None:
        """`allowance`: the model's allowance record (allowance.json), shown in `state()`."""
        self.knobs, self.enabled, self.allowance = knobs, enabled, allowance
        self.overloaded_windows = 0
        self.current = initial or Setting(None, "nr", knobs.interval, knobs.lookback)
        self.version = 1
        self.trial: Trial | None = None
        self.cooldown: dict[Setting, int] = {}
        self.window_index = 0
        self.pending: list[Window] = []
        self.recent: dict[str, list[Window]] = {}  # per replica, its last windows on the current setting
        self.decisions: list[dict] = []
        self.replicas: set[str] = set()
        self.history: deque[dict] = deque(maxlen=4096)  # what it was told, in order: windows and ticks (`replay`)

    # ------------------------------------------------------------------ replicas
    def assignment(self, replica: str) -> tuple[int, Setting]:
        self.replicas.add(replica)
        if self.trial is not None and self.trial.replica == replica:
            return self.version, self.trial.setting
        return self.version, self.current

    def report(self, window: Window) -> None:
        self.history.append(asdict(window))
        self.replicas.add(window.replica)
        if window.version == self.version:  # stale windows (from before the last change) are ignored
            self.pending.append(window)

    # ------------------------------------------------------------------ decisions
    def tick(self) -> str | None:
        """Close the current window and decide; returns what was decided, if anything."""
        windows, self.pending = self.pending, []
        self.window_index += 1
        self.history.append({"tick": self.window_index})
        if not self.enabled:
            return None
        overloaded = [w for w in windows if self._overloaded(w)]
        self.overloaded_windows += len(overloaded)
        usable = [] if overloaded else [w for w in windows
                                        if w.requests >= self.knobs.min_requests and w.ttft_mean_s is not None]
        if self.trial is not None:
            return self._judge(usable)
        for w in usable:
            self.recent[w.replica] = self._latest(self.recent.get(w.replica, []) + [w])
        evidence = _evidence(windows)
        lookback = self._lookback_evidence()
        if lookback is not None and lookback["off"]:
            return self._set(replace(self.current, lookback=0), "lookback_off", {**evidence, **lookback["seen"]})
        full = self.knobs.pressure_occupancy
        if any(w.lost > 0 and w.lost >= self.knobs.pressure_lost or (full is not None and w.occupancy >= full)
               for w in windows):
            return self._start_trial(self._next_rung(), "climb", evidence)
        if usable and self.current.w_max is not None and all(
                w.evictions == 0 and (w.occupancy - w.dispensable) * w.compression <= self.knobs.fit_occupancy
                for w in windows):
            return self._start_trial(self._cool(replace(self.current, w_max=None, policy="nr")), "relax", evidence)
        replayed = self._recent_replay()
        if usable and replayed is not None and replayed >= self.knobs.replay_trigger:
            interval = self.knobs.interval_for(replayed)
            if interval != self.current.interval:
                return self._start_trial(self._cool(replace(self.current, interval=interval)), "interval",
                                         {**evidence, "replayed_recent": round(replayed, 4)})
        if usable and lookback is not None and lookback["longer"]:
            return self._start_trial(self._cool(replace(self.current, lookback=lookback["longer"])), "lookback",
                                     {**evidence, **lookback["seen"]})
        return None

    def _lookback_evidence(self) -> dict | None:
        """What the replicas' latest windows (`_recent_windows`) say of the lookback: `longer`, the lookback to try
        when enough requests branch further before stored prompt ends than it reaches (else 0); `off`, whether its
        checkpoints are evicted unused (pool room they take from others, for no hit) while requests do not branch;
        `seen`, the figures. None when the operator left no lookbacks to pick, or no replica has enough requests."""
        k = self.knobs
        windows = self._recent_windows()
        requests = sum(w.requests for w in windows)
        if not k.lookbacks or not requests:
            return None
        weight = sum(w.branched * w.requests for w in windows)
        branched = weight / requests
        back = sum(w.branch_back * w.branched * w.requests for w in windows) / weight if weight else 0.0
        evicted, reused = sum(w.lookback_evicted for w in windows), sum(w.lookback_reused for w in windows)
        want = k.lookback_for(back) if branched >= k.branch_trigger else 0
        return {"longer": want if want > self.current.lookback else 0,
                "off": bool(self.current.lookback) and branched < k.branch_trigger and evicted >= k.lookback_min_evicted
                and reused < k.lookback_reuse_floor * evicted,
                "seen": {"branched_recent": round(branched, 4), "branch_back_recent": round(back, 1),
                         "lookback_stored": sum(w.lookback_stored for w in windows), "lookback_reused": reused,
                         "lookback_evicted_unused": evicted}}

    def _set(self, setting: Setting, kind: str, evidence: dict) -> str:
        """Change the setting everywhere without a trial: for a change the windows show cannot cost a hit (lookback
        off when none of its checkpoints was loaded), so that no trial's windows are spent on it."""
        self.current, self.recent = setting, {}
        self.version += 1
        return self._log("set", setting, kind=kind, evidence=evidence)

    def _latest(self, windows: list[Window]) -> list[Window]:
        """The latest windows that hold `judge_requests` requests and number at least `trial_windows`."""
        keep, total = 0, 0
        for w in reversed(windows):
            if keep >= self.knobs.trial_windows and total >= self.knobs.judge_requests:
                break
            keep, total = keep + 1, total + w.requests
        return windows[len(windows) - keep:]

    def _recent_windows(self) -> list[Window]:
        """Every replica's latest windows on the current setting (`recent`), of the replicas whose windows hold
        together at least `judge_requests` requests: one window of three long chat turns says little."""
        return [w for ws in self.recent.values() if sum(x.requests for x in ws) >= self.knobs.judge_requests
                for w in ws]

    def _recent_replay(self) -> float | None:
        """Mean tokens replayed per request over `_recent_windows()`, weighted by requests; None before any replica
        has that many."""
        windows = self._recent_windows()
        total = sum(w.requests for w in windows)
        return sum(w.replayed * w.requests for w in windows) / total if total else None

    def _overloaded(self, w: Window) -> bool:
        """The replica queued more than max_running requests or rejected some: no window of this tick is judged
        (trial and control alike), since their TTFTs measure the overload, not the settings."""
        return w.rejected > 0 or (self.knobs.max_running is not None and w.waiting > self.knobs.max_running)

    def _start_trial(self, setting: Setting | None, kind: str, evidence: dict) -> str | None:
        if setting is None or not self.replicas:
            return None
        replica = sorted(self.replicas)[0]
        before = self.recent.get(replica)
        if len(self.replicas) == 1 and sum(w.requests for w in before or ()) < self.knobs.judge_requests:
            return None  # its own windows are the control: wait until they hold enough requests
        self.trial = Trial(setting, replica, baseline_hit=statistics.fmean(w.hit_rate for w in before)
                           if before else None, kind=kind, evidence=evidence)
        self.version += 1
        return self._log("trial", setting, kind=kind, evidence=evidence)

    def _rung(self) -> tuple[list[Setting], int | None]:
        """The ladder at the current interval, and the current setting's place on it (None: off the ladder)."""
        ladder = self.knobs.ladder(self.current.interval, self.current.lookback)
        return ladder, ladder.index(self.current) if self.current in ladder else None

    def _cool(self, setting: Setting) -> Setting | None:
        return setting if self.cooldown.get(setting, -1) < self.window_index else None

    def _next_rung(self) -> Setting | None:
        ladder, at = self._rung()
        return next((r for r in ladder[(at + 1 if at is not None else 0):] if self._cool(r)), None)


    def _judge(self, usable: list[Window]) -> str | None:
        t = self.trial
        t.ticks += 1
        mine = [w.hit_rate for w in usable if w.replica == t.replica]
        last, t.last_hit = t.last_hit, mine[-1] if mine else t.last_hit
        if t.ticks <= self.knobs.warmup_windows:
            return None
        rising = bool(mine) and last is not None and mine[-1] > last + self.knobs.refill_rise
        refilling = rising or t.baseline_hit is not None and any(h < t.baseline_hit for h in mine)
        if refilling and not t.ttft and t.ticks <= self.knobs.warmup_windows + self.knobs.refill_windows:
            return None
        for w in usable:
            (t.ttft if w.replica == t.replica else t.control).append((w.ttft_mean_s, w.requests))
        enough = len(t.ttft) >= self.knobs.trial_windows and sum(n for _, n in t.ttft) >= self.knobs.judge_requests
        if not enough and len(t.ttft) < self.knobs.max_trial_windows:
            return None
        control = t.control or [(w.ttft_mean_s, w.requests) for w in self.recent.get(t.replica, [])]
        self.trial = None
        self.version += 1
        # a climb, an interval or a longer lookback must win by the margin; a relax (less compression) must not lose
        # by more than it
        margin = 1 + self.knobs.hysteresis if t.kind == "relax" else 1 - self.knobs.hysteresis
        trial_ttft, control_ttft = _weighted(t.ttft), _weighted(control)
        judged = {"kind": t.kind, "trial_ttft": trial_ttft, "control_ttft": control_ttft,
                  "trial_requests": sum(n for _, n in t.ttft), "control_requests": sum(n for _, n in control)}
        if control_ttft is not None and trial_ttft < control_ttft * margin:
            self.current = t.setting
            self.recent = {}
            return self._log("promote", t.setting, **judged)
        self.cooldown[t.setting] = self.window_index + self.knobs.cooldown_windows
        return self._log("reject", t.setting, **judged)

    def _log(self, decision: str, setting: Setting, **extra) -> str:
        self.decisions.append({"window": self.window_index, "decision": decision, "setting": asdict(setting),
                               "label": setting.label, **extra})
        return f"{decision} {setting.label}"

    def state(self) -> dict:
        rungs, at = self._rung()
        return {
            "version": self.version, "window": self.window_index, "enabled": self.enabled,
            "current": asdict(self.current), "current_label": self.current.label,
            "current_rung": -1 if at is None else at,
            "trial": (None if self.trial is None
                      else {"setting": asdict(self.trial.setting), "replica": self.trial.replica}),
            "trial_running": self.trial is not None, "decisions": self.decisions[-20:],
            "ladder": [r.label for r in rungs],
            "allowed": ["dense"] + [a for a in self.knobs.allowed or () if a != "dense"],
            "current_allowed": self.knobs.permits(self.current), "overloaded_windows": self.overloaded_windows,
            "allowance": _figures(self.allowance),
        }


def replay(tuner: Tuner, history: list[dict]) -> list[str]:
    """Feed a recorded `Tuner.history` (a live controller's) to `tuner`; the decisions it makes, in order."""
    out = []
    for event in history:
        if "tick" in event:
            decision = tuner.tick()
            if decision:
                out.append(decision)
        else:
            tuner.report(Window(**event))
    return out


def _weighted(pairs: list[tuple[float, int]]) -> float | None:
    """Mean TTFT over (window mean, requests) pairs, weighted by requests; None without any."""
    total = sum(n for _, n in pairs)
    return sum(t * n for t, n in pairs) / total if total else None


def _evidence(windows: list[Window]) -> dict:
    """What a trial starts from: the tick's windows' means (evictions summed)."""
    if not windows:
        return {}
    mean = {k: round(statistics.fmean(getattr(w, k) for w in windows), 4)
            for k in ("occupancy", "compression", "replayed", "lost", "hit_rate")}
    return {**mean, "evictions": sum(w.evictions for w in windows), "windows": len(windows)}


def _figures(record: dict | None) -> dict | None:
    """What /status shows of an allowance record: where it came from and the figures behind each verdict."""
    if record is None:
        return None
    keep = ("model", "date", "commit", "rule", "interval", "cold_nll", "settings", "allowed", "source")
    return {"prompts": (record.get("prompts") or {}).get("count"), **{k: record[k] for k in keep if k in record}}

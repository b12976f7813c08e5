"""The tuner in the three situations it must handle, each driven by a sequence of telemetry windows as two
replicas report them (trial replica r0, control r1): (a) the working set does not fit dense: it climbs to a
compressed setting; (b) dense fits: from a compressed start it returns to dense, and from dense it never leaves;
(c) conversations' next turns replay long stretches: it picks a checkpoint interval. Every decision carries its
evidence (what started the trial, what judged it)."""

from __future__ import annotations

from deployments.tuner import Setting, Tuner, TunerKnobs, Window, replay
from tests.deployments.test_tuner import ANY

KNOBS = TunerKnobs(allowed=ANY, trial_windows=2, warmup_windows=1, refill_windows=0, hysteresis=0.05)


def _run(tuner: Tuner, windows) -> list[str]:
    """Feed `windows(version, replica, setting)` -> Window for both replicas each tick; the decisions made."""
    out = []
    for _ in range(12):
        for r in ("r0", "r1"):
            version, setting = tuner.assignment(r)
            tuner.report(windows(version, r, setting))
        decision = tuner.tick()
        if decision:
            out.append(decision)
    return out


def test_a_working_set_that_does_not_fit_dense_moves_to_a_compressed_setting():
    """Dense evicts all the time (occupancy 1, evictions) and most requests resume behind an evicted checkpoint;
    nr-W16 holds 3x the checkpoints, loses fewer and is faster; W64 is no faster again (it is rejected and W16
    stays)."""
    def windows(version, replica, s: Setting) -> Window:
        if s.w_max is None:
            return Window(replica, version, 20, 0.30, 0.3, 1.0, 5, lost=0.6)
        return Window(replica, version, 20, 0.18 if s.w_max == 16 else 0.19, 0.8, 0.97, 1, compression=3.0,
                      lost=0.2)

    t = Tuner(KNOBS)
    decisions = _run(t, windows)
    assert decisions[:2] == ["trial nr-W16", "promote nr-W16"]
    assert "promote nr-W64" not in decisions and t.current == Setting(16, "nr")
    evidence = t.decisions[0]["evidence"]
    assert evidence["evictions"] == 10 and evidence["occupancy"] == 1.0 and evidence["lost"] == 0.6
    assert t.decisions[1]["trial_ttft"] == 0.18 and t.decisions[1]["control_ttft"] == 0.30


def test_when_dense_fits_a_compressed_start_returns_to_dense_and_dense_stays():
    """nr-W64 (compression 6) fills 10% of its pool: dense would fill 60%, below fit_occupancy. Dense is tried,
    is no slower, and is promoted; from then on (no pressure, nothing replayed) nothing changes."""
    def windows(version, replica, s: Setting) -> Window:
        if s.w_max is None:
            return Window(replica, version, 20, 0.201, 0.9, 0.6, 0)
        return Window(replica, version, 20, 0.20, 0.9, 0.1, 0, compression=6.0)

    t = Tuner(KNOBS, initial=Setting(64, "nr"))
    assert _run(t, windows) == ["trial dense", "promote dense"]
    assert t.current == Setting(None) and t.decisions[0]["kind"] == "relax"
    assert t.decisions[0]["evidence"]["compression"] == 6.0
    stay = Tuner(KNOBS)
    assert _run(stay, windows) == [] and stay.current == Setting(None)
    full = Tuner(KNOBS)  # a full dense pool that evicts nothing holds the working set: no pressure
    assert _run(full, lambda v, r, s: Window(r, v, 20, 0.2, 0.9, 1.0, 0)) == []


def test_a_relax_that_is_slower_is_rejected_and_the_start_setting_stays():
    def windows(version, replica, s: Setting) -> Window:
        return Window(replica, version, 20, 0.30 if s.w_max is None else 0.20, 0.9, 0.1, 0, compression=6.0)

    t = Tuner(KNOBS, initial=Setting(64, "nr"))
    decisions = _run(t, windows)
    assert decisions[:2] == ["trial dense", "reject dense"] and t.current == Setting(64, "nr")
    assert len(decisions) == 2  # cooling down: not retried within cooldown_windows


def test_long_replays_between_turns_pick_a_checkpoint_interval():
    """Next turns recompute ~250 tokens each (their checkpoint sits at the previous prompt's end, their KV
    match reaches the end of the last answer): an interval near half of that (128) is tried and, faster, kept;
    with it the replays shrink and nothing more changes."""
    def windows(version, replica, s: Setting) -> Window:
        if s.interval:
            return Window(replica, version, 20, 0.12, 0.9, 0.5, 0, replayed=40.0)
        return Window(replica, version, 20, 0.20, 0.6, 0.3, 0, replayed=250.0)

    t = Tuner(KNOBS)
    assert _run(t, windows) == ["trial dense/I128", "promote dense/I128"]
    assert t.current == Setting(None, "nr", 128) and t.decisions[0]["evidence"]["replayed"] == 250.0
    assert TunerKnobs().interval_for(70) == 64 and TunerKnobs().interval_for(1000) == 256
    assert TunerKnobs().interval_for(64) == 64 and TunerKnobs().interval_for(20) == 32


def test_evicting_what_nobody_asks_for_again_is_not_pressure():
    """Chat: the full dense pool evicts finished conversations' checkpoints every window, but no request resumes
    behind an evicted one (lost 0), while next turns replay ~80 tokens past their checkpoint. The tuner tries a
    checkpoint interval, not more compression (bench_controller's chat situation climbed to nr-W16 first when
    every eviction counted as pressure); a few lost requests (below `pressure_lost`) do not change that."""
    def windows(version, replica, s: Setting) -> Window:
        replayed, ttft = (10.0, 0.12) if s.interval else (80.0, 0.15)
        return Window(replica, version, 20, ttft, 0.7, 1.0, 6, replayed=replayed, lost=0.05)

    t = Tuner(KNOBS)
    assert _run(t, windows) == ["trial dense/I64", "promote dense/I64"]
    assert t.current == Setting(None, "nr", 64) and t.decisions[0]["evidence"]["evictions"] == 12


def test_a_recorded_history_replays_to_the_same_decisions():
    """`replay` feeds a tuner's history (what bench_controller saves from a live controller) to a fresh one with the
    same knobs and start: the same decisions, in order."""
    def windows(version, replica, s: Setting) -> Window:
        if s.w_max is None:
            return Window(replica, version, 20, 0.30, 0.3, 1.0, 5, lost=0.5)
        return Window(replica, version, 20, 0.18, 0.8, 0.9, 1 if s.w_max > 16 else 0, compression=3.0,
                      lost=0.2 if s.w_max > 16 else 0.0)

    live = Tuner(KNOBS)
    decisions = _run(live, windows)
    assert decisions and replay(Tuner(KNOBS), list(live.history)) == decisions


def test_a_trial_is_judged_on_enough_requests_weighted_by_requests():
    """Long chat turns: a window holds a few requests. With judge_requests 16 the trial waits until its windows
    hold 16 requests, and one lucky window of 2 fast requests does not outweigh 14 slow ones; the single replica's
    control is its own latest windows holding 16 requests, and no trial starts before it has them."""
    knobs = TunerKnobs(allowed=ANY, trial_windows=1, warmup_windows=0, refill_windows=0, min_requests=1,
                       judge_requests=16, hysteresis=0.05)
    t = Tuner(knobs)
    t.assignment("r0")
    decisions = []
    for ttft in (0.40, 0.20, 0.20, 0.20):  # windows of 4 requests; no trial before 16 requests of baseline
        t.report(Window("r0", 1, 4, ttft, 0.5, 0.5, 0, replayed=200.0))
        decisions.append(t.tick())
    assert decisions == [None] * 3 + ["trial dense/I128"] and t.decisions[-1]["evidence"]["replayed"] == 200.0
    v = t.assignment("r0")[0]
    t.report(Window("r0", v, 2, 0.05, 0.9, 0.5, 0))
    assert t.tick() is None  # 2 requests: not enough
    for _ in range(2):
        t.report(Window("r0", v, 7, 0.30, 0.9, 0.5, 0))
        decision = t.tick()
    assert decision == "reject dense/I128"  # (2 x 0.05 + 14 x 0.30) / 16 = 0.27 against the control's 0.25
    judged = t.decisions[-1]
    assert judged["trial_requests"] == 16 and judged["control_requests"] == 16
    assert abs(judged["trial_ttft"] - 0.26875) < 1e-9 and abs(judged["control_ttft"] - 0.25) < 1e-9


def test_the_interval_follows_the_replay_of_enough_requests_not_of_one_window():
    """A lone replica's chat windows of 4 requests replay 60, 70, 60 and then 157 tokens (three long turns in one
    window): over its latest 16 requests the mean is 87, so I64 is tried, not the I128 the last window alone
    would pick (bench_controller's chat run went I128 first, then I64)."""
    knobs = TunerKnobs(allowed=ANY, trial_windows=1, warmup_windows=0, refill_windows=0, min_requests=1,
                       judge_requests=16)
    t = Tuner(knobs)
    t.assignment("r0")
    decisions = []
    for replayed in (60.0, 70.0, 60.0, 157.0):
        t.report(Window("r0", 1, 4, 0.2, 0.7, 1.0, 5, replayed=replayed))
        decisions.append(t.tick())
    assert decisions == [None] * 3 + ["trial dense/I64"]
    assert t.decisions[-1]["evidence"]["replayed"] == 157.0 and t.decisions[-1]["evidence"]["replayed_recent"] == 86.75


def test_requests_branching_before_stored_prompt_ends_get_a_lookback_that_reaches_them():
    """Few-shot: a third of the requests (each header's first query) leave a stored prompt's path ~30 tokens
    before its end and replay the header; lookback 64 is tried and, faster, kept; from then on the lookback
    checkpoints are reused and nothing more changes. At lookback 16 the same requests call for 64 too."""
    def windows(version, replica, s: Setting) -> Window:
        if s.lookback >= 32:
            return Window(replica, version, 20, 0.08, 0.9, 0.4, 0, branched=0.3, branch_back=32.0,
                          lookback_stored=3, lookback_reused=3)
        return Window(replica, version, 20, 0.15, 0.6, 0.3, 0, branched=0.3, branch_back=32.0, replayed=30.0)

    t = Tuner(KNOBS)
    assert _run(t, windows) == ["trial dense/L64", "promote dense/L64"]
    assert t.current == Setting(None, "nr", 0, 64) and t.decisions[0]["kind"] == "lookback"
    assert t.decisions[0]["evidence"]["branched_recent"] == 0.3
    short = Tuner(KNOBS, initial=Setting(None, "nr", 0, 16))
    assert _run(short, windows)[:2] == ["trial dense/L64", "promote dense/L64"]
    assert TunerKnobs().lookback_for(32) == 64 and TunerKnobs().lookback_for(2000) == 256
    fixed = Tuner(TunerKnobs(allowed=ANY, trial_windows=2, warmup_windows=1, refill_windows=0, lookbacks=()))
    assert _run(fixed, windows) == []  # the operator left the controller no lookback to pick


def test_lookback_checkpoints_evicted_unused_are_turned_off_at_once_and_stored_unused_ones_are_kept():
    """Unrelated prompts in a full pool: lookback checkpoints are evicted without ever being loaded, and no request
    branches before a stored prompt end: lookback 0 is set everywhere at once (no trial: they served no hit, so
    dropping them cannot cost one), and the next climb starts from there. In a pool with room they sit unused but
    evict nothing: they cost a store each, nothing is changed. Some of them loaded (a few-shot header's first
    queries) keeps them too."""
    def windows(version, replica, s: Setting, evicted: int = 6, reused: int = 0) -> Window:
        return Window(replica, version, 20, 0.20, 0.2, 1.0 if evicted else 0.5, evicted,
                      lookback_stored=10 if s.lookback else 0, lookback_evicted=evicted if s.lookback else 0,
                      lookback_reused=reused if s.lookback else 0)

    t = Tuner(KNOBS, initial=Setting(None, "nr", 0, 64))
    assert _run(t, windows)[:1] == ["set dense"]
    assert t.current == Setting(None) and t.decisions[0]["kind"] == "lookback_off"
    assert t.decisions[0]["evidence"]["lookback_evicted_unused"] == 12
    assert t.decisions[0]["evidence"]["lookback_reused"] == 0 and t.decisions[0]["window"] == 1
    roomy = Tuner(KNOBS, initial=Setting(None, "nr", 0, 64))
    assert _run(roomy, lambda v, r, s: windows(v, r, s, evicted=0)) == []
    used = Tuner(KNOBS, initial=Setting(None, "nr", 0, 64))
    assert _run(used, lambda v, r, s: windows(v, r, s, reused=2)) == []


def test_the_fit_test_leaves_out_lookback_checkpoints_eviction_takes_first():
    """nr-W64 (compression 6) fills 20% of its pool, half of it with lookback checkpoints whose prompt ends below
    are reused (repeats): dense would hold the rest in 60% of its pool, so dense is tried and kept, lookback and
    all. Counting them (bench_controller's fits situation before this) it would have stayed at nr-W64."""
    def windows(version, replica, s: Setting, dispensable: float = 0.1) -> Window:
        if s.w_max is None:
            return Window(replica, version, 20, 0.201, 0.9, 1.0, 2, dispensable=0.4)
        return Window(replica, version, 20, 0.20, 0.9, 0.2, 0, compression=6.0, dispensable=dispensable)

    t = Tuner(KNOBS, initial=Setting(64, "nr", 0, 64))
    assert _run(t, windows) == ["trial dense/L64", "promote dense/L64"]
    assert t.current == Setting(None, "nr", 0, 64)
    counted = Tuner(KNOBS, initial=Setting(64, "nr", 0, 64))
    assert _run(counted, lambda v, r, s: windows(v, r, s, dispensable=0.0)) == []

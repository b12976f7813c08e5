"""The tuner's hysteresis margin and its `min_requests` filter, driven by scripted windows."""

from __future__ import annotations

from deployments.tuner import Setting, Tuner, TunerKnobs, Window


def _window(replica: str, version: int, ttft: float | None, requests: int = 10, evictions: int = 3) -> Window:
    return Window(replica, version, requests, ttft, 0.5, 1.0 if evictions else 0.1, evictions)


def _trial_against(trial_ttft: float, control_ttft: float, hysteresis: float) -> str | None:
    """Two replicas; one trial window judged against one control window."""
    t = Tuner(TunerKnobs(trial_windows=1, warmup_windows=0, hysteresis=hysteresis))
    t.assignment("r0"), t.assignment("r1")
    t.report(_window("r0", 1, control_ttft))
    assert t.tick() == "trial nr-W16"
    t.report(_window("r0", 2, trial_ttft))
    t.report(_window("r1", 2, control_ttft))
    return t.tick()


def test_a_trial_must_win_by_more_than_the_hysteresis():
    assert _trial_against(0.19, 0.20, hysteresis=0.10) == "reject nr-W16"  # 5% faster: within the margin
    assert _trial_against(0.17, 0.20, hysteresis=0.10) == "promote nr-W16"  # 15% faster
    assert _trial_against(0.19, 0.20, hysteresis=0.0) == "promote nr-W16"  # no margin: any win promotes
    assert _trial_against(0.21, 0.20, hysteresis=0.0) == "reject nr-W16"


def test_windows_below_min_requests_are_not_judged():
    """A trial replica's windows with too few requests (or no TTFT) do not count: however fast they look, the
    trial waits for trial_windows usable ones (exactly min_requests is enough), and is judged on those alone."""
    t = Tuner(TunerKnobs(trial_windows=2, warmup_windows=0, min_requests=4))
    t.assignment("r0"), t.assignment("r1")
    t.report(_window("r0", 1, 0.20))
    assert t.tick() == "trial nr-W16"
    for ttft in (0.01, None):
        t.report(_window("r0", 2, ttft, requests=3 if ttft else 10))
        t.report(_window("r1", 2, 0.20))
        assert t.tick() is None and t.trial is not None
    for _ in range(2):
        t.report(_window("r0", 2, 0.21, requests=4))
        t.report(_window("r1", 2, 0.20))
        decision = t.tick()
    assert decision == "reject nr-W16" and t.current == Setting(None)


def test_a_single_replica_baseline_keeps_only_windows_with_enough_requests():
    """The pre-trial history a lone replica is compared with skips a window with too few requests, but such a
    window still reports cache pressure and starts the trial."""
    t = Tuner(TunerKnobs(trial_windows=1, warmup_windows=0, min_requests=4))
    t.assignment("r0")
    t.report(_window("r0", 1, 0.30, evictions=0))
    assert t.tick() is None
    t.report(_window("r0", 1, 0.05, requests=2))
    assert t.tick() == "trial nr-W16"
    t.report(_window("r0", 2, 0.25))
    assert t.tick() == "promote nr-W16"  # 0.25 against the usable 0.30, not the 2-request 0.05
    assert t.decisions[-1]["control_ttft"] == 0.30

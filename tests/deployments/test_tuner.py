"""The tuner's hysteresis margin, its `min_requests` filter, the answer-quality allowance (defect 7: the shipped
default changed greedy answers by itself) and overloaded windows, driven by scripted windows."""

from __future__ import annotations

import random
from pathlib import Path

import yaml

from app.dasc.allowance import W_VALUES, read_allowance
from app.models.loader import ZOO_DIR
from deployments.builder import ServeArgs, controller_config
from deployments.tuner import Setting, Tuner, TunerKnobs, Window

ANY = tuple(f"{p}-W{w:g}" for p in ("nr", "wr") for w in W_VALUES)  # every setting allowed (algorithm tests)
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "config.yaml"


def _window(replica: str, version: int, ttft: float | None, requests: int = 10, evictions: int = 3) -> Window:
    return Window(replica, version, requests, ttft, 0.5, 1.0 if evictions else 0.1, evictions,
                  lost=0.5 if evictions else 0.0)


def _trial_against(trial_ttft: float, control_ttft: float, hysteresis: float) -> str | None:
    """Two replicas; one trial window judged against one control window."""
    t = Tuner(TunerKnobs(trial_windows=1, warmup_windows=0, hysteresis=hysteresis, allowed=ANY))
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
    t = Tuner(TunerKnobs(trial_windows=2, warmup_windows=0, min_requests=4, allowed=ANY))
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
    t = Tuner(TunerKnobs(trial_windows=1, warmup_windows=0, min_requests=4, allowed=ANY))
    t.assignment("r0")
    t.report(_window("r0", 1, 0.30, evictions=0))
    assert t.tick() is None
    t.report(_window("r0", 1, 0.05, requests=2))
    assert t.tick() == "trial nr-W16"
    t.report(_window("r0", 2, 0.25))
    assert t.tick() == "promote nr-W16"  # 0.25 against the usable 0.30, not the 2-request 0.05
    assert t.decisions[-1]["control_ttft"] == 0.30


def _shipped_tuner() -> tuple[Tuner, TunerKnobs]:
    """The controller as `serve run configs/config.yaml` builds it (the model's committed allowance.json)."""
    args = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    actor = controller_config(ServeArgs(**args))["actor"]
    knobs = TunerKnobs(**actor["knobs"])
    return Tuner(knobs, Setting(**actor["initial"]), actor["enabled"], actor["allowance"]), knobs


def test_the_shipped_default_never_assigns_a_setting_the_allowance_does_not_permit():
    """Defect 7: with the shipped config and kda-tiny's measured allowance, no sequence of windows (pressure,
    trial replicas that win or lose, idle spells, overload) gets a replica assigned a disallowed setting; the
    old tuner trialled nr-W16 after the first window under cache pressure."""
    tuner, knobs = _shipped_tuner()
    allowance = read_allowance(ZOO_DIR / "kda-tiny")
    assert allowance is not None and knobs.allowed == tuple(allowance["allowed"])
    assert tuner.state()["allowance"]["settings"]["nr-W16"]["agreement"] == allowance["settings"]["nr-W16"]["agreement"]
    rng = random.Random(0)
    replicas = ("r0", "r1")
    seen = set()
    for _ in range(400):
        for r in replicas:
            version, setting = tuner.assignment(r)
            seen.add(setting.codec)
            assert knobs.permits(setting), f"{r} assigned {setting.label}, allowed: {knobs.allowed}"
            trial = tuner.trial is not None and tuner.trial.replica == r
            ttft = rng.uniform(0.01, 0.05) if trial else rng.uniform(0.1, 0.3)  # trials always win big
            tuner.report(Window(r, version, rng.choice((0, 2, 10)), ttft, rng.random(), rng.choice((0.5, 1.0)),
                                rng.choice((0, 0, 5)), waiting=rng.choice((0, 0, 0, 99))))
        tuner.tick()
    assert seen <= {"dense", *knobs.allowed}
    assert all(d["setting"]["w_max"] is None or knobs.permits(Setting(**d["setting"])) for d in tuner.decisions)


def test_the_ladder_keeps_only_allowed_rungs_and_prefers_nr_within_its_cap():
    assert [s.label for s in TunerKnobs().ladder()] == ["dense"]  # no allowance measured: only dense
    knobs = TunerKnobs(max_w_nr=128, max_w_wr=512, allowed=("wr-W16", "nr-W64", "wr-W64", "wr-W512", "nr-W1024"))
    assert [s.label for s in knobs.ladder()] == ["dense", "wr-W16", "nr-W64", "wr-W512"]
    t = Tuner(TunerKnobs(trial_windows=1, warmup_windows=0, allowed=("wr-W512",)))
    t.assignment("r0")
    t.report(_window("r0", 1, 0.2))
    assert t.tick() == "trial wr-W512"
    assert t.state()["allowed"] == ["dense", "wr-W512"] and t.state()["ladder"] == ["dense", "wr-W512"]


def test_overloaded_windows_are_not_judged():
    """A tick in which a replica queued more than max_running requests or rejected any is judged neither for the
    trial nor for the control (nor kept as a single replica's baseline); the trial is judged on later windows."""
    for overload in (dict(waiting=33), dict(rejected=1)):
        t = Tuner(TunerKnobs(trial_windows=1, warmup_windows=0, max_running=32, allowed=ANY))
        t.assignment("r0"), t.assignment("r1")
        t.report(_window("r0", 1, 0.20))
        assert t.tick() == "trial nr-W16"
        t.report(Window("r0", 2, 10, 0.05, 0.5, 1.0, 3, lost=0.5))  # the trial looks fast while the control is swamped
        t.report(Window("r1", 2, 10, 0.90, 0.5, 1.0, 3, lost=0.5, **overload))
        assert t.tick() is None and t.trial is not None and t.state()["overloaded_windows"] == 1
        t.report(_window("r0", 2, 0.21))
        t.report(_window("r1", 2, 0.20))
        assert t.tick() == "reject nr-W16"
    lone = Tuner(TunerKnobs(trial_windows=1, warmup_windows=0, max_running=32, allowed=ANY))
    lone.assignment("r0")
    lone.report(Window("r0", 1, 10, 0.90, 0.5, 1.0, 3, lost=0.5, waiting=40))  # overload: pressure, but no baseline
    assert lone.tick() is None and lone.recent == {} and lone.trial is None  # its own windows are the control
    lone.report(Window("r0", 1, 10, 0.30, 0.5, 1.0, 3, lost=0.5, waiting=32))  # exactly max_running waiting: judged
    assert lone.tick() == "trial nr-W16" and [w.ttft_mean_s for w in lone.recent["r0"]] == [0.30]

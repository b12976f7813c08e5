"""What the controller and /metrics keep across faults, without Ray: the controller class runs as plain Python
(its Ray actor wraps exactly this), the metrics registry renders as the ingress renders it."""

from __future__ import annotations

import asyncio

import pytest

from app.api.metrics import ApiMetrics
from deployments import controller as controller_mod
from deployments.builder import ServeArgs

Controller = controller_mod.TuningController.__ray_actor_class__
KNOBS = {"max_w_nr": 128, "max_w_wr": 512}
RUNNING = {"w_max": 64, "policy": "nr", "interval": 0, "lookback": 64}


def _window(replica: str, version: int = 7) -> dict:
    return {"replica": replica, "version": version, "requests": 0, "ttft_mean_s": None, "hit_rate": 0.0,
            "occupancy": 0.5, "evictions": 0}


def test_a_fresh_controller_adopts_what_the_replicas_run():
    """Its config says dense; the replicas run nr-W64 (an earlier controller promoted it): it must assign nr-W64,
    or every replica would drop its checkpoints."""
    async def run():
        c = Controller(KNOBS, {"w_max": None, "policy": "nr", "interval": 0}, True, 10.0)
        await c.report(_window("a"), {"checkpoint_slots_used": 5}, RUNNING)
        assignment = await c.assignment("b", {"w_max": 16, "policy": "nr", "interval": 0})
        c._loop_task.cancel()
        return assignment, await c.state()

    (_, setting), state = asyncio.run(run())
    assert setting == RUNNING and state["adopted"] == RUNNING and state["current_label"] == "nr-W64/L64"


def test_silent_replicas_are_forgotten(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(controller_mod.time, "time", lambda: clock[0])

    async def run():
        c = Controller(KNOBS, None, False, 1.0)
        await c.report(_window("a"), {}, RUNNING)
        await c.report(_window("b"), {}, RUNNING)
        clock[0] += controller_mod.FORGET_WINDOWS * 1.0 - 0.5
        await c.report(_window("b"), {}, RUNNING)
        clock[0] += 1.0
        return await c.state(), c.tuner.replicas

    state, known = asyncio.run(run())
    assert set(state["replicas"]) == {"b"} and known == {"b"}


def test_metrics_drop_the_label_sets_of_replicas_that_left():
    m = ApiMetrics()
    text = m.render({"a": {"running": 1, "hit_rate": 0.5}, "b": {"running": 2}})
    assert 'replica="a"' in text and 'replica="b"' in text
    text = m.render({"b": {"running": 3}})
    assert 'replica="a"' not in text and 'dasc_engine_running{replica="b"} 3.0' in text


def test_concurrency_limits_are_explicit_and_checked():
    args = ServeArgs()
    assert args.ingress.max_ongoing_requests > args.replicas * args.max_ongoing_requests + args.max_queued_requests
    with pytest.raises(ValueError, match="max_running"):
        ServeArgs(max_ongoing_requests=8)
    with pytest.raises(ValueError):
        ServeArgs(ingress={"max_ongoing_requests": 0})

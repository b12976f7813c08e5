"""`TuningController`: the tuner as a named Ray actor. Replicas push telemetry windows and poll their
assignment; a background loop closes a window every `window_s` seconds; the ingress reads `state()` for
/metrics and /status (which also carries the latest engine snapshot of every replica).

Faults. The actor is detached and named, so anyone can find it; if it dies, the next caller that fails to
reach it (the ingress, a replica's telemetry loop) calls `get_or_create` again and a fresh one starts. A fresh
controller ADOPTS the setting the replicas run (each window carries it), instead of pushing the config's
initial setting: the old controller may have promoted another one, and switching back would drop every
replica's checkpoints. Its version counter restarts, which replicas tolerate (they retune only when the
assigned setting differs from the one they run). Replicas that stop reporting for `FORGET_WINDOWS` windows
(killed, replaced) are forgotten, so their gauges leave /metrics and /status.
"""

from __future__ import annotations

import asyncio
import functools
import time

import ray

from deployments import actors
from deployments.tuner import Setting, Tuner, TunerKnobs, Window

NAME = "dasc-tuning-controller"
FORGET_WINDOWS = 3


@ray.remote(num_cpus=0)
class TuningController:
    def __init__(self, knobs: dict, initial: dict | None, enabled: bool, window_s: float,
                 allowance: dict | None = None) -> None:
        self.tuner = Tuner(TunerKnobs(**knobs), Setting(**initial) if initial else None, enabled, allowance)
        self.window_s = window_s
        self.snapshots: dict[str, dict] = {}
        self.adopted: dict | None = None  # the setting taken over from the first replica that reported
        self._loop_task = None

    async def _windows(self) -> None:
        while True:
            await asyncio.sleep(self.window_s)
            self._forget_silent()
            self.tuner.tick()

    async def ensure_started(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._windows())

    async def assignment(self, replica: str, running: dict | None = None) -> tuple[int, dict]:
        """(version, setting) for `replica`; `running`: the setting it runs now (adopted by a fresh controller)."""
        await self.ensure_started()
        self._adopt(running)
        version, setting = self.tuner.assignment(replica)
        return version, _wire(setting)

    async def report(self, window: dict, snapshot: dict, setting: dict | None = None) -> None:
        """One replica's window, its flat engine snapshot and the setting it runs (adopted by a fresh controller:
        it, not the config's initial setting, is what they run)."""
        self._adopt(setting)
        self.tuner.report(Window(**window))
        self.snapshots[window["replica"]] = {**snapshot, "setting": setting, "reported_at": time.time()}

    async def tick(self) -> str | None:
        """Close a window now (tests and benchmarks drive windows explicitly)."""
        return self.tuner.tick()

    async def pin(self, setting: dict) -> int:
        """Operator override: every replica runs `setting` from its next window on (any trial is dropped);
        returns the new version. For reliability runs at a fixed setting, and tests."""
        self.tuner.current, self.tuner.trial = Setting(**setting), None
        self.tuner.version += 1
        return self.tuner.version

    async def history(self) -> list[dict]:
        """The windows and ticks the tuner was given, in order (`tuner.replay` reproduces its decisions)."""
        return list(self.tuner.history)

    async def state(self) -> dict:
        self._forget_silent()
        return {**self.tuner.state(), "adopted": self.adopted, "replicas": self.snapshots}

    def _adopt(self, setting: dict | None) -> None:
        if self.adopted is None and setting is not None:
            self.adopted = setting
            self.tuner.current = Setting(**setting)

    def _forget_silent(self) -> None:
        """Drop replicas silent for FORGET_WINDOWS windows (a live one reports every window)."""
        cutoff = time.time() - FORGET_WINDOWS * self.window_s
        for replica in [r for r, s in self.snapshots.items() if s["reported_at"] < cutoff]:
            del self.snapshots[replica]
            self.tuner.replicas.discard(replica)


def _wire(setting: Setting) -> dict:
    return {"w_max": setting.w_max, "policy": setting.policy, "interval": setting.interval,
            "lookback": setting.lookback}


def get_or_create(knobs: dict, initial: dict | None, enabled: bool, window_s: float, allowance: dict | None = None):
    """The named controller of this cluster: the live one, or a new one when there is none (first use, or the
    last one died). Kept until `serve.shutdown()`. Blocking: call it from a thread in async code."""
    return actors.get_or_create(TuningController, NAME, knobs, initial, enabled, window_s, allowance)


class ControllerClient(actors.ActorClient):
    """How the ingress and the replicas reach the controller: `await client.call(method, *args)` (see
    `actors.ActorClient`); `actor_cfg`: `get_or_create`'s kwargs."""

    def __init__(self, actor_cfg: dict) -> None:
        super().__init__(functools.partial(get_or_create, **actor_cfg))
        self.actor_cfg = actor_cfg


def lookup():
    return actors.lookup(NAME)

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
import time

import ray
from ray.exceptions import RayActorError

from deployments.tuner import Setting, Tuner, TunerKnobs, Window

NAME = "dasc-tuning-controller"
NAMESPACE = "dasc"
FORGET_WINDOWS = 3
# What a call to a dead or unreachable controller raises (ActorDiedError and ActorUnavailableError are
# RayActorErrors; ray.get_actor raises ValueError when the name is gone)
UNREACHABLE = (RayActorError, ValueError)


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
    handle = TuningController.options(name=NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
                                      ).remote(knobs, initial, enabled, window_s, allowance)
    try:  # let serve.shutdown() remove it, as Ray's own prefix-tree actor does
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        serve_controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        ray.get(serve_controller._register_shutdown_cleanup_actor.remote(handle))
    except Exception:  # noqa: BLE001 - best effort: without Serve running there is nothing to register with
        pass
    return handle


class ControllerClient:
    """How the ingress and the replicas reach the controller: `await client.call(method, *args)`. A call that
    fails because the controller is dead or unreachable re-resolves it (creating a new one if the named actor
    is gone) and is tried once more; the last failure is raised."""

    def __init__(self, actor_cfg: dict) -> None:
        self.actor_cfg = actor_cfg
        self.handle = None

    async def call(self, method: str, *args, attempts: int = 2):
        for attempt in range(attempts):
            try:
                if self.handle is None:
                    self.handle = await asyncio.to_thread(get_or_create, **self.actor_cfg)
                return await getattr(self.handle, method).remote(*args)
            except UNREACHABLE:
                self.handle = None
                if attempt == attempts - 1:
                    raise


def lookup():
    return ray.get_actor(NAME, namespace=NAMESPACE)

"""`TuningController`: the tuner as a named Ray actor. Replicas push telemetry windows and poll their
assignment; a background loop closes a window every `window_s` seconds; the ingress reads `state()` for
/metrics and /status (which also carries the latest engine snapshot of every replica)."""

from __future__ import annotations

import asyncio
import time

import ray

from deployments.tuner import Setting, Tuner, TunerKnobs, Window

NAME = "dasc-tuning-controller"
NAMESPACE = "dasc"


@ray.remote(num_cpus=0)
class TuningController:
    def __init__(self, knobs: dict, initial: dict | None, enabled: bool, window_s: float,
                 allowance: dict | None = None) -> None:
        self.tuner = Tuner(TunerKnobs(**knobs), Setting(**initial) if initial else None, enabled, allowance)
        self.window_s = window_s
        self.snapshots: dict[str, dict] = {}
        self._loop_task = None

    async def _windows(self) -> None:
        while True:
            await asyncio.sleep(self.window_s)
            self.tuner.tick()

    async def ensure_started(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._windows())

    async def assignment(self, replica: str) -> tuple[int, dict]:
        await self.ensure_started()
        version, setting = self.tuner.assignment(replica)
        return version, {"w_max": setting.w_max, "policy": setting.policy, "interval": setting.interval}

    async def report(self, window: dict, snapshot: dict) -> None:
        self.tuner.report(Window(**window))
        self.snapshots[window["replica"]] = {**snapshot, "reported_at": time.time()}

    async def tick(self) -> str | None:
        """Close a window now (tests and benchmarks drive windows explicitly)."""
        return self.tuner.tick()

    async def state(self) -> dict:
        return {**self.tuner.state(), "replicas": self.snapshots}


def get_or_create(knobs: dict, initial: dict | None, enabled: bool, window_s: float, allowance: dict | None = None):
    """The named controller of this cluster (created on first use, kept until `serve.shutdown()`)."""
    handle = TuningController.options(name=NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
                                      ).remote(knobs, initial, enabled, window_s, allowance)
    try:  # let serve.shutdown() remove it, as Ray's own prefix-tree actor does
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        serve_controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        ray.get(serve_controller._register_shutdown_cleanup_actor.remote(handle))
    except Exception:  # noqa: BLE001 - best effort: without Serve running there is nothing to register with
        pass
    return handle


def lookup():
    return ray.get_actor(NAME, namespace=NAMESPACE)

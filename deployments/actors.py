"""Named, detached Ray actors that outlive the replicas using them (the tuning controller, the response store),
and `ActorClient`, which reaches one: a call that finds the actor dead or unreachable re-resolves it (starting a
fresh one if the name is gone) and is tried once more.

Each is registered with Serve's controller for cleanup, so `serve.shutdown()` removes it, as it does Ray's own
prefix-tree actor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError

NAMESPACE = "dasc"
# What a call to a dead or unreachable actor raises (ActorDiedError and ActorUnavailableError are RayActorErrors;
# ray.get_actor raises ValueError when the name is gone)
UNREACHABLE = (RayActorError, ValueError)


def get_or_create(actor_class, name: str, *args):
    """The live actor named `name`, or a new `actor_class(*args)` under that name when there is none (first use,
    or the last one died). Blocking: call it from a thread in async code."""
    handle = actor_class.options(name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
                                 ).remote(*args)
    try:
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        serve_controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        ray.get(serve_controller._register_shutdown_cleanup_actor.remote(handle))
    except Exception:  # noqa: BLE001 - best effort: without Serve running there is nothing to register with
        pass
    return handle


def lookup(name: str):
    return ray.get_actor(name, namespace=NAMESPACE)


class ActorClient:
    """`await client.call(method, *args)` on the actor `resolve()` returns (blocking; run in a thread). A call
    that fails because the actor is dead or unreachable resolves it again and is tried once more; the last failure
    is raised."""

    def __init__(self, resolve: Callable[[], object]) -> None:
        self.resolve = resolve
        self.handle = None

    async def call(self, method: str, *args, attempts: int = 2):
        for attempt in range(attempts):
            try:
                if self.handle is None:
                    self.handle = await asyncio.to_thread(self.resolve)
                return await getattr(self.handle, method).remote(*args)
            except UNREACHABLE:
                self.handle = None
                if attempt == attempts - 1:
                    raise

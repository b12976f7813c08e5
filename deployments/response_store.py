"""The Responses API's store behind Serve: a `ResponseStore` (app/api/response_store.py) in a named, detached Ray
actor, so a stored response outlives the ingress replica that made it (a crash, a redeploy, a scale-down) and
every ingress replica sees the same ones. `ActorResponses` is the routes' view of it (`Responses`: awaitable
`put`, `get`, `delete`).

The actor holds ids, text and owners' key digests, never keys. If it dies, the next call starts a fresh, empty
one: the stored responses are lost (a continuation of one is then a 404, as for an expired id) and nothing else.
The first ingress to start it sets its bounds (the `api:` knobs max_stored_responses, max_stored_response_bytes
and stored_response_age_s).
"""

from __future__ import annotations

import functools

import ray

from app.api.response_store import ResponseStore, StoredResponse
from deployments import actors

NAME = "dasc-response-store"


@ray.remote(num_cpus=0)
class ResponseStoreActor:
    def __init__(self, max_count: int, max_bytes: int, max_age_s: float) -> None:
        self.store = ResponseStore(max_count, max_bytes, max_age_s)

    def put(self, response: StoredResponse) -> bool:
        return self.store.put(response)

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        return self.store.get(response_id, owner)

    def delete(self, response_id: str, owner: str) -> bool:
        return self.store.delete(response_id, owner)


class ActorResponses:
    """The named store actor, through `actors.ActorClient` (re-resolved, or restarted empty, if it died)."""

    def __init__(self, max_count: int, max_bytes: int, max_age_s: float) -> None:
        self.client = actors.ActorClient(functools.partial(actors.get_or_create, ResponseStoreActor, NAME,
                                                           max_count, max_bytes, max_age_s))

    async def put(self, response: StoredResponse) -> bool:
        return await self.client.call("put", response)

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        return await self.client.call("get", response_id, owner)

    async def delete(self, response_id: str, owner: str) -> bool:
        return await self.client.call("delete", response_id, owner)


def lookup():
    return actors.lookup(NAME)

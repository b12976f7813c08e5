"""Stored responses of the Responses API (issue 37's groundwork): what a continuation by `previous_response_id`
resumes from.

A `StoredResponse` holds the conversation's exact token ids (the prompt and the output generated), the messages
they render (so that the next turn's new items are rendered by the template's rules after them), the replica
that served it, its `cache_salt` (inherited by a continuation) and a digest of the API key that made it.

`ResponseStore` bounds them in count, bytes (of ids and text) and age, evicting the oldest first. Ids are
`resp_` and 32 random hex digits (unguessable). A response is visible only to the key that made it: `get` and
`delete` with another key's digest answer as for an unknown id (no oracle telling one from the other); with no
key configured, the id itself is the capability. Thread-safe; the clock is injectable for tests.

The routes reach a store through awaitable `put`, `get` and `delete` (`Responses`): `LocalResponses` holds one in
this process (the local server); behind Serve a named Ray actor holds it (deployments/response_store.py), so
stored responses outlive any one ingress replica.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


def key_digest(api_key: str | None) -> str:
    """What the store keeps of a request's API key (never the key itself)."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()


@dataclass
class StoredResponse:
    id: str
    owner: str  # key_digest of the API key that made it
    prompt_ids: list[int]
    output_ids: list[int]
    messages: list[dict]  # the conversation, the response's own output last, as the chat template takes it
    body: dict  # the response object as it was answered (GET returns it)
    replica: str | None = None
    cache_salt: str | None = None
    created: float = field(default_factory=time.time)

    @property
    def size(self) -> int:
        """Bytes it holds, roughly: 4 per id and the JSON of its messages and body."""
        text = json.dumps(self.messages, ensure_ascii=False) + json.dumps(self.body, ensure_ascii=False)
        return 4 * (len(self.prompt_ids) + len(self.output_ids)) + len(text.encode())


class ResponseStore:
    def __init__(self, max_count: int = 10_000, max_bytes: int = 256 << 20, max_age_s: float = 24 * 3600.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.max_count, self.max_bytes, self.max_age_s = max_count, max_bytes, max_age_s
        self._clock = clock
        self._items: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def new_id() -> str:
        return "resp_" + secrets.token_hex(16)

    def put(self, response: StoredResponse) -> bool:
        """Keep `response` (evicting the oldest beyond the bounds); False when it alone exceeds the byte bound."""
        size = response.size
        if size > self.max_bytes:
            return False
        response.created = self._clock()
        with self._lock:
            self._drop(response.id)
            self._items[response.id] = (response, size)
            self._bytes += size
            self._expire()
            while len(self._items) > self.max_count or self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))
        return True

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The stored response, or None if unknown, expired, deleted or made with another key (`owner`: the
        asking key's `key_digest`)."""
        with self._lock:
            self._expire()
            entry = self._items.get(response_id)
        if entry is None or not secrets.compare_digest(entry[0].owner, owner):
            return None
        return entry[0]

    def delete(self, response_id: str, owner: str) -> bool:
        if self.get(response_id, owner) is None:
            return False
        with self._lock:
            return self._drop(response_id)

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._items)

    def _drop(self, response_id: str) -> bool:
        entry = self._items.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry[1]
        return entry is not None

    def _expire(self) -> None:
        horizon = self._clock() - self.max_age_s
        while self._items and next(iter(self._items.values()))[0].created < horizon:
            self._drop(next(iter(self._items)))


class Responses(Protocol):
    """A response store as the routes use it (the same methods as `ResponseStore`, awaitable)."""

    async def put(self, response: StoredResponse) -> bool: ...

    async def get(self, response_id: str, owner: str) -> StoredResponse | None: ...

    async def delete(self, response_id: str, owner: str) -> bool: ...


class LocalResponses:
    """A `ResponseStore` in this process, behind the awaitable methods of `Responses`."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def put(self, response: StoredResponse) -> bool:
        return self.store.put(response)

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        return self.store.get(response_id, owner)

    async def delete(self, response_id: str, owner: str) -> bool:
        return self.store.delete(response_id, owner)


class TimedResponses:
    """A `Responses` store whose operations are timed into `histogram` (labelled by op): what each costs the
    request awaiting it (behind Serve, a round trip to the store's actor)."""

    def __init__(self, store: Responses, histogram) -> None:
        self.store, self.histogram = store, histogram

    async def put(self, response: StoredResponse) -> bool:
        with self.histogram.labels(op="put").time():
            return await self.store.put(response)

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        with self.histogram.labels(op="get").time():
            return await self.store.get(response_id, owner)

    async def delete(self, response_id: str, owner: str) -> bool:
        with self.histogram.labels(op="delete").time():
            return await self.store.delete(response_id, owner)

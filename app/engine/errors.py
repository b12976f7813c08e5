"""Why the engine could not serve a request, as exception types the API maps to HTTP statuses.

`ValueError` stays the type of a bad request (400). These are the engine's side of the contract:

- `Overloaded` (429 with Retry-After): the bounded queue is full; the request was never admitted.
- `QueueTimeout` (503 with Retry-After): admitted, but still waiting to start after the queue timeout.
- `EngineUnavailable` (503): the engine cannot step (its loop died, it is shut down or draining).
- `OutputOverflow`: the reader fell behind by more than the per-request output buffer; the request was aborted
  and its slots freed (the client is not reading, so no status reaches it).
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's refusals. `retry_after_s`: when a client may try again (None: no advice)."""

    retry_after_s: float | None = None


class Overloaded(EngineError):
    retry_after_s = 1.0


class QueueTimeout(EngineError):
    retry_after_s = 5.0


class EngineUnavailable(EngineError):
    retry_after_s = 5.0


class OutputOverflow(EngineError):
    pass

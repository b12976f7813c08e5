"""The AsyncEngine's side of one request: how its outputs reach the reader, and what bounds them.

A `Stream` joins the step thread, which produces outputs, to the reader's event loop, which consumes them
from an asyncio queue. The step thread counts what it sent and the reader what it took, so the thread knows,
without touching the queue from the wrong thread, how many outputs wait unread: a reader that stops reading
(a slow SSE client) is cut off past `max_buffered` instead of growing the server's memory.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from app.engine.errors import OutputOverflow
from app.engine.request import RequestOutput


@dataclass(eq=False)
class Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    deadline: float | None  # time.time() by which the request must have started, or None
    sent: int = 0  # outputs put on the queue (the step thread counts)
    taken: int = 0  # outputs taken off it (the reader counts)
    closed: bool = False  # an error was delivered: nothing follows it

    def send(self, out: RequestOutput, max_buffered: int) -> bool:
        """Queue an output for the reader. False when the reader has fallen more than `max_buffered` outputs
        behind (then the unread outputs are dropped and the reader gets OutputOverflow) or is gone (its event
        loop closed): the caller aborts the request."""
        if self.closed:
            return True
        self.sent += 1
        if self.sent - self.taken > max_buffered:
            self.fail(OutputOverflow(f"the reader fell more than {max_buffered} outputs behind; the request was "
                                     "aborted"), drop=True)
            return False
        return self._post(self.queue.put_nowait, out)

    def fail(self, exc: BaseException, drop: bool = False) -> None:
        """Deliver `exc` after the outputs already queued (or instead of them: `drop`); the reader raises it."""
        if not self.closed:
            self.closed = True
            self._post(_put_error, self.queue, exc, drop)

    def _post(self, fn, *args) -> bool:
        """Run fn(*args) in the reader's event loop; False (and closed) when that loop is closed already: a
        reader gone that way must not take the step thread down with it."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            self.closed = True
            return False
        return True

    async def get(self) -> RequestOutput:
        """The next output (reader side); raises what `fail` delivered."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        self.taken += 1
        return item


def _put_error(queue: asyncio.Queue, exc: BaseException, drop: bool) -> None:
    if drop:
        while not queue.empty():
            queue.get_nowait()
    queue.put_nowait(exc)

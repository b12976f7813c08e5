"""The AsyncEngine's side of one request: how its outputs reach the reader, and what bounds them.

A `Stream` joins the step thread, which produces outputs, to the reader's event loop, which consumes them
from an asyncio queue. The step thread counts what it sent and the reader what it took, so the thread knows,
without touching the queue from the wrong thread, how many outputs wait unread: a reader that stops reading
(a slow SSE client) is cut off past `max_buffered` instead of growing the server's memory.

A reader that wants only the result (a request that is not streamed) gets each sequence's first output when it
is made (its time to first token is measured there) and then one output merged from all the rest, when the
sequence finishes (`merge`): two hand-overs per sequence instead of one per token. The step thread hands a
step's outputs to each event loop in one call (`post_all`), not one per output: each call wakes the loop.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field, replace

from app.engine.errors import OutputOverflow
from app.engine.request import RequestOutput


@dataclass(eq=False)
class Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    deadline: float | None  # time.time() by which the request must have started, or None
    merge: bool = False  # deliver each sequence's first output, then the rest merged into one at its end
    sent: int = 0  # outputs put on the queue (the step thread counts)
    taken: int = 0  # outputs taken off it (the reader counts)
    closed: bool = False  # an error was delivered: nothing follows it
    _held: dict[int, RequestOutput | None] = field(default_factory=dict)  # merge: per sequence, what waits

    def offer(self, out: RequestOutput, max_buffered: int) -> RequestOutput | None | bool:
        """The step thread's side: the output to put on the queue now (`out`, a merged one, or None while a
        merged sequence runs on), or False when the reader has fallen more than `max_buffered` outputs behind
        (then the unread outputs are dropped and the reader gets OutputOverflow): the caller aborts the
        request."""
        if self.closed:
            return None
        if self.merge:
            if out.index not in self._held:  # the sequence's first output goes now
                self._held[out.index] = None
            elif not out.finished:
                self._held[out.index] = merged(self._held[out.index], out)
                return None
            else:
                out = merged(self._held[out.index], out)
        self.sent += 1
        if self.sent - self.taken > max_buffered:
            self.fail(OutputOverflow(f"the reader fell more than {max_buffered} outputs behind; the request was "
                                     "aborted"), drop=True)
            return False
        return out

    def fail(self, exc: BaseException, drop: bool = False) -> None:
        """Deliver `exc` after the outputs already queued (or instead of them: `drop`); the reader raises it."""
        if not self.closed:
            self.closed = True
            try:
                self.loop.call_soon_threadsafe(_put_error, self.queue, exc, drop)
            except RuntimeError:  # the reader's loop is closed: no one is left to tell
                pass

    async def get(self) -> RequestOutput:
        """The next output (reader side); raises what `fail` delivered."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        self.taken += 1
        return item


def post_all(items: list[tuple[Stream, RequestOutput]]) -> list[Stream]:
    """Put each output on its stream's queue, one call into each event loop for all of them; returns the
    streams whose loop is closed (their readers are gone: the caller aborts those requests)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
    for stream, out in items:
        by_loop[stream.loop].append((stream.queue, out))
    gone = []
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            gone += [s for s, _ in items if s.loop is loop]
    for s in gone:
        s.closed = True
    return gone


def merged(before: RequestOutput | None, out: RequestOutput) -> RequestOutput:
    """One output that stands for `before` followed by `out` (of the same sequence): their new tokens, text and
    logprobs joined, the rest `out`'s (the prompt's logprobs and the time to first token from the earlier)."""
    if before is None:
        return out
    lps = (before.new_logprobs or []) + (out.new_logprobs or [])
    prompt_lps = before.prompt_logprobs if before.prompt_logprobs is not None else out.prompt_logprobs
    return replace(out, new_token_ids=before.new_token_ids + out.new_token_ids, new_text=before.new_text + out.new_text,
                   new_logprobs=lps or None, prompt_logprobs=prompt_lps,
                   ttft_s=before.ttft_s if before.ttft_s is not None else out.ttft_s)


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in batch:
        queue.put_nowait(out)


def _put_error(queue: asyncio.Queue, exc: BaseException, drop: bool) -> None:
    if drop:
        while not queue.empty():
            queue.get_nowait()
    queue.put_nowait(exc)

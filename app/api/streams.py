"""`Outputs`: the outputs of several backend generations (one per prompt of a request) as one stream, through a
bounded buffer.

One task per generation pumps its outputs into a queue the route reads. A route writing SSE to a client that
does not read blocks in `send`, so the queue grows; once it holds `max_buffered` outputs, every generation is
closed (the engine aborts them and frees their slots) and the reader, if it ever reads again, gets
`OutputOverflow`. Memory per request is bounded whatever the client does. Leaving the stream (the client went
away, or an error) cancels the pumps, which closes the generations the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from app.engine.errors import OutputOverflow
from app.engine.request import RequestOutput

_DONE = object()


class Outputs:
    def __init__(self, generations: list[AsyncIterator[RequestOutput]], max_buffered: int | None = None) -> None:
        """`max_buffered`: outputs waiting for the reader at most (None: unbounded, for a reader that only
        collects)."""
        self.max_buffered = max_buffered
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(generations)
        self._tasks = [asyncio.create_task(self._pump(i, g)) for i, g in enumerate(generations)]

    async def _pump(self, index: int, generation: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in generation:
                if self.max_buffered is not None and self._queue.qsize() >= self.max_buffered:
                    raise OutputOverflow(f"the client fell {self.max_buffered} outputs behind; generation aborted")
                self._queue.put_nowait((index, out))
            self._queue.put_nowait(_DONE)
        except OutputOverflow as exc:
            self._queue.put_nowait(exc)
            self._cancel(but=asyncio.current_task())
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            self._queue.put_nowait(exc)
        finally:
            await generation.aclose()  # the engine aborts what is unfinished

    def _cancel(self, but=None) -> None:
        for task in self._tasks:
            if task is not but:
                task.cancel()

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._read()

    async def _read(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(generation index, output) as they come; raises the first generation's exception."""
        try:
            while self._open:
                item = await self._queue.get()
                if item is _DONE:
                    self._open -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            await self.close()

    async def close(self) -> None:
        """Cancel the pumps still running and wait for them (each closes its generation)."""
        self._cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

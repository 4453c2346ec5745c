"""The event-loop side of one request: an async iterator fed by the engine thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from server.engine.request import Event, Failed, Finished


class RequestHandle:
    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, max_unread: int | None = None) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._is_done = False
        self._max_unread = max_unread
        self._num_pushed = 0  # engine thread only
        self._num_read = 0  # event loop only; read across threads as a plain int (a slightly stale count is fine)

    # engine thread
    def push(self, event: Event) -> None:
        self._num_pushed += 1
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def is_overflowing(self) -> bool:
        """The client reads this stream slower than it is produced and too much is waiting."""
        return self._max_unread is not None and self._num_pushed - self._num_read > self._max_unread

    # event loop
    def cancel(self) -> None:
        """Stop this request's generation; the engine sees it before its next forward pass."""
        if not self._is_done:
            self._cancelled.set()

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> Event:
        if self._is_done:
            raise StopAsyncIteration
        event = await self._queue.get()
        self._num_read += 1
        if isinstance(event, Finished | Failed):
            self._is_done = True
        return event

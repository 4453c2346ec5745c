"""The event-loop side of one request: an async iterator fed by the engine thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from server.engine.types import Event, Failed, Finished


class RequestHandle:
    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._is_done = False

    # engine thread
    def push(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    @property
    def is_cancelled(self) -> bool:
        return self._cancelled.is_set()

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
        if isinstance(event, Finished | Failed):
            self._is_done = True
        return event

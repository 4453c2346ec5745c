"""What other threads hand an engine thread: requests, questions about its state, and wake-ups."""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.engine.handle import RequestHandle
from server.engine.request import GenerationRequest
from server.sessions.record import Session

IDLE_TICK_S = 1.0  # how often an idle engine wakes (to expire sessions, drop forgotten K/V)


@dataclass(slots=True, frozen=True)
class Submission:
    request: GenerationRequest
    session: Session | None  # locked on the event loop before the request was queued
    handle: RequestHandle


@dataclass(slots=True, frozen=True)
class Query:
    """A question about the engine's state, answered on its thread (between steps) into an asyncio future."""

    fn: Callable[[], Any]
    future: asyncio.Future[Any]

    def answer(self) -> None:
        try:
            value, error = self.fn(), None
        except Exception as exc:
            value, error = None, exc
        loop = self.future.get_loop()
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting any more
            loop.call_soon_threadsafe(_settle, self.future, value, error)


@dataclass(slots=True, frozen=True)
class Errand:
    """Work another thread hands back to the engine thread, which owns the pool (answered to nobody)."""

    fn: Callable[[], None]


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


WAKE = object()  # a snapshot finished loading
CLOSE = object()


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.is_closed = False

    def put(self, item: Submission | Query | Errand | object) -> None:
        self._queue.put(item)

    def close(self) -> None:
        self.is_closed = True
        self._queue.put(CLOSE)  # wakes the engine thread

    def qsize(self) -> int:
        return self._queue.qsize()

    def take(self, block: bool) -> list[Any]:
        """Everything waiting (wake-ups and the close marker left out); blocks up to a tick when asked."""
        items = []
        try:
            item = self._queue.get(timeout=IDLE_TICK_S) if block else self._queue.get_nowait()
            while True:
                if item is not WAKE and item is not CLOSE:
                    items.append(item)
                item = self._queue.get_nowait()
        except queue.Empty:
            pass
        return items

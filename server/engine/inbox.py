"""Requests handed from the event loop to an engine thread, and turned into sequences there."""

from __future__ import annotations

import asyncio
import logging
import queue
from collections.abc import Callable

from server.engine.handle import RequestHandle
from server.engine.kv_store import KVStore
from server.engine.types import EngineStopped, Failed, GenerationRequest

log = logging.getLogger("kvserve.engine")
IDLE_TICK_S = 1.0  # how often an idle engine wakes to expire sessions
SHUTTING_DOWN = Failed("shutting_down", "the server is shutting down")
SLOW_READER = Failed("slow_reader", "the client read the stream too slowly; too many events were left unread")


class Inbox:
    def __init__(self, store: KVStore) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._store = store
        self.is_closed = False

    def submit(self, request: GenerationRequest, model_id: str) -> RequestHandle:
        """On the event loop: lock the request's session (SessionBusy / SessionModelMismatch raise at once)."""
        if self.is_closed:
            raise EngineStopped("the server is shutting down")
        entry = self._store.acquire(request.session, model_id) if request.session else None
        handle = RequestHandle(request.request_id, asyncio.get_running_loop(), request.max_unread_events)
        self._queue.put((request, entry, handle))
        return handle

    def close(self) -> None:
        self.is_closed = True
        self._queue.put(None)  # wakes the engine thread

    def qsize(self) -> int:
        return self._queue.qsize()

    def take(self, block: bool, make: Callable) -> list:
        """Everything waiting, built with `make(request, entry, handle)`; blocks (with a tick) when asked."""
        try:
            item = self._queue.get(timeout=IDLE_TICK_S) if block else self._queue.get_nowait()
        except queue.Empty:
            if block:
                self._store.expire()
            return []
        built = []
        while item is not None:
            try:
                built.append(make(*item))
            except Exception:
                log.exception("request %s could not start", item[0].request_id)
                self._reject(item, Failed("internal_error", "the request could not start"))
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
        return built

    def reject_all(self) -> None:
        """At shutdown: answer the requests that arrived but were never looked at."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._reject(item, SHUTTING_DOWN)

    def _reject(self, item: tuple, event: Failed) -> None:
        _request, entry, handle = item
        if entry is not None:
            self._store.release(entry, keep_cache=True)
        handle.push(event)

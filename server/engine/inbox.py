"""Requests handed from the event loop to an engine thread, and turned into sequences there."""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable

from server.engine.kv_store import KVStore
from server.engine.types import Failed

log = logging.getLogger("kvserve.engine")
IDLE_TICK_S = 1.0  # how often an idle engine wakes to expire sessions
SHUTTING_DOWN = Failed("shutting_down", "the server is shutting down")


class Inbox:
    def __init__(self, store: KVStore) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._store = store

    def put(self, item: tuple) -> None:
        """(request, session entry or None, handle): the entry is already marked in use."""
        self._queue.put(item)

    def wake(self) -> None:
        self._queue.put(None)

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
            self._store.release(entry, None, [], None, keep_cache=True)
        handle.push(event)

"""Per-session KV store: transcript, cached K/V for a prefix, LRU budget, TTL, busy lock.

Thread-safe: the event loop admits and inspects sessions while the engine thread runs them.
Contract (docs/architecture.md, DESIGN.md): the transcript is the source of truth; the
cache holds K/V for `cached_ids`, which may run past the transcript after an aborted turn.
An entry in use is never evicted; eviction drops K/V but keeps the transcript.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.engine.kv_cache import cache_nbytes, shrink_cache
from server.engine.types import SessionBusy, SessionKey, SessionModelMismatch


@dataclass(slots=True)
class Entry:
    key: SessionKey
    model_id: str
    transcript_ids: list[int] = field(default_factory=list)
    num_turns: int = 0
    cached_ids: list[int] = field(default_factory=list)
    cache: Any = None
    nbytes: int = 0
    is_in_use: bool = False
    created_at: float = 0.0
    last_use: float = 0.0  # monotonic clock
    last_use_wall: float = 0.0  # unix time, for reporting


@dataclass(slots=True)
class SessionInfo:
    session_id: str
    model_id: str
    num_turns: int
    num_transcript_tokens: int
    num_cached_tokens: int
    nbytes: int
    is_in_use: bool
    last_use: float  # unix time


@dataclass(slots=True)
class StoreStats:
    num_entries: int
    nbytes: int
    num_evictions: int
    num_expired: int


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVStore:
    def __init__(
        self,
        budget_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.Lock()
        self._entries: dict[SessionKey, Entry] = {}
        self.num_evictions = 0
        self.num_expired = 0

    # -- admission (event loop) -------------------------------------------------
    def acquire(self, key: SessionKey, model_id: str) -> Entry | None:
        """Mark the entry in use, creating it on first use. Buckets never raise: a busy bucket gives None."""
        with self._lock:
            self._expire_locked()
            entry = self._entries.get(key)
            if entry is None:
                now = self._clock()
                entry = Entry(key, model_id, created_at=now, last_use=now, last_use_wall=self._wall())
                self._entries[key] = entry
            if entry.model_id != model_id:
                if key.is_bucket:
                    return None
                raise SessionModelMismatch(
                    f"session {key.name!r} belongs to model {entry.model_id!r}, not {model_id!r}"
                )
            if entry.is_in_use:
                if key.is_bucket:
                    return None
                raise SessionBusy(f"session {key.name!r} already has a request in flight")
            entry.is_in_use = True
            entry.last_use, entry.last_use_wall = self._clock(), self._wall()
            return entry

    # -- engine thread ----------------------------------------------------------
    def take_cache(self, entry: Entry, prompt_ids: list[int]) -> tuple[Any, int]:
        """The entry's cache and how many prompt tokens it already holds (at least one left to compute)."""
        with self._lock:
            cache, cached_ids = entry.cache, entry.cached_ids
            entry.cache, entry.cached_ids, entry.nbytes = None, [], 0
        if cache is None:
            return None, 0
        return cache, min(common_prefix_len(cached_ids, prompt_ids), len(prompt_ids) - 1)

    def release(
        self,
        entry: Entry,
        cache: Any,
        cached_ids: list[int],
        transcript_ids: list[int] | None,
        keep_cache: bool = False,
    ) -> None:
        """Give the entry back. `transcript_ids` is the new transcript for a completed turn, None otherwise.

        `keep_cache`: the turn never took the entry's cache (it ended before its prefill): leave it.
        """
        if cache is not None:
            try:
                shrink_cache(cache)
            except Exception:  # e.g. out of memory while copying: dropping the cache is always safe
                cache, cached_ids = None, []
        nbytes = cache_nbytes(cache) if cache is not None else 0
        with self._lock:
            if not keep_cache:
                entry.cache, entry.cached_ids, entry.nbytes = cache, list(cached_ids), nbytes
            if transcript_ids is not None:
                entry.transcript_ids = list(transcript_ids)
                entry.num_turns += 1
            entry.is_in_use = False
            entry.last_use, entry.last_use_wall = self._clock(), self._wall()
            if entry.key in self._entries and self._entries[entry.key] is not entry:
                return  # deleted (and maybe re-created) while running: this state belongs to nobody
            self._evict_locked(0)

    def make_room(self, num_bytes: int) -> None:
        """Evict idle entries so that `num_bytes` more fit in the budget (as far as idle entries allow)."""
        with self._lock:
            self._expire_locked()
            self._evict_locked(num_bytes)

    # -- inspection (event loop) ------------------------------------------------
    def info(self, key: SessionKey) -> SessionInfo | None:
        with self._lock:
            self._expire_locked()
            entry = self._entries.get(key)
            return None if entry is None else _info(entry)

    def transcript(self, key: SessionKey) -> list[int]:
        with self._lock:
            entry = self._entries.get(key)
            return list(entry.transcript_ids) if entry else []

    def delete(self, key: SessionKey) -> bool:
        """Forget a session. One in use is detached: its request finishes, its state is then dropped."""
        with self._lock:
            return self._entries.pop(key, None) is not None

    def stats(self) -> StoreStats:
        with self._lock:
            total = sum(e.nbytes for e in self._entries.values())
            return StoreStats(len(self._entries), total, self.num_evictions, self.num_expired)

    def expire(self) -> None:
        with self._lock:
            self._expire_locked()

    # -- internals (lock held) --------------------------------------------------
    def _evict_locked(self, extra_bytes: int) -> None:
        total = sum(e.nbytes for e in self._entries.values())
        if total + extra_bytes <= self.budget_bytes:
            return
        idle = sorted(
            (e for e in self._entries.values() if not e.is_in_use and e.cache is not None),
            key=lambda e: e.last_use,
        )
        for entry in idle:
            if total + extra_bytes <= self.budget_bytes:
                break
            total -= entry.nbytes
            entry.cache, entry.cached_ids, entry.nbytes = None, [], 0
            self.num_evictions += 1
            if entry.key.is_bucket:
                del self._entries[entry.key]  # a bucket without K/V holds nothing worth keeping

    def _expire_locked(self) -> None:
        deadline = self._clock() - self.ttl_s
        for key in [k for k, e in self._entries.items() if not e.is_in_use and e.last_use < deadline]:
            del self._entries[key]
            self.num_expired += 1


def _info(entry: Entry) -> SessionInfo:
    return SessionInfo(
        session_id=entry.key.name,
        model_id=entry.model_id,
        num_turns=entry.num_turns,
        num_transcript_tokens=len(entry.transcript_ids),
        num_cached_tokens=len(entry.cached_ids),
        nbytes=entry.nbytes,
        is_in_use=entry.is_in_use,
        last_use=entry.last_use_wall,
    )

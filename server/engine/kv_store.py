"""The session store: records, busy locks, TTL; for the per-session engine, caches under a byte budget.

Thread-safe: the event loop admits and inspects sessions while the engine thread runs them.
The transcript is the source of truth, journaled when a turn completes; K/V may be lost. An
entry in use is never evicted. Deleting or expiring a session removes it from every tier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from server.engine.cache_budget import CacheBudget
from server.engine.journal import Journal
from server.engine.kv_cache import cache_nbytes, shrink_cache
from server.engine.session import CompletedTurn, Entry, SessionInfo, StoreStats, info_of
from server.engine.tiers import TierStore
from server.engine.types import SessionBusy, SessionKey, SessionModelMismatch, SessionNotFound

log = logging.getLogger("kvserve.sessions")


class KVStore(CacheBudget):
    def __init__(
        self,
        budget_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        journal: Journal | None = None,
        tiers: TierStore | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self.journal = journal or Journal(None)
        self.tiers = tiers or TierStore(0, 0, None)
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.Lock()
        self._entries: dict[SessionKey, Entry] = {}
        self.num_evictions = 0
        self.num_expired = 0
        self._forgotten: deque[tuple[str, SessionKey, list[int]]] = deque(maxlen=10_000)  # for the engines

    # -- creating and restoring ---------------------------------------------------
    def _new_entry(self, key: SessionKey, model_id: str, ttl_s: float | None) -> Entry:
        self.journal.revive(key)
        self.tiers.revive(key)
        now, wall = self._clock(), self._wall()
        ttl = self.ttl_s if ttl_s is None else ttl_s
        return Entry(key, model_id, ttl_s=ttl, created_at=wall, last_use=now, last_use_wall=wall)

    def create(self, key: SessionKey, model_id: str, ttl_s: float | None = None, **fields) -> Entry:
        """A new, idle session (POST /v1/sessions, forks). Raises SessionBusy when the id is taken."""
        with self._lock:
            self._expire_locked()
            if key in self._entries:
                raise SessionBusy(f"session {key.name!r} already exists")
            entry = self._new_entry(key, model_id, ttl_s)
            for name, value in fields.items():
                setattr(entry, name, value)
            self._entries[key] = entry
            record = entry.to_record()
        self.journal.save(key, record)
        return entry

    def restore(self) -> int:
        """At start: every session a previous run journaled, without K/V (restored lazily). Returns the count."""
        entries, unfinished = self.journal.load_entries(self._clock(), self._wall())
        for key in unfinished:
            self._forget(key)  # responses the server stopped before making: nothing to continue from
        with self._lock:
            for entry in entries:
                self._entries.setdefault(entry.key, entry)
        self.expire()
        return len(entries)

    # -- admission (event loop) -------------------------------------------------
    def acquire(self, key: SessionKey, model_id: str) -> Entry | None:
        """Mark the entry in use, creating it on first use. Buckets never raise: a busy bucket gives None."""
        with self._lock:
            self._expire_locked()
            entry = self._entries.get(key)
            if entry is None:
                entry = self._new_entry(key, model_id, None)
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
    def release(
        self,
        entry: Entry,
        cache: Any = None,
        cached_ids: list[int] = (),
        turn: CompletedTurn | None = None,
        keep_cache: bool = False,
    ) -> None:
        """Give the entry back; a completed `turn` is applied and journaled before this returns.

        `keep_cache`: the turn never took the entry's cache (it ended before its prefill): leave it.
        """
        if cache is not None:
            try:
                shrink_cache(cache)
            except Exception:  # e.g. out of memory while copying: dropping the cache is always safe
                cache, cached_ids = None, []
        nbytes = cache_nbytes(cache) if cache is not None else 0
        staged = None
        try:
            if turn is not None:
                staged = self._journal_turn(entry, turn)  # on disk before the client hears the turn ended
        finally:
            with self._lock:
                if not keep_cache:
                    entry.cache, entry.cached_ids, entry.nbytes = cache, list(cached_ids), nbytes
                if staged is not None:
                    entry.transcript_ids, entry.turns = staged.transcript_ids, staged.turns
                    entry.messages, entry.record = staged.messages, staged.record
                entry.is_in_use = False
                entry.last_use, entry.last_use_wall = self._clock(), self._wall()
                if self._entries.get(entry.key) is entry:
                    self._evict_locked(0)

    def _journal_turn(self, entry: Entry, turn: CompletedTurn) -> Entry:
        """The entry with `turn` applied, written to the journal; raises (disk full...) with nothing changed."""
        with self._lock:
            staged = replace(entry, turns=list(entry.turns), record=dict(entry.record), cache=None)
            staged.apply(turn)
            staged.last_use_wall = self._wall()
            record = staged.to_record() if self._entries.get(entry.key) is entry else None
        if record is not None:
            self.journal.save(entry.key, record)  # Journal.save skips a session deleted meanwhile
        return staged

    def idle_transcripts(self, model_id: str) -> list[tuple[SessionKey, list[int]]]:
        """Idle sessions and responses of a model, least recently used first: what may leave the device."""
        with self._lock:
            idle = [e for e in self._entries.values() if e.model_id == model_id and not e.is_in_use]
            idle = [e for e in idle if not e.key.is_bucket and e.transcript_ids]
            idle.sort(key=lambda e: e.last_use)
            return [(e.key, list(e.transcript_ids)) for e in idle]

    # -- sessions API (event loop) ------------------------------------------------
    def info(self, key: SessionKey) -> SessionInfo | None:
        with self._lock:
            self._expire_locked()
            entry = self._entries.get(key)
            return None if entry is None else info_of(entry)

    def list(self, tenant: str, kind: str = "session") -> list[SessionInfo]:
        with self._lock:
            self._expire_locked()
            found = [e for e in self._entries.values() if e.key.tenant == tenant and e.key.kind == kind]
            return [info_of(e) for e in sorted(found, key=lambda e: e.created_at)]

    def view(self, key: SessionKey) -> Entry | None:
        """A detached copy of the record (transcript, turns, messages, record), for building a prompt."""
        with self._lock:
            self._expire_locked()
            entry = self._entries.get(key)
            return None if entry is None else entry.copy()

    def others(self, key: SessionKey, model_id: str) -> list[list[int]]:
        """Transcripts of the tenant's other sessions and responses on a model (who may share K/V blocks)."""
        with self._lock:
            found = [(k, e) for k, e in self._entries.items() if k != key and k.tenant == key.tenant]
            return [list(e.transcript_ids) for k, e in found if not k.is_bucket and e.model_id == model_id]

    def transcript(self, key: SessionKey) -> list[int]:
        with self._lock:
            entry = self._entries.get(key)
            return list(entry.transcript_ids) if entry else []

    def fork(self, key: SessionKey, new_key: SessionKey, num_turns: int, ttl_s: float | None = None) -> Entry:
        """A new session holding `key`'s first `num_turns` turns; its K/V is found by prefix (shared blocks)."""
        with self._lock:
            parent = self._entries.get(key)
            if parent is None:
                raise SessionNotFound(f"no session {key.name!r}")
            fields = parent.branch(num_turns)
            ttl = parent.ttl_s if ttl_s is None else ttl_s
        return self.create(new_key, parent.model_id, ttl, **fields)

    def rewind(self, key: SessionKey, num_turns: int) -> Entry:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise SessionNotFound(f"no session {key.name!r}")
            if entry.is_in_use:
                raise SessionBusy(f"session {key.name!r} has a request in flight")
            entry.check_turn(num_turns)
            entry.cut(num_turns)
            entry.cache, entry.cached_ids, entry.nbytes = None, [], 0
            entry.last_use, entry.last_use_wall = self._clock(), self._wall()
            record = entry.to_record()
        self.journal.save(key, record)
        return entry

    def delete(self, key: SessionKey) -> bool:
        """Forget a session everywhere. One in use is detached: its request finishes, its state is then dropped."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._forgotten.append((entry.model_id, key, entry.transcript_ids))
        if entry is not None:
            self._forget(key)
        return entry is not None

    def stats(self) -> StoreStats:
        with self._lock:
            total = sum(e.nbytes for e in self._entries.values())
            return StoreStats(len(self._entries), total, self.num_evictions, self.num_expired)

    def expire(self) -> None:
        with self._lock:
            self._expire_locked()

    def _forget(self, key: SessionKey) -> None:
        if key.is_bucket:
            return  # a bucket has no files
        try:
            self.journal.delete(key)
            self.tiers.drop(key)
        except Exception:  # never let a file system error escape into the engine's idle tick
            log.exception("removing the files of session %s failed", key.name)

    def take_forgotten(self, model_id: str) -> list[tuple[SessionKey, list[int]]]:
        """Sessions of a model deleted or expired since the last call: their device K/V may go too."""
        with self._lock:
            if not self._forgotten:  # the common case, checked on every engine step
                return []
            mine = [(k, ids) for m, k, ids in self._forgotten if m == model_id]
            self._forgotten = deque((i for i in self._forgotten if i[0] != model_id), maxlen=self._forgotten.maxlen)
            return mine

    def tenant_usage(self, tenant: str, exclude: SessionKey) -> tuple[int, int]:
        """(entries of `exclude`'s kind, transcript tokens of its sessions and responses), `exclude` left out."""
        with self._lock:
            mine = [(k, e) for k, e in self._entries.items() if k.tenant == tenant and k != exclude]
            same = sum(1 for k, _ in mine if k.is_bucket == exclude.is_bucket)
            return same, sum(len(e.transcript_ids) for k, e in mine if not k.is_bucket)

    def session_keys(self) -> set[SessionKey]:
        with self._lock:
            return set(self._entries)

    def is_live(self, key: SessionKey) -> bool:
        with self._lock:
            return key in self._entries

    # -- internals (lock held) --------------------------------------------------
    def _expire_locked(self) -> list[SessionKey]:
        """Drop idle entries past their TTL; the caller forgets their files (outside the lock)."""
        now = self._clock()
        expired = [k for k, e in self._entries.items() if not e.is_in_use and e.last_use + e.ttl_s < now]
        for key in expired:
            entry = self._entries.pop(key)
            if not key.is_bucket:
                self._forgotten.append((entry.model_id, key, entry.transcript_ids))
            self.num_expired += 1
            self._forget(key)  # file unlinks: quick enough to do under the lock
        return expired

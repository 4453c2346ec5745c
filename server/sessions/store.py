"""The session store: records, busy locks and TTL for every session, response and cache bucket (torch-free).

Thread-safe: the event loop admits and inspects sessions while the engine threads run them.
The transcript is the source of truth, journaled when a turn completes; K/V is found by the
transcript's prefix in server/kv and may be lost. Deleting or expiring a session removes its
journal record and tells the K/V tiers (`Forgetter`s) to drop theirs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from server.sessions.errors import SessionBusy, SessionModelMismatch, SessionNotFound
from server.sessions.journal import Journal
from server.sessions.record import CompletedTurn, Session, SessionInfo, SessionKey

log = logging.getLogger("kvserve.sessions")
TurnHook = Callable[[dict[str, Any], CompletedTurn], None]  # updates a kind's extras when a turn completes


class Forgetter(Protocol):
    """Something that keeps per-session state elsewhere (the K/V tiers)."""

    def revive(self, key: SessionKey) -> None: ...

    def drop(self, key: SessionKey) -> None: ...


class SessionStore:
    def __init__(
        self,
        ttl_s: float,
        journal: Journal | None = None,
        forgetters: tuple[Forgetter, ...] = (),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.ttl_s = ttl_s
        self.journal = journal or Journal(None)
        self._forgetters = forgetters
        self._clock, self._wall = clock, wall_clock
        self._lock = threading.Lock()
        self._sessions: dict[SessionKey, Session] = {}
        self._turn_hooks: dict[str, TurnHook] = {}
        self._forgotten: deque[tuple[str, SessionKey, list[int]]] = deque(maxlen=10_000)  # for the engines

    def on_turn(self, kind: str, hook: TurnHook) -> None:
        """`hook(extras, turn)` runs when a turn of a session of `kind` completes, before it is journaled."""
        self._turn_hooks[kind] = hook

    # -- creating and restoring ---------------------------------------------------
    def _new(self, key: SessionKey, model_id: str, ttl_s: float | None) -> Session:
        self.journal.revive(key)
        for forgetter in self._forgetters:
            forgetter.revive(key)
        now, wall = self._clock(), self._wall()
        ttl = self.ttl_s if ttl_s is None else ttl_s
        return Session(key, model_id, ttl_s=ttl, created_at=wall, last_use=now, last_use_wall=wall)

    def create(self, key: SessionKey, model_id: str, ttl_s: float | None = None, **fields: Any) -> Session:
        """A new, idle session (POST /v1/sessions, forks, responses). Raises SessionBusy when the id is taken."""
        with self._lock:
            self._expire_locked()
            if key in self._sessions:
                raise SessionBusy(f"session {key.name!r} already exists")
            session = self._new(key, model_id, ttl_s)
            for name, value in fields.items():
                setattr(session, name, value)
            self._sessions[key] = session
            record = session.to_record()
        self.journal.save(key, record)
        return session

    def restore(self) -> int:
        """At start: every session a previous run journaled (K/V comes back lazily). Returns the count."""
        sessions = self.journal.load_sessions(self._clock(), self._wall())
        with self._lock:
            for session in sessions:
                self._sessions.setdefault(session.key, session)
        self.expire()
        return len(sessions)

    # -- a request's turn -----------------------------------------------------------
    def acquire(self, key: SessionKey, model_id: str) -> Session | None:
        """Mark the session in use, creating it on first use. Buckets never raise: a busy bucket gives None."""
        with self._lock:
            self._expire_locked()
            session = self._sessions.get(key)
            if session is None:
                session = self._sessions[key] = self._new(key, model_id, None)
            if session.model_id != model_id:
                if key.is_bucket:
                    return None
                raise SessionModelMismatch(
                    f"session {key.name!r} belongs to model {session.model_id!r}, not {model_id!r}"
                )
            if session.is_in_use:
                if key.is_bucket:
                    return None
                raise SessionBusy(f"session {key.name!r} already has a request in flight")
            session.is_in_use = True
            session.last_use, session.last_use_wall = self._clock(), self._wall()
            return session

    def release(self, session: Session, turn: CompletedTurn | None = None) -> None:
        """Give the session back; a completed `turn` is applied and journaled before this returns.

        Raises (disk full...) with the session as it was before the turn, and released.
        """
        staged = None
        try:
            if turn is not None:
                staged = self._journal_turn(session, turn)  # on disk before the client hears the turn ended
        finally:
            with self._lock:
                if staged is not None:
                    session.transcript_ids, session.turns = staged.transcript_ids, staged.turns
                    session.messages, session.extras = staged.messages, staged.extras
                session.is_in_use = False
                session.last_use, session.last_use_wall = self._clock(), self._wall()

    def _journal_turn(self, session: Session, turn: CompletedTurn) -> Session:
        """The session with `turn` applied, written to the journal; raises with nothing changed."""
        with self._lock:
            staged = session.copy()
            staged.apply(turn)
            hook = self._turn_hooks.get(session.key.kind)
            if hook is not None:
                hook(staged.extras, turn)
            staged.last_use_wall = self._wall()
            record = staged.to_record() if self._sessions.get(session.key) is session else None
        if record is not None:
            self.journal.save(session.key, record)  # Journal.save skips a session deleted meanwhile
        return staged

    # -- reading ----------------------------------------------------------------------
    def info(self, key: SessionKey) -> SessionInfo | None:
        with self._lock:
            self._expire_locked()
            session = self._sessions.get(key)
            return None if session is None else SessionInfo.of(session)

    def of_tenant(self, tenant: str, kind: str = "session") -> list[SessionInfo]:
        with self._lock:
            self._expire_locked()
            found = [s for s in self._sessions.values() if s.key.tenant == tenant and s.key.kind == kind]
            return [SessionInfo.of(s) for s in sorted(found, key=lambda s: s.created_at)]

    def view(self, key: SessionKey) -> Session | None:
        """A detached copy (transcript, turns, messages, extras), for building a prompt."""
        with self._lock:
            self._expire_locked()
            session = self._sessions.get(key)
            return None if session is None else session.copy()

    def transcript(self, key: SessionKey) -> list[int]:
        with self._lock:
            session = self._sessions.get(key)
            return list(session.transcript_ids) if session else []

    def others(self, key: SessionKey, model_id: str) -> list[list[int]]:
        """Transcripts of the tenant's other sessions and responses on a model (who may share K/V blocks)."""
        with self._lock:
            found = [s for k, s in self._sessions.items() if k != key and k.tenant == key.tenant]
            return [list(s.transcript_ids) for s in found if not s.key.is_bucket and s.model_id == model_id]

    def idle_transcripts(self, model_id: str) -> list[tuple[SessionKey, list[int]]]:
        """Idle sessions and responses of a model, least recently used first: what may leave the device."""
        with self._lock:
            idle = [s for s in self._sessions.values() if s.model_id == model_id and not s.is_in_use]
            idle = [s for s in idle if not s.key.is_bucket and s.transcript_ids]
            idle.sort(key=lambda s: s.last_use)
            return [(s.key, list(s.transcript_ids)) for s in idle]

    def tenant_usage(self, tenant: str, exclude: SessionKey) -> tuple[int, int]:
        """(entries of `exclude`'s kind, transcript tokens of its sessions and responses), `exclude` left out."""
        with self._lock:
            mine = [(k, s) for k, s in self._sessions.items() if k.tenant == tenant and k != exclude]
            same = sum(1 for k, _ in mine if k.is_bucket == exclude.is_bucket)
            return same, sum(len(s.transcript_ids) for k, s in mine if not k.is_bucket)

    def session_keys(self, kind: str | None = None) -> set[SessionKey]:
        with self._lock:
            return {k for k in self._sessions if kind is None or k.kind == kind}

    def is_live(self, key: SessionKey) -> bool:
        with self._lock:
            return key in self._sessions

    # -- changing ---------------------------------------------------------------------
    def fork(self, key: SessionKey, new_key: SessionKey, num_turns: int, ttl_s: float | None = None) -> Session:
        """A new session holding `key`'s first `num_turns` turns; its K/V is found by prefix (shared blocks)."""
        with self._lock:
            parent = self._sessions.get(key)
            if parent is None:
                raise SessionNotFound(f"no session {key.name!r}")
            fields = parent.branch(num_turns)
            ttl = parent.ttl_s if ttl_s is None else ttl_s
        return self.create(new_key, parent.model_id, ttl, **fields)

    def rewind(self, key: SessionKey, num_turns: int) -> Session:
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                raise SessionNotFound(f"no session {key.name!r}")
            if session.is_in_use:
                raise SessionBusy(f"session {key.name!r} has a request in flight")
            session.check_turn(num_turns)
            session.cut(num_turns)
            session.last_use, session.last_use_wall = self._clock(), self._wall()
            record = session.to_record()
        self.journal.save(key, record)
        return session

    def delete(self, key: SessionKey) -> bool:
        """Forget a session everywhere. One in use is detached: its request finishes, its state is then dropped."""
        with self._lock:
            session = self._sessions.pop(key, None)
            if session is not None:
                self._forgotten.append((session.model_id, key, session.transcript_ids))
        if session is not None:
            self._forget(key)
        return session is not None

    def expire(self) -> None:
        with self._lock:
            self._expire_locked()

    def take_forgotten(self, model_id: str) -> list[tuple[SessionKey, list[int]]]:
        """Sessions of a model deleted or expired since the last call: their device K/V may go too."""
        with self._lock:
            if not self._forgotten:  # the common case, checked on every engine step
                return []
            mine = [(k, ids) for m, k, ids in self._forgotten if m == model_id]
            rest = (item for item in self._forgotten if item[0] != model_id)
            self._forgotten = deque(rest, maxlen=self._forgotten.maxlen)
            return mine

    # -- internals (lock held) --------------------------------------------------------
    def _forget(self, key: SessionKey) -> None:
        if key.is_bucket:
            return  # a bucket has no files
        try:
            self.journal.delete(key)
            for forgetter in self._forgetters:
                forgetter.drop(key)
        except Exception:  # never let a file system error escape into the engine's idle tick
            log.exception("removing the files of session %s failed", key.name)

    def _expire_locked(self) -> None:
        """Drop idle sessions past their TTL, and their files; a session in use never expires."""
        now = self._clock()
        expired = [k for k, s in self._sessions.items() if not s.is_in_use and s.last_use + s.ttl_s < now]
        for key in expired:
            session = self._sessions.pop(key)
            if not key.is_bucket:
                self._forgotten.append((session.model_id, key, session.transcript_ids))
            self._forget(key)  # file unlinks: quick enough to do under the lock

"""The session store's read-only questions: what a session holds, pages of a tenant's sessions, counts.

`SessionStore` (store.py) inherits them; it owns the lock, the sessions and their index.
"""

from __future__ import annotations

import threading

from server.sessions.index import Reach, SessionIndex
from server.sessions.record import Session, SessionInfo, SessionKey


class StoreReads:
    _lock: threading.Lock
    _sessions: dict[SessionKey, Session]
    _index: SessionIndex

    def _expire_locked(self) -> None:
        raise NotImplementedError

    def _refresh(self, key: SessionKey) -> None:
        """Bring this process's copy of `key` up to the shared store (when there is one)."""
        raise NotImplementedError

    def info(self, key: SessionKey) -> SessionInfo | None:
        self._refresh(key)
        with self._lock:
            self._expire_locked()
            session = self._sessions.get(key)
            return None if session is None else SessionInfo.of(session)

    def page(self, tenant: str, kind: str, limit: int, after: str | None = None) -> tuple[list[SessionInfo], bool]:
        """Up to `limit` of the tenant's sessions of `kind`, oldest first, after the one named `after`;
        and whether more follow. Costs the page, not the tenant's number of sessions."""
        with self._lock:
            self._expire_locked()
            start = None
            if after is not None:
                anchor = self._sessions.get(SessionKey(tenant, after, kind))
                if anchor is None:
                    return [], False
                start = (anchor.created_at, anchor.key.name)
            keys = self._index.page(tenant, kind, start, limit + 1)
            return [SessionInfo.of(self._sessions[k]) for k in keys[:limit]], len(keys) > limit

    def view(self, key: SessionKey) -> Session | None:
        """A detached copy (transcript, turns, messages, extras), for building a prompt."""
        self._refresh(key)
        with self._lock:
            self._expire_locked()
            session = self._sessions.get(key)
            return None if session is None else session.copy()

    def transcript(self, key: SessionKey) -> list[int]:
        with self._lock:
            session = self._sessions.get(key)
            return list(session.transcript_ids) if session else []

    def reach(self, key: SessionKey, model_id: str, transcript: list[int]) -> Reach:
        """How much of `transcript` another session or response of `key`'s tenant on the model shares: the K/V
        blocks holding it are reached by someone else."""
        with self._lock:
            return self._index.reach(key.tenant, model_id, transcript, exclude=key)

    def idle_transcripts(self, model_id: str) -> list[tuple[SessionKey, list[int]]]:
        """Idle sessions and responses of a model with a transcript, least recently used first."""
        with self._lock:
            found = [(k, self._sessions[k].transcript_ids) for k in self._index.idle(model_id)]
            return [(k, list(ids)) for k, ids in found if ids]

    def tenant_usage(self, tenant: str, exclude: SessionKey) -> tuple[int, int]:
        """(entries of `exclude`'s kind family, transcript tokens of its sessions and responses), `exclude` left out."""
        with self._lock:
            return self._index.usage(tenant, exclude, self._sessions.get(exclude))

    def session_keys(self, kind: str | None = None) -> set[SessionKey]:
        with self._lock:
            return {k for k in self._sessions if kind is None or k.kind == kind}

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._index.counts())

    def is_live(self, key: SessionKey, session: Session | None = None) -> bool:
        """Whether `key` names a session (`session` itself, when given: not a new one under a deleted name)."""
        with self._lock:
            return key in self._sessions if session is None else self._sessions.get(key) is session

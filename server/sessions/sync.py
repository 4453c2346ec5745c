"""Keeping this replica's copy of a session in step with the records other replicas commit (torch-free).

The session store (store.py) owns one `SharedSync`; with no shared store configured `refresh` does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from server.sessions.journal import Journal
from server.sessions.record import Session, SessionKey, SessionRecord
from server.sessions.shared import GONE, SharedRecords
from server.sessions.table import SessionTable

log = logging.getLogger("kvserve.sessions")


class Forgetter(Protocol):
    """Something that keeps per-session state elsewhere (the K/V tiers)."""

    def revive(self, key: SessionKey) -> None: ...

    def drop(self, key: SessionKey) -> None: ...


class SharedSync:
    def __init__(
        self,
        shared: SharedRecords | None,
        table: SessionTable,
        journal: Journal,
        forgetters: tuple[Forgetter, ...],
        drop_tiers: Callable[[SessionKey], None],
        clock: Callable[[], float],  # monotonic
        wall_clock: Callable[[], float],  # unix time
    ) -> None:
        self.shared, self._table, self.journal = shared, table, journal
        self._forgetters, self._drop_tiers = forgetters, drop_tiers
        self._clock, self._wall = clock, wall_clock

    def refresh(self, key: SessionKey) -> None:
        """Bring this replica's copy of `key` up to the shared record, which is the truth: another replica may have
        created it, moved it on or deleted it, and Redis may have lost it. One in use here is left alone (its turn
        commits on top of the operation it read, or is refused). Raises SharedStoreUnavailable."""
        if self.shared is None or key.is_bucket:
            return
        with self._table.lock:
            before = self._table.sessions.get(key)
            read_op = before.op if before is not None else None
        found = self.shared.load(key)
        with self._table.lock:
            local = self._table.sessions.get(key)
            if local is not before or (local is not None and (local.is_in_use or local.op != read_op)):
                return  # in use, or changed here while Redis was read (a commit, a create): newer than this read
            if found == GONE or found is None:
                # Deleted, expired, or lost with Redis' data: a copy here is never written back (it could be one
                # another replica deleted, or behind the last turn a client was told of).
                if local is not None:
                    if found is None:
                        log.info("session %s: the shared store holds no record of it; this copy is dropped", key.name)
                    self._forget_deleted(local)
                return
            if isinstance(found, dict):
                self._adopt(key, found, local)

    def _adopt(self, key: SessionKey, record: SessionRecord, local: Session | None) -> None:
        try:
            found = Session.from_record(record, self._clock(), self._wall())
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("the shared record of %s is unreadable, this replica's copy is kept: %s", key.name, exc)
            return
        if found.key != key or (local is not None and local.op == found.op):
            return
        if local is not None and local.rev > found.rev:
            log.warning(
                "session %s: the shared store holds revision %d, older than this replica's %d (its data was restored "
                "from an older snapshot?): the shared record is taken",
                key.name,
                found.rev,
                local.rev,
            )
        if local is None:
            self.journal.revive(key)  # this replica may have deleted the name before; another one reused it
            for forgetter in self._forgetters:
                forgetter.revive(key)
            self._table.insert(found)
        else:
            self._table.index.retranscribe(local, found.transcript_ids)
            local.transcript_ids, local.turns, local.messages = found.transcript_ids, found.turns, found.messages
            local.extras, local.ttl_s, local.parent, local.rev = found.extras, found.ttl_s, found.parent, found.rev
            local.tools, local.op, local.epoch = found.tools, found.op, found.epoch
        try:
            self.journal.save(key, record)
        except OSError:
            log.warning("the shared record of %s was not journaled here; the shared store keeps it", key.name)

    def _forget_deleted(self, session: Session) -> None:
        """Another replica deleted it: this copy goes, with its journal record and K/V snapshots."""
        try:
            self.journal.delete(session.key)
        except OSError:
            log.exception("the record of deleted session %s could not be removed", session.key.name)
        self._table.remove(session)
        self._drop_tiers(session.key)

"""The session store: records, busy locks and TTL for sessions, responses and cache buckets (torch-free, thread-safe).

Every change (create, turn, rewind, fork, delete) is journaled before it is applied: one the journal refuses raises
StateUnavailable and leaves memory as it was, so what the API answered is what a restart finds. Forgetting a session
tells the K/V tiers (`Forgetter`s) too. A request's cost here does not grow with the sessions (index.py).

One class, owning its parts: the sessions in memory (table.py), the sync with the shared store's records (sync.py),
the journal and the leases.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

from server.sessions.errors import (
    QuotaExceeded,
    SessionBusy,
    SessionError,
    SessionModelMismatch,
    SessionNotFound,
    StateUnavailable,
)
from server.sessions.index import Reach
from server.sessions.journal import Journal
from server.sessions.leases import LeaseBook, Leases, LocalLeases
from server.sessions.record import CompletedTurn, Session, SessionInfo, SessionKey
from server.sessions.shared import SharedRecords
from server.sessions.shared_state import new_op
from server.sessions.sync import Forgetter, SharedSync
from server.sessions.table import SessionTable

log = logging.getLogger("kvserve.sessions")
TurnHook = Callable[[dict[str, Any], CompletedTurn], None]  # updates a kind's extras when a turn completes


class SessionStore:
    def __init__(
        self,
        ttl_s: float,
        journal: Journal | None = None,
        forgetters: tuple[Forgetter, ...] = (),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        leases: Leases | None = None,
        shared: SharedRecords | None = None,
        max_sessions_per_tenant: int | None = None,
    ) -> None:
        self.ttl_s = ttl_s
        # Checked under the lock where a session is made, so requests at once cannot overshoot it (None: no limit).
        self.max_sessions_per_tenant = max_sessions_per_tenant
        self.journal = journal or Journal(None)
        self.leases = LeaseBook(leases or LocalLeases())  # across replicas: whose turn it is on a session
        self.shared = shared  # across replicas: the records every replica reads and commits to
        self.is_shared = shared is not None  # then reads and changes may wait on the network: call off the loop
        self._forgetters = forgetters
        self._clock, self._wall = clock, wall_clock
        self._table = SessionTable()
        self._sync = SharedSync(shared, self._table, self.journal, forgetters, self._drop_tiers, clock, wall_clock)
        self._turn_hooks: dict[str, TurnHook] = {}

    def on_turn(self, kind: str, hook: TurnHook) -> None:
        """`hook(extras, turn)` runs when a turn of a session of `kind` completes, before it is journaled."""
        self._turn_hooks[kind] = hook

    # -- reading ------------------------------------------------------------------------
    def info(self, key: SessionKey) -> SessionInfo | None:
        self._sync.refresh(key)
        with self._table.lock:
            self._expire_locked()
            session = self._table.sessions.get(key)
            return None if session is None else SessionInfo.of(session)

    def page(self, tenant: str, kind: str, limit: int, after: str | None = None) -> tuple[list[SessionInfo], bool]:
        """Up to `limit` of the tenant's sessions of `kind`, oldest first, after the one named `after`;
        and whether more follow. Costs the page, not the tenant's number of sessions."""
        with self._table.lock:
            self._expire_locked()
            start = None
            if after is not None:
                anchor = self._table.sessions.get(SessionKey(tenant, after, kind))
                if anchor is None:
                    return [], False
                start = (anchor.created_at, anchor.key.name)
            keys = self._table.index.page(tenant, kind, start, limit + 1)
            return [SessionInfo.of(self._table.sessions[k]) for k in keys[:limit]], len(keys) > limit

    def view(self, key: SessionKey) -> Session | None:
        """A detached copy (transcript, turns, messages, extras), for building a prompt."""
        self._sync.refresh(key)
        with self._table.lock:
            self._expire_locked()
            session = self._table.sessions.get(key)
            return None if session is None else session.copy()

    def transcript(self, key: SessionKey) -> list[int]:
        with self._table.lock:
            session = self._table.sessions.get(key)
            return list(session.transcript_ids) if session else []

    def reach(self, key: SessionKey, model_id: str, transcript: list[int]) -> Reach:
        """How much of `transcript` another session or response of `key`'s tenant on the model shares: the K/V
        blocks holding it are reached by someone else."""
        with self._table.lock:
            return self._table.index.reach(key.tenant, model_id, transcript, exclude=key)

    def idle_transcripts(self, model_id: str) -> list[tuple[SessionKey, list[int]]]:
        """Idle sessions and responses of a model with a transcript, least recently used first."""
        with self._table.lock:
            found = [(k, self._table.sessions[k].transcript_ids) for k in self._table.index.idle(model_id)]
            return [(k, list(ids)) for k, ids in found if ids]

    def tenant_usage(self, tenant: str, exclude: SessionKey) -> tuple[int, int]:
        """(entries of `exclude`'s kind family, transcript tokens of its sessions and responses), `exclude` left out."""
        with self._table.lock:
            return self._table.index.usage(tenant, exclude, self._table.sessions.get(exclude))

    def session_keys(self, kind: str | None = None) -> set[SessionKey]:
        with self._table.lock:
            return {k for k in self._table.sessions if kind is None or k.kind == kind}

    def counts(self) -> dict[str, int]:
        with self._table.lock:
            return dict(self._table.index.counts())

    def is_live(self, key: SessionKey, session: Session | None = None) -> bool:
        """Whether `key` names a session (`session` itself, when given: not a new one under a deleted name)."""
        with self._table.lock:
            return key in self._table.sessions if session is None else self._table.sessions.get(key) is session

    # -- creating and restoring ---------------------------------------------------
    def _new(self, key: SessionKey, model_id: str, ttl_s: float | None) -> Session:
        self.journal.revive(key)
        for forgetter in self._forgetters:
            forgetter.revive(key)
        now, wall = self._clock(), self._wall()
        ttl = self.ttl_s if ttl_s is None else ttl_s
        return Session(key, model_id, ttl_s=ttl, created_at=wall, last_use=now, last_use_wall=wall, rev=1)

    def create(self, key: SessionKey, model_id: str, ttl_s: float | None = None, **fields: Any) -> Session:
        """A new, idle session (POST /v1/sessions, forks, responses), journaled before it exists.

        Raises SessionBusy when the id is taken, QuotaExceeded when the tenant has no room for another,
        StateUnavailable when the journal refuses it.
        """
        with self._table.lock:
            self._expire_locked()
            if key in self._table.sessions:
                raise SessionBusy(f"session {key.name!r} already exists")
            self._check_room(key)
            session = self._new(key, model_id, ttl_s)
            for name, value in fields.items():
                setattr(session, name, value)
            self._hold_new(session)  # counted and taken while it is committed, which may wait on the network
        self._commit_new(session)
        with self._table.lock:
            session.is_in_use = False
            if self._table.sessions.get(key) is session:
                self._table.index.touch(session)
        return session

    def restore(self) -> int:
        """At start: every session a previous run journaled (K/V comes back lazily). Returns the count."""
        sessions = self.journal.load_sessions(self._clock(), self._wall())
        with self._table.lock:
            for session in sessions:
                if session.key not in self._table.sessions:
                    self._table.insert(session)
        self.expire()
        return len(sessions)

    def save_all(self) -> tuple[int, list[SessionKey]]:
        """At shutdown: every live record written again (a state directory removed meanwhile comes back).
        Returns how many were written, and the keys it could not write."""
        with self._table.lock:
            records = [(k, s.to_record()) for k, s in self._table.sessions.items() if not k.is_bucket]
        failed = self.journal.save_all(records)
        return len(records) - len(failed), failed

    # -- a request's turn -----------------------------------------------------------
    def acquire(self, key: SessionKey, model_id: str, is_chat: bool = False) -> Session | None:
        """Mark the session in use, creating (and journaling) it on first use. Buckets never raise: a busy bucket
        gives None, and so does a new one past the tenant's limit; a new session past it raises QuotaExceeded.
        A session never switches between a chat and a completion transcript (SessionModeMismatch)."""
        self._sync.refresh(key)
        made = None
        with self._table.lock:
            self._expire_locked()
            session = self._table.sessions.get(key)
            if session is None:
                if key.is_bucket and not self._has_room(key):
                    return None  # a bucket is a hint: the request runs without one
                self._check_room(key)
                session = self._new(key, model_id, None)
                if key.is_bucket:
                    self._table.insert(session)
                else:
                    self._hold_new(session)
                    made = session
            else:
                session.check_mode(is_chat)
            if (session.model_id != model_id or session.is_in_use) and key.is_bucket:
                return None  # a bucket is a hint: the request runs without it
            if session.model_id != model_id:
                raise SessionModelMismatch(
                    f"session {key.name!r} belongs to model {session.model_id!r}, not {model_id!r}"
                )
            if session.is_in_use and session is not made:
                since = session.last_use_wall  # set when the request holding it took it
                when = datetime.datetime.fromtimestamp(since, datetime.timezone.utc).isoformat(timespec="seconds")
                age = max(0.0, self._wall() - since)
                message = f"session {key.name!r} already has a request in flight, since {when} ({age:.0f} s ago)"
                raise SessionBusy(message, since)
            session.is_in_use = True
        if made is not None:
            self._commit_new(made)  # outside the lock: it may wait on the network
            made.is_claim = True
        if not key.is_bucket:  # the replicas' lock, taken outside ours: it may wait on the network
            try:
                self.leases.take(key)
            except Exception:
                with self._table.lock:
                    session.is_in_use = False
                if session.is_claim:
                    session.is_claim = False
                    self._drop_unclaimed(session)
                raise
        with self._table.lock:
            session.last_use, session.last_use_wall = self._clock(), self._wall()
            self._table.index.busy(session)
            return session

    def release(self, session: Session, turn: CompletedTurn | None = None) -> bool:
        """Give the session back; a completed `turn` is journaled, then applied, before this returns. Raises
        StateUnavailable (disk full...) with the session as it was before the turn, and released: one this request
        made goes, as if never asked for (not with replicas). A prefill-only request (it generated nothing) made no
        turn: the record stays as it was. Returns whether the session went so (made by this request, which made
        no turn): not a delete, so the K/V its request computed may stay as cache."""
        dropped = False
        staged = None
        has_failed = turn is None  # failed or cancelled; a prefill-only request did what it was asked
        if turn is not None and turn.is_prefill_only:
            turn = None
        is_claim, session.is_claim = session.is_claim, False  # its first request ends here, one way or another
        try:
            if turn is not None:
                staged = self._journal_turn(session, turn)  # on disk before the client hears the turn ended
        finally:
            with self._table.lock:
                is_live = self._table.sessions.get(session.key) is session
                if staged is not None and is_live:
                    self._table.index.retranscribe(session, staged.transcript_ids)
                if staged is not None:
                    session.transcript_ids, session.turns = staged.transcript_ids, staged.turns
                    session.messages, session.extras, session.rev = staged.messages, staged.extras, staged.rev
                    session.tools, session.op, session.epoch = staged.tools, staged.op, staged.epoch
                session.is_in_use = False
                session.last_use, session.last_use_wall = self._clock(), self._wall()
                if is_live:
                    self._table.index.touch(session)
            if staged is None and self.shared is not None and not session.key.is_bucket and not is_claim:
                self.shared.touch(session.key, session.ttl_s)
            self.leases.give_back(session.key)  # after the turn is journaled
            # A first request that made no turn (it failed, or its turn could not be saved: then this runs while
            # StateUnavailable goes up) leaves no empty session behind, counted toward the tenant's quota.
            if is_claim and staged is None and (has_failed or turn is not None):
                dropped = self._drop_unclaimed(session)
        return dropped

    def _journal_turn(self, session: Session, turn: CompletedTurn) -> Session:
        """The session with `turn` applied, committed to the shared store (outside the store's lock: it may wait
        on the network; the session is in use, so nothing else here changes it meanwhile) and the journal;
        raises with nothing changed."""
        with self._table.lock:
            staged = session.with_turn(turn, self._turn_hooks.get(session.key.kind), self._wall())
            staged.rev, staged.op = session.rev + 1, new_op()
            if self._table.sessions.get(session.key) is not session:
                return staged  # deleted meanwhile: its state belongs to nobody
        self._commit_shared(staged, expected_op=session.op, change="this turn")
        with self._table.lock:
            if self._table.sessions.get(session.key) is session:
                self._journal_save(staged)
        return staged

    # -- changing ---------------------------------------------------------------------
    def rewind(self, key: SessionKey, num_turns: int) -> Session:
        def cut(session: Session) -> Session:
            session.check_turn(num_turns)
            staged = session.copy()
            staged.cut(num_turns)
            return staged

        return self._change(key, cut)

    def mark(self, key: SessionKey, name: str, value: Any, expected: Any) -> Session:
        """Set `extras[name]` to `value` where it is `expected` now: a compare-and-set of one field of an idle
        record, journaled (and committed to the shared store on top of the record it read) before it applies.
        Raises SessionNotFound, SessionBusy (in use, or the field or another replica moved on), StateUnavailable."""

        def set_field(session: Session) -> Session:
            if session.extras.get(name) != expected:
                raise SessionBusy(f"{key.kind} {key.name!r} is being changed by another request")
            staged = session.copy()
            staged.extras = {**session.extras, name: value}
            return staged

        return self._change(key, set_field)

    def _change(self, key: SessionKey, stage: Callable[[Session], Session]) -> Session:
        """A change of an idle session: `stage(session)`, under the lock, gives its changed copy (or raises to
        refuse it), which is committed (the shared store on top of the record it was made from, then the journal:
        outside the lock) and only then applied. No turn starts on the session meanwhile."""
        self._sync.refresh(key)
        with self._table.lock:
            session = self._table.sessions.get(key)
            if session is None:
                raise SessionNotFound(f"no session {key.name!r}")
            if session.is_in_use:
                raise SessionBusy(f"{key.kind} {key.name!r} has a request in flight")
            staged = stage(session)
            staged.rev, staged.op = session.rev + 1, new_op()
            session.is_in_use = True  # no turn starts while the change commits (outside the lock)
            self._table.index.busy(session)
        try:
            self._save(staged, expected_op=session.op)
        finally:
            with self._table.lock:
                session.is_in_use = False
                if self._table.sessions.get(key) is session:
                    self._table.index.touch(session)
        with self._table.lock:
            if self._table.sessions.get(key) is session:
                self._table.index.retranscribe(session, staged.transcript_ids)
                session.turns, session.messages, session.extras = staged.turns, staged.messages, staged.extras
                session.rev, session.op, session.epoch = staged.rev, staged.op, staged.epoch
                session.last_use, session.last_use_wall = self._clock(), self._wall()
                self._table.index.touch(session)
        return session

    def _drop_unclaimed(self, session: Session) -> bool:
        """A session its first request made, when that request failed: it goes, as if never asked for. Not with
        replicas: another may have read the record meanwhile and be about to run a turn on it. Whether it went."""
        if self.shared is not None:
            return False
        try:
            if self.discard_unused(session):
                log.info("session %s: its first request made no turn; not kept", session.key.name)
                return True
        except SessionError as exc:  # the journal or the shared store refused the delete: an empty session stays
            log.warning(
                "session %s: its first request made no turn, and it could not be removed (%s)", session.key.name, exc
            )
        return False

    def discard_unused(self, session: Session) -> bool:
        """Delete `session` if it is still the live record of its key, idle and empty: one a request made for
        itself and was then refused, so that no empty leftover of it stays (one another request took, or that
        holds a turn, stays). Not with replicas: another may have read the record meanwhile and be about to run
        a turn on it. Returns whether it was deleted."""
        if self.shared is not None:
            return False
        with self._table.lock:
            live = self._table.sessions.get(session.key)
            if live is not session or live.is_in_use or live.transcript_ids or live.num_turns:
                return False
        return self._delete(session)

    def delete(self, key: SessionKey) -> bool:
        """Forget a session everywhere; its journal record goes first (StateUnavailable: nothing forgotten).
        One in use is detached: its request finishes, its state is then dropped."""
        self._sync.refresh(key)
        with self._table.lock:
            session = self._table.sessions.get(key)
        return session is not None and self._delete(session)

    def _delete(self, session: Session) -> bool:
        """Remove a session from the shared store (outside the lock: it may wait on the network), then from the
        journal and memory. One process: a journal that refuses raises StateUnavailable, nothing forgotten.
        Replicas: the shared store's delete is the delete; the journal only caches it."""
        key = session.key
        if self.shared is not None and not key.is_bucket:
            self.shared.delete(key, session.ttl_s, new_op())  # every replica's copy is stale from now on
        with self._table.lock:
            if self._table.sessions.get(key) is not session:
                return True  # gone meanwhile (another replica's delete, read by a refresh)
            if not key.is_bucket:
                try:
                    self.journal.delete(key)
                except OSError as exc:
                    if self.shared is None:
                        raise StateUnavailable(f"session {key.name!r} could not be deleted: {exc.strerror}") from exc
                    log.warning("session %s: deleted, but its record here was not removed (%s)", key.name, exc)
            self._table.remove(session)
        self._drop_tiers(key)
        return True

    def drop_other_epochs(self, epoch: str | None) -> int:
        """Replicas: forget every idle copy not committed in Redis' epoch `epoch` (Redis lost its data since, so
        they are gone; none is ever written back). One in use goes when it is next refreshed. Returns how many."""
        if self.shared is None or epoch is None:
            return 0
        with self._table.lock:
            stale = [
                s for s in self._table.sessions.values() if not s.key.is_bucket and not s.is_in_use and s.epoch != epoch
            ]
            for session in stale:
                try:
                    self.journal.delete(session.key)
                except OSError:
                    log.exception("the record of session %s could not be removed", session.key.name)
                self._table.remove(session)
        for session in stale:
            self._drop_tiers(session.key)
        if stale:
            log.warning("%d sessions the shared store no longer holds were dropped", len(stale))
        return len(stale)

    def expire(self) -> None:
        with self._table.lock:
            self._expire_locked()

    def take_forgotten(self, model_id: str) -> list[tuple[SessionKey, list[int]]]:
        """Sessions of a model deleted or expired since the last call (their device K/V may go too)."""
        with self._table.lock:
            return self._table.forgotten.take(model_id)

    # -- internals (lock held) --------------------------------------------------------
    def _has_room(self, key: SessionKey) -> bool:
        """Whether the tenant may have one more of `key`'s family (buckets; or sessions and stored responses)."""
        if self.max_sessions_per_tenant is None:
            return True
        num_same, _ = self._table.index.usage(key.tenant, key, None)
        return num_same < self.max_sessions_per_tenant

    def _check_room(self, key: SessionKey) -> None:
        if not self._has_room(key):
            limit = self.max_sessions_per_tenant
            raise QuotaExceeded(f"this tenant already has {limit} sessions (limit {limit}); delete some")

    def _save(self, staged: Session, expected_op: str) -> None:
        """The shared store first (it refuses a change on top of one another replica moved on from), then the
        journal. Raises SessionBusy, SharedStoreUnavailable or StateUnavailable, with nothing applied, or
        SharedStoreUncertain."""
        if not staged.op:
            staged.op = new_op()
        self._commit_shared(staged, expected_op)
        self._journal_save(staged)

    def _commit_shared(self, staged: Session, expected_op: str, change: str = "a change") -> None:
        """With replicas: commit `staged` (its op) on top of `expected_op`, in the epoch that record was read in (a
        new record: Redis' epoch now). Stamped with the epoch now, a change to a record Redis lost meanwhile would
        pass the epoch check once any thread had read the new epoch, find no record, and be refused as another
        replica's change (409) instead of SharedStoreLost (503: what happened)."""
        if self.shared is not None and not staged.key.is_bucket:
            if not expected_op or not staged.epoch:  # "": a copy journaled before records named their epoch
                staged.epoch = self.shared.epoch()
            self.shared.save(staged.key, staged.to_record(), expected_op, change)

    def _journal_save(self, staged: Session) -> None:
        """One process: the journal is the truth, so a change it refuses is not applied (StateUnavailable).
        Replicas: the shared store is, and it has the change by now; this replica's journal only caches it."""
        try:
            self.journal.save(staged.key, staged.to_record())
        except OSError as exc:
            if self.shared is not None and not staged.key.is_bucket:
                log.warning("session %s: committed, but not journaled here (%s)", staged.key.name, exc.strerror or exc)
                return
            raise StateUnavailable(f"session {staged.key.name!r} could not be saved: {exc.strerror or exc}") from exc

    def _hold_new(self, session: Session) -> None:
        """A session being made: in the store (counted toward quotas, its name taken) and in use until it is
        committed, so nothing else starts on it meanwhile."""
        session.is_in_use = True
        self._table.insert(session)
        self._table.index.busy(session)

    def _commit_new(self, session: Session) -> None:
        """Commit a session `_hold_new` holds (outside the lock); one refused goes, as if never asked for."""
        try:
            self._save(session, expected_op="")
        except BaseException:
            with self._table.lock:
                if self._table.sessions.get(session.key) is session:
                    self._table.remove(session)
            raise

    def _drop_tiers(self, key: SessionKey) -> None:
        try:
            for forgetter in self._forgetters:
                forgetter.drop(key)
        except Exception:  # its record is gone: snapshots without one are removed at the next start
            log.exception("removing the K/V snapshots of session %s failed", key.name)

    def _expire_locked(self) -> None:
        """Drop idle sessions past their TTL, and their files; a session in use never expires."""
        for key in self._table.index.due(self._clock()):
            session = self._table.sessions[key]
            if session.is_in_use:
                continue  # touched again when released
            try:
                if not key.is_bucket:
                    self.journal.delete(key)
            except OSError:  # it expires again at the next start
                log.exception("the record of expired session %s could not be removed", key.name)
            self._table.remove(session)
            self._drop_tiers(key)  # file unlinks: quick enough to do under the lock

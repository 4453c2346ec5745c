"""A replica's copy of a session kept in step with the shared records (`SharedSync.refresh`), in a real Redis."""

from __future__ import annotations

import pytest

from server.sessions.errors import SessionBusy
from server.sessions.journal import Journal
from server.sessions.leases import LocalLeases
from server.sessions.record import CompletedTurn, SessionKey, Usage
from server.sessions.shared import SharedRecords
from server.sessions.store import SessionStore

pytest.importorskip("redis")
KEY = SessionKey("t", "s")


def replica(url: str, journal: Journal | None = None) -> SessionStore:
    """A store sharing records in Redis; leases that never keep two replicas apart (as after a lease expired)."""
    return SessionStore(3600, journal, leases=LocalLeases(), shared=SharedRecords(url))


def turn(ids: list[int]) -> CompletedTurn:
    return CompletedTurn(ids, "", "stop", Usage(len(ids), 0, 0), None)


def test_a_copy_whose_record_redis_no_longer_holds_is_dropped_not_continued(redis_server, tmp_path):
    """Redis expired the record (its own TTL; no tombstone, the same epoch): the copy here may be one another
    replica moved on from or deleted since, so it is never continued; the name starts a new session."""
    store = replica(redis_server.url, Journal(tmp_path))
    store.release(store.acquire(KEY, "m"), turn([1, 2, 3]))
    assert store.journal.path_for(KEY).exists()
    redis_server.client.delete(f"kvserve:rec:{KEY.tenant}:{KEY.kind}:{KEY.name}")
    assert store.view(KEY) is None
    assert not store.journal.path_for(KEY).exists()
    session = store.acquire(KEY, "m")  # first use again: a new, empty session
    assert session.transcript_ids == []
    store.release(session, turn([7, 8]))
    assert store.view(KEY).transcript_ids == [7, 8]


def test_a_copy_in_use_here_is_left_as_its_turn_read_it(redis_server):
    """Another replica commits while a turn runs here: a read of the session meanwhile leaves the copy in use as
    it was, so the turn here commits on top of what it read or is refused, never on top of the other's."""
    here, there = replica(redis_server.url), replica(redis_server.url)
    here.create(KEY, "m")
    running = here.acquire(KEY, "m")  # its turn reads revision 1
    there.release(there.acquire(KEY, "m"), turn([1, 2, 3]))  # another replica's turn commits meanwhile
    assert here.view(KEY).transcript_ids == []  # read here mid-turn: the copy in use is left alone
    assert (running.transcript_ids, running.rev) == ([], 1)
    with pytest.raises(SessionBusy, match="changed by another replica"):
        here.release(running, turn([4, 5]))
    assert here.view(KEY).transcript_ids == [1, 2, 3]  # once idle, the committed record is taken

"""The shared records' scripts in a real Redis: a change commits only on top of the operation it read, once."""

from __future__ import annotations

import pytest

from server.sessions.errors import SessionBusy
from server.sessions.record import Session, SessionKey
from server.sessions.shared import SharedRecords
from server.sessions.shared_state import new_op

pytest.importorskip("redis")


def test_a_change_sent_again_after_it_applied_is_answered_as_applied(redis_server):
    """A resend (the client library retrying a command whose answer was lost) finds its own operation on the
    record: it applied, so the turn it carries is answered as committed, never as another replica's conflict."""
    records = SharedRecords(redis_server.url)
    try:
        key = SessionKey("t", "s")
        created = Session(key, "m", op=new_op(), rev=1, epoch=records.epoch()).to_record()
        for _ in range(2):
            records.save(key, created, expected_op="")  # the second: a resent create
        turn = {**created, "op": new_op(), "rev": 2}
        for _ in range(2):
            records.save(key, turn, expected_op=created["op"])  # the second: a resent turn, not a 409
        stored = records.load(key)
        assert isinstance(stored, dict)
        assert (stored["op"], stored["rev"]) == (turn["op"], 2)
        # another change read on the same revision is still refused: only the same operation is "already applied"
        with pytest.raises(SessionBusy, match="changed by another replica"):
            records.save(key, {**created, "op": new_op(), "rev": 2}, expected_op=created["op"])
    finally:
        records.close()

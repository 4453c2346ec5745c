"""Leases' view of the shared store: the outcome of the call that began last wins, whatever thread reports last."""

from __future__ import annotations

import threading

import pytest

from server.sessions.errors import SharedStoreUnavailable
from server.sessions.leases import RedisLeases
from server.sessions.record import SessionKey
from server.sessions.shared import SharedRecords
from server.sessions.shared_state import SharedStoreState

redis = pytest.importorskip("redis")


class SlowRoundClient:
    """Stands in for redis.Redis. The renewer's first round is answered (its epoch read succeeds) but the test
    holds that answer back before the round can report it, as a preempted thread would; once `is_stopped`, every
    other call fails as a stopped Redis would."""

    def __init__(self) -> None:
        self.round_entered, self.round_gate = threading.Event(), threading.Event()
        self.is_stopped = False
        self._has_held = False

    def ping(self) -> bool:
        return self._answer(True)

    def get(self, name: str) -> bytes:
        if not self._has_held:  # the held round: Redis answered it, before it stopped
            self._has_held = True
            self.round_entered.set()
            assert self.round_gate.wait(60), "the test never let the round report"
            return b"epoch-1"
        return self._answer(b"epoch-1")

    def set(self, *args: object, **kwargs: object) -> bool:
        return self._answer(True)

    def _answer(self, value):
        if self.is_stopped:
            raise redis.ConnectionError("Connection refused")
        return value

    def close(self) -> None:
        pass


def test_an_older_call_reporting_late_does_not_overwrite_a_newer_outcome():
    health = SharedStoreState()
    older, newer = health.ticket(), health.ticket()
    assert health.report(newer, False) is True  # changed: was up
    assert health.report(older, True) is None  # began before the failure was seen: stale news
    assert health.is_up is False
    assert health.report(health.ticket(), True) is False  # a call begun later answers: up again
    assert health.is_up is True


def test_a_ping_preempted_before_it_reports_cannot_say_up_after_a_failed_take():
    leases = RedisLeases("redis://127.0.0.1:9/0", lease_s=3600)  # the renewer thread sleeps for the whole test
    slow = SlowRoundClient()
    leases.client = slow
    try:
        renewer = threading.Thread(target=leases.renew_once)  # the renewer's round: it pings (nothing held)
        renewer.start()
        assert slow.round_entered.wait(60), "the renewer's round never began"
        slow.is_stopped = True  # meanwhile Redis stopped: a take fails
        with pytest.raises(SharedStoreUnavailable):
            leases.take(SessionKey("default", "conv"))
        assert leases.is_up is False
        slow.round_gate.set()  # the ping's answer (sent before the stop) is written down only now
        renewer.join(60)
        assert not renewer.is_alive()
        assert leases.is_up is False, "a ping that began before the failed take reported 'up' after it"
        slow.is_stopped = False
        leases.renew_once()  # a round that begins now and is answered: the store is up again
        assert leases.is_up is True
    finally:
        leases.close()


def test_a_record_the_store_could_not_read_says_down_for_every_user_of_it():
    """/ready reads one health for the shared store: a failed record read (a turn refused before it asks for its
    lease) says down, and a ping that began before it cannot say up after it."""
    health = SharedStoreState()
    leases = RedisLeases("redis://127.0.0.1:9/0", lease_s=3600, state=health)  # nothing listens on port 9
    records = SharedRecords("redis://127.0.0.1:9/0", state=health)
    slow = SlowRoundClient()
    leases.client = slow
    try:
        renewer = threading.Thread(target=leases.renew_once)
        renewer.start()
        assert slow.round_entered.wait(60), "the renewer's round never began"
        slow.is_stopped = True
        with pytest.raises(SharedStoreUnavailable):
            records.load(SessionKey("default", "conv"))
        assert leases.is_up is False
        slow.round_gate.set()
        renewer.join(60)
        assert not renewer.is_alive()
        assert leases.is_up is False
    finally:
        leases.close()
        records.close()

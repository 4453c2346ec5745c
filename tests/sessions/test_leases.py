"""Leases' view of the shared store: the outcome of the call that began last wins, whatever thread reports last."""

from __future__ import annotations

import threading

import pytest

from server.sessions.errors import SharedStoreUnavailable
from server.sessions.health import SharedStoreHealth
from server.sessions.leases import RedisLeases
from server.sessions.record import SessionKey
from server.sessions.shared import SharedRecords

redis = pytest.importorskip("redis")


class SlowPingClient:
    """Stands in for redis.Redis: `ping` answers only when the test lets it; `set` fails (Redis stopped)."""

    def __init__(self) -> None:
        self.ping_entered, self.ping_gate = threading.Event(), threading.Event()

    def ping(self) -> bool:
        self.ping_entered.set()
        assert self.ping_gate.wait(60), "the test never let the ping answer"
        return True

    def set(self, *args: object, **kwargs: object) -> bool:
        raise redis.ConnectionError("Connection refused")

    def close(self) -> None:
        pass


def test_an_older_call_reporting_late_does_not_overwrite_a_newer_outcome():
    health = SharedStoreHealth()
    older, newer = health.ticket(), health.ticket()
    assert health.report(newer, False) is True  # changed: was up
    assert health.report(older, True) is None  # began before the failure was seen: stale news
    assert health.is_up is False
    assert health.report(health.ticket(), True) is False  # a call begun later answers: up again
    assert health.is_up is True


def test_a_ping_preempted_before_it_reports_cannot_say_up_after_a_failed_take():
    leases = RedisLeases("redis://127.0.0.1:9/0", lease_s=3600)  # the renewer thread sleeps for the whole test
    slow = SlowPingClient()
    leases.client = slow
    try:
        renewer = threading.Thread(target=leases.renew_once)  # the renewer's round: it pings (nothing held)
        renewer.start()
        assert slow.ping_entered.wait(60), "the renewer never pinged"
        with pytest.raises(SharedStoreUnavailable):
            leases.take(SessionKey("default", "conv"))  # meanwhile Redis stopped: the take fails
        assert leases.is_up is False
        slow.ping_gate.set()  # the ping's answer (sent before the stop) is written down only now
        renewer.join(60)
        assert not renewer.is_alive()
        assert leases.is_up is False, "a ping that began before the failed take reported 'up' after it"
        leases.renew_once()  # a round that begins now and is answered: the store is up again
        assert leases.is_up is True
    finally:
        leases.close()


def test_a_record_the_store_could_not_read_says_down_for_every_user_of_it():
    """/ready reads one health for the shared store: a failed record read (a turn refused before it asks for its
    lease) says down, and a ping that began before it cannot say up after it."""
    health = SharedStoreHealth()
    leases = RedisLeases("redis://127.0.0.1:9/0", lease_s=3600, health=health)  # nothing listens on port 9
    records = SharedRecords("redis://127.0.0.1:9/0", health=health)
    slow = SlowPingClient()
    leases.client = slow
    try:
        renewer = threading.Thread(target=leases.renew_once)
        renewer.start()
        assert slow.ping_entered.wait(60), "the renewer never pinged"
        with pytest.raises(SharedStoreUnavailable):
            records.load(SessionKey("default", "conv"))
        assert leases.is_up is False
        slow.ping_gate.set()
        renewer.join(60)
        assert not renewer.is_alive()
        assert leases.is_up is False
    finally:
        leases.close()
        records.close()

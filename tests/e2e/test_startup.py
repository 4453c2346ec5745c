"""What an operator meets on day one, with real `kvserve serve` processes on tiny models: replicas started at once
on one cache directory, a model that cannot load, a broken triton."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server.models.convert import gguf_cache_dir, lock_path
from tests.e2e.server import Server, _kill_leftovers, spawn  # noqa: F401 - the fixture is autouse
from tests.helpers import DEADLINE_S, wait_until
from tests.tiny_gguf import save_tiny_gguf

pytestmark = pytest.mark.faults  # real server processes, a model that cannot load, a replica that died converting
SMALL_POOL = {"KVSERVE_KV_BUDGET_BYTES": str(16 << 20)}  # not a quarter of RAM per replica
CONVERTING = "converting tiny.gguf to safetensors"
WAITING = "waiting for another process converting tiny.gguf"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return save_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def models_file(directory: Path, *entries: tuple[str, Path]) -> Path:
    """A models.toml serving each (id, source) in float32 (the same on any CPU)."""
    path = directory / "models.toml"
    path.write_text("".join(f'[[models]]\nid = "{i}"\nsource = "{s}"\ndtype = "float32"\n\n' for i, s in entries))
    return path


def test_replicas_started_at_once_on_one_cache_directory_all_serve_the_model_converted_once(gguf_file, tmp_path):
    """Two replicas start together on an empty cache directory (compose --scale, a Deployment over one volume)
    while a third one is converting the model; that third one is then killed, leaving its half-written directory.
    Both become ready, the model converted by one of them alone, the dead conversion's leftovers gone."""
    cache = tmp_path / "cache"
    cache.mkdir()
    target = gguf_cache_dir(gguf_file, cache, "tiny")
    models = models_file(tmp_path, ("tiny", gguf_file))
    args = ["--models-file", str(models), "--cache-dir", str(cache)]
    with open(lock_path(target), "a") as third:  # the third replica, converting as the two start
        fcntl.flock(third, fcntl.LOCK_EX)
        half = cache / f"{target.name}.4242-deadbeef.partial"
        half.mkdir()
        (half / "model.safetensors").write_bytes(b"half")
        replicas = [
            Server(None, tmp_path / n, tmp_path / f"{n}.log", SMALL_POOL, args=args, wait=False) for n in ("a", "b")
        ]
        for replica in replicas:  # both meet the conversion in progress: the race is certain, not left to timing
            wait_until(lambda r=replica: WAITING in r.log_path.read_text(), what=f"{replica.log_path.name} to wait")
    # killed: the kernel drops its lock, its directory stays
    for replica in replicas:
        replica.wait_ready()
    logs = [replica.log_path.read_text() for replica in replicas]
    assert sum(CONVERTING in log for log in logs) == 1, "converted more than once, or never"
    assert any("was converted by another process meanwhile" in log for log in logs)
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith("dtype-choices")) == [
        target.name,
        lock_path(target).name,
    ]


def broken_gguf(directory: Path) -> Path:
    path = directory / "broken.gguf"
    path.write_bytes(b"not a model " * 100)
    return path


def test_a_server_whose_only_model_cannot_load_exits_non_zero_saying_why(tmp_path):
    """Not /ready 503 and /health 200 for ever, which no orchestrator restarts: it stops, its shutdown runs, and
    the last line on stderr says which model failed and why."""
    models = models_file(tmp_path, ("bad", broken_gguf(tmp_path)))
    args = ["serve", "--port", "0", "--models-file", str(models), "--cache-dir", str(tmp_path / "cache")]
    args += ["--state-dir", str(tmp_path / "state")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **SMALL_POOL}
    with open(tmp_path / "stdout", "wb") as out, open(tmp_path / "stderr", "wb") as err:
        proc = spawn([sys.executable, "-m", "server", *args], stdout=out, stderr=err, env=env)
        try:
            code = proc.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail("the server whose only model failed is still running")
    stderr = (tmp_path / "stderr").read_text()
    assert code == 1, stderr[-3000:]
    assert "Application shutdown complete" in stderr  # the app's own shutdown ran
    assert stderr.splitlines()[-1] == (
        f"kvserve: model 'bad' (source {tmp_path / 'broken.gguf'}) failed to load: {tmp_path / 'broken.gguf'} "
        "does not start with the GGUF magic bytes, so it is not a GGUF file."
    )


def test_a_server_serves_the_models_that_load_and_names_the_one_that_failed(model_dir, tmp_path):
    models = models_file(tmp_path, ("bad", broken_gguf(tmp_path)), ("good", model_dir))
    args = ["--models-file", str(models), "--cache-dir", str(tmp_path / "cache")]
    server = Server(None, tmp_path / "state", tmp_path / "log", SMALL_POOL, args=args)  # waits for /ready 200
    ready = httpx.get(server.base + "/ready").json()
    reason = ready["models"]["bad"]["detail"]
    assert reason.startswith(f"model 'bad' (source {tmp_path / 'broken.gguf'}) failed to load: ")
    assert reason.endswith("so it is not a GGUF file.")
    assert ready == {
        "status": "degraded",
        "models": {"bad": {"status": "failed", "detail": reason}, "good": {"status": "ready", "detail": None}},
        "message": f"serving 1 of 2 models; {reason}",
    }
    bad = httpx.get(server.base + "/v1/models/bad").json()
    assert (bad["status"], bad["detail"]) == ("failed", reason)
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    r = httpx.post(server.base + "/v1/chat/completions", json={"model": "bad", **chat})
    assert r.status_code == 503, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["message"]) == ("model_failed", reason)
    r = httpx.post(server.base + "/v1/chat/completions", json={"model": "good", **chat}, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    assert server.proc.poll() is None  # one model serves: the process stays


@pytest.fixture
def broken_triton(tmp_path) -> Path:
    """A triton package that imports, and whose triton.language raises: put first on a process's path."""
    root = tmp_path / "broken-triton"
    (root / "triton" / "language").mkdir(parents=True)
    (root / "triton" / "__init__.py").write_text("")
    (root / "triton" / "language" / "__init__.py").write_text("raise RuntimeError('this triton is broken')\n")
    return root


def on_path(directory: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH")) if p)}


def test_a_broken_triton_is_off_in_one_line_and_the_server_serves(broken_triton, model_dir, tmp_path):
    """It broke torch's compiler, which transformers imports with its models: every start, on a CPU too, with a
    35-line traceback. Now it is treated as not installed, and said so once."""
    env = {**SMALL_POOL, **on_path(broken_triton)}
    server = Server(model_dir, tmp_path / "state", tmp_path / "log", env)
    chat = {"model": "model", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    r = httpx.post(server.base + "/v1/chat/completions", json=chat, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    assert server.stop(signal.SIGTERM) == 0
    log = server.log_path.read_text()
    assert "Traceback" not in log
    said = [line for line in log.splitlines() if "this triton is broken" in line]
    assert len(said) == 1, said
    assert said[0].endswith(
        "WARNING kvserve: triton is installed but does not import (RuntimeError: this triton is broken): off, as if "
        "not installed (the Triton kernels; CUDA attention by SDPA)"
    )


def test_with_a_broken_triton_hidden_torch_compile_works_and_the_triton_backend_is_not_chosen(broken_triton):
    """On a CPU inductor generates C++, without triton: --compile keeps working. The Triton backend is chosen
    only where triton is installed, which a hidden one is not."""
    code = (
        "from server.__main__ import hide_broken_triton\n"
        "hide_broken_triton()\n"
        "import torch\n"
        "from server.engine.model_runner import triton_available\n"
        "print(triton_available(), torch.compile(lambda x: x * 2)(torch.ones(2)).tolist())\n"
    )
    env = {**os.environ, **on_path(broken_triton)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=DEADLINE_S, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["False [2.0, 2.0]"]

"""What an operator meets on day one, with real `kvserve serve` processes on tiny models: replicas started at once
on one cache directory."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

from server.models.convert import gguf_cache_dir, lock_path
from tests.e2e.server import Server, _kill_leftovers  # noqa: F401 - the fixture is autouse
from tests.helpers import wait_until
from tests.tiny_gguf import save_tiny_gguf

SMALL_POOL = {"KVSERVE_KV_BUDGET_BYTES": str(16 << 20)}  # not a quarter of RAM per replica
CONVERTING = "converting tiny.gguf to safetensors"
WAITING = "waiting for another process converting tiny.gguf"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return save_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def models_file(directory: Path, *entries: tuple[str, Path]) -> Path:
    """A models.toml serving each (id, source) in float32 (no bf16 timing at start)."""
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

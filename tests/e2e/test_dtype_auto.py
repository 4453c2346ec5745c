"""`dtype = "auto"` does not depend on how busy the host is: a real `kvserve serve` process on the default model,
started once on a quiet machine and once beside processes spinning on every core, each on a fresh cache
directory, computes in the same dtype, the one the CPU's instructions call for.

Replicas of one deployment start at different moments; had one of them picked float32 under load, it would run
at about half speed for good and share no K/V with the others (the dtype is part of the blocks' fingerprint).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from subprocess import Popen

import httpx
import pytest
import torch

from server.models.dtype import cpu_bf16_flags
from server.models.loader import read_specs, resolve_source
from tests.e2e.server import Server, _kill_leftovers, end_group, spawn  # noqa: F401 - the fixture is autouse

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
SMALL_POOL = {"KVSERVE_KV_BUDGET_BYTES": str(16 << 20)}
START_S = 600  # a start of the default model beside a busy loop, on a slow CI machine


@pytest.fixture(scope="module")
def default_model() -> Path:
    """The default model's converted directory in the repository's cache, converted here on a first run (as its
    first `kvserve serve` would), so that each start below can have a fresh cache directory of its own."""
    (spec,) = read_specs(ROOT / "models" / "models.toml")
    return Path(resolve_source(spec, ROOT / "models" / "cache"))


@contextlib.contextmanager
def busy_loop() -> Iterator[list[Popen]]:
    """A process spinning on each core this test may run on, until the block ends."""
    spin = [sys.executable, "-c", "while True: pass"]
    spinners = [spawn(spin) for _ in os.sched_getaffinity(0)]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            end_group(spinner)


def started(model: Path, tmp_path: Path, name: str) -> dict:
    """Start a server on `model` with `dtype = "auto"` on the CPU and a cache directory of its own; its model
    object once it is ready."""
    models = tmp_path / f"{name}.models.toml"
    models.write_text(f'[[models]]\nid = "{MODEL}"\nsource = "{model}"\ndtype = "auto"\ndevice = "cpu"\n')
    args = ["--models-file", str(models), "--cache-dir", str(tmp_path / f"{name}-cache")]
    server = Server(None, tmp_path / f"{name}-state", tmp_path / f"{name}.log", SMALL_POOL, args=args, wait=False)
    server.wait_ready(START_S)
    info = httpx.get(f"{server.base}/v1/models/{MODEL}").json()
    end_group(server.proc)
    server.log.close()
    return dict(info)


def test_a_start_beside_a_busy_loop_computes_in_the_dtype_of_a_quiet_start(default_model, tmp_path):
    quiet = started(default_model, tmp_path, "quiet")
    with busy_loop() as spinners:
        busy = started(default_model, tmp_path, "busy")
        assert all(s.poll() is None for s in spinners), "the busy loop ended before the server was ready"
    why = f"quiet: {quiet['dtype']} ({quiet['dtype_reason']}); busy: {busy['dtype']} ({busy['dtype_reason']})"
    assert busy["dtype"] == quiet["dtype"], why
    # What the CPU can do decides: bf16 with bf16 instructions that torch's oneDNN computes with, else fp32.
    capable = bool(cpu_bf16_flags()) and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert quiet["dtype"] == ("bfloat16" if capable else "float32"), why

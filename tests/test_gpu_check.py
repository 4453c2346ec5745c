"""bench/gpu_check.sh, the script a lent GPU runs, passes here on a CPU with a small shape."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_the_gpu_check_runs_on_a_cpu():
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    for batch in (1, 8, 32):
        assert re.search(rf"^\s+{batch}\s+\d+\.\d\s+\d+\.\d$", out, re.M), out
    assert "batch-1 decode reads" in out
    turn2 = re.search(r"turn 2 TTFT \((\d+) tokens\): with the session .* \((\d+) cached\)", out)
    assert turn2, out
    assert int(turn2.group(2)) >= int(turn2.group(1)) - 32 - 16  # the history came from the session's K/V

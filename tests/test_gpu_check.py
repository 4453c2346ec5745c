"""bench/gpu_check.sh, the one command a lent GPU runs, passes here on a CPU with a small shape; its figures are
measured (each bounded by what a machine can do, "n/a" only where a CPU cannot measure them), and a part that
fails or runs out of time is reported while the next one runs."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK = ROOT / "bench" / "gpu_check.sh"
# Ceilings no machine reaches, far below a made-up figure (a decode rate once computed as the difference of two
# runs, floored at 1e-9 s, read 15,000,000,000 tok/s): a decode step is a forward pass of every layer driven
# from Python, never under 10 us, so one stream decodes at most 100,000 tok/s and 64 streams 64 times that; a
# prefill step of 2,048 tokens takes more than 0.2 ms; no chip multiplies at 5,000 TFLOP/s (an H200: ~990 dense
# bf16) or reads memory at 10,000 GB/s (an H200: 4,800).
MAX_STREAM_TOK_S = 1e5
MAX_PREFILL_TOK_S = 1e7
MAX_TFLOP_S = 5e3
MAX_GB_S = 1e4


def rate(value: object, ceiling: float, where: str) -> float:
    assert isinstance(value, int | float), f"{where}: {value!r} is not a number"
    assert math.isfinite(value), f"{where}: {value} is outside (0, {ceiling:g}]"
    assert 0 < value <= ceiling, f"{where}: {value} is outside (0, {ceiling:g}]"
    return float(value)


def check_figures(figures: dict, on_cpu: bool) -> None:
    """Every figure engine.json holds is a number a machine can reach; null only where a CPU cannot measure it
    (CUDA graphs are captured on CUDA only; device memory is CUDA's)."""
    for row in figures["decode"]:
        where = f"decode at batch {row['batch']}, graphs {'on' if row['graphs'] else 'off'}"
        if on_cpu and row["graphs"]:
            assert (row["tok_s"], row["per_stream_tok_s"]) == (None, None), f"{where}: a CPU captures no graphs"
            continue
        rate(row["tok_s"], MAX_STREAM_TOK_S * row["batch"], where)
        rate(row["per_stream_tok_s"], MAX_STREAM_TOK_S, f"{where}, per stream")
    for row in figures["prefill"]:
        rate(row["tok_s"], MAX_PREFILL_TOK_S, f"prefill of {row['tokens']}")
        rate(row["tflop_s"], MAX_TFLOP_S, f"prefill of {row['tokens']}, TFLOP/s")
    for mode in ("graphs_on", "graphs_off"):
        long = figures["long_context"][mode]
        if on_cpu and mode == "graphs_on":
            assert long == {"ttft_s": None, "tok_s": None}, "a CPU captures no graphs"
            continue
        rate(long["tok_s"], MAX_STREAM_TOK_S, f"long context, {mode}")
        rate(long["ttft_s"], 3600, f"long context, {mode}, TTFT")
    for name, engine in figures["engines"].items():
        for key in ("built_s", "started_s", "weights_bytes", "pool_tokens", "pool_bytes"):
            rate(engine[key], math.inf, f"{name}: {key}")
        for key in ("capture_s", "peak_bytes", "peak_bytes_at_start"):
            if on_cpu:
                assert engine[key] is None, f"{name}: {key} is CUDA's"
            elif key != "capture_s" or name == "graphs_on":
                rate(engine[key], math.inf, f"{name}: {key}")


def summary(out: str) -> dict[str, str]:
    lines = out[out.index("== summary") :].splitlines()[1:]
    return {line.split()[0]: line.split(None, 1)[1] for line in lines if line.strip()}


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_the_gpu_check_runs_on_a_cpu(tmp_path):
    # the parts' limits are sized for the GPU machine: CI may be many times slower than it
    limits = {f"GPU_CHECK_LIMIT_{part}": "600" for part in ("CUDA_TESTS", "ENGINE", "SESSION")}
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "GPU_CHECK_BUDGET_S": "1700", **limits}
    done = subprocess.run(["bash", str(GPU_CHECK)], env=env, capture_output=True, text=True, timeout=1750)
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-2000:]
    parts = summary(out)
    for part in ("cuda-tests", "engine", "session"):
        assert parts[part].startswith("passed"), parts
    assert re.search(r": \d+ skipped\b", parts["cuda-tests"]), parts  # pytest's count: no CUDA here
    assert parts["kernels"].startswith("skipped"), parts
    assert parts["sm90"].startswith("skipped"), parts
    for name in ("check.log", "cuda-tests.log", "engine.log", "engine.json", "session.log"):
        assert (tmp_path / name).is_file(), name
    assert "\nPython.h: " in out, out  # what triton needs, printed first
    assert "\nC compiler: " in out, out

    engine = (tmp_path / "engine.log").read_text()
    assert not re.search(r"\b(nan|inf)\b", engine), engine
    results = json.loads((tmp_path / "engine.json").read_text())
    assert results["failures"] == []
    figures = results["figures"]
    check_figures(figures, on_cpu=True)
    printed = re.findall(r"^\s+(\d+)\s+n/a\s+n/a\s+(\d+\.\d)\s+(\d+\.\d)$", engine, re.M)
    assert [int(batch) for batch, *_ in printed] == [1, 8, 32, 64], engine  # graphs on: n/a on a CPU
    roofline = re.search(r"batch-1 decode reads \S+ GB per step: (\S+) GB/s", engine)
    assert roofline, engine
    rate(float(roofline.group(1)), MAX_GB_S, "batch-1 decode, GB/s")
    session = figures["session"]
    assert session["turn2_cached"] >= session["turn2_tokens"] - 32 - 16  # the history came from the session

    http = (tmp_path / "session.log").read_text()
    turn = r"^turn (\d): (\d+) prompt tokens, (\d+) cached, (\d+) out; TTFT \d+ ms, decode (\S+) tok/s"
    turns = re.findall(turn, http, re.M)
    assert [t[0] for t in turns] == ["1", "2"], http
    (_, prompt1, cached1, _, _), (_, _, cached2, _, decode2) = turns
    assert int(cached1) == 0, http
    assert int(cached2) >= int(prompt1) - 16, http  # turn 1's K/V, over HTTP
    rate(float(decode2), MAX_STREAM_TOK_S, "HTTP turn 2 decode")
    assert "session gpu-check: 2 turns" in http, http  # the session's own record, not the prefix cache alone


def test_an_absurd_rate_or_an_unexplained_na_is_rejected():
    """The recorded failure (a batch-1 rate of 15,000,000,000 tok/s) and a CPU figure missing where a CPU measures."""
    decode = [
        {"batch": 1, "graphs": True, "tok_s": None, "per_stream_tok_s": None},
        {"batch": 1, "graphs": False, "tok_s": 700.0, "per_stream_tok_s": 700.0},
    ]
    figures = {
        "decode": decode,
        "prefill": [{"tokens": 64, "ttft_s": 0.002, "tok_s": 32000.0, "tflop_s": 0.01}],
        "long_context": {"graphs_on": {"ttft_s": None, "tok_s": None}, "graphs_off": {"ttft_s": 0.2, "tok_s": 500.0}},
        "engines": {
            "graphs_off": {
                "built_s": 0.1,
                "started_s": 1.0,
                "weights_bytes": 400_000,
                "pool_tokens": 1 << 20,
                "pool_bytes": 1 << 30,
                "capture_s": None,
                "peak_bytes": None,
                "peak_bytes_at_start": None,
            }
        },
    }
    check_figures(figures, on_cpu=True)
    decode[1]["per_stream_tok_s"] = 15_000_000_000.0
    with pytest.raises(AssertionError, match="outside"):
        check_figures(figures, on_cpu=True)
    decode[1]["per_stream_tok_s"] = None
    with pytest.raises(AssertionError, match="not a number"):
        check_figures(figures, on_cpu=True)


def test_a_part_that_fails_or_runs_out_of_time_is_reported_and_the_next_one_runs(tmp_path):
    script = (
        f"source {GPU_CHECK}; part slow 1 sleep 60; part broken 60 bash -c 'echo why; exit 3'; "
        "part fine 60 echo done; summary"
    )
    done = subprocess.run(
        ["bash", "-c", script], env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr
    parts = summary(done.stdout)
    assert list(parts) == ["slow", "broken", "fine"], done.stdout
    assert parts["slow"].startswith("timed out after 1 s"), parts
    assert parts["broken"].startswith("failed (exit status 3)"), parts
    assert parts["fine"].startswith("passed"), parts
    assert (tmp_path / "broken.log").read_text() == "why\n"
    assert "why" in done.stdout  # a failed part's log is printed
    assert (tmp_path / "fine.log").read_text() == "done\n"
    assert (tmp_path / "slow.log").is_file()


def test_a_part_past_the_budget_is_skipped(tmp_path):
    done = subprocess.run(
        ["bash", "-c", f"source {GPU_CHECK}; part late 60 echo never; summary"],
        env={**os.environ, "OUT": str(tmp_path), "GPU_CHECK_BUDGET_S": "10"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(done.stdout)["late"].startswith("skipped"), done.stdout
    assert not (tmp_path / "late.log").exists()

"""`dtype: auto`: bf16 on a CPU only with bf16 instructions and when it measures faster; configured dtypes as given."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from server.models import dtype as dtype_mod
from server.models.dtype import choose_dtype, cpu_bf16_flags, turn_ms
from tests.helpers import DEADLINE_S, wait_until
from tests.tiny import build_model

CPU = torch.device("cpu")


def tiny_config():
    return build_model(vocab_size=300, eos_id=1).config


def test_a_configured_dtype_is_used_as_is():
    choice = choose_dtype("float64", CPU, tiny_config())
    assert choice.dtype == torch.float64
    assert choice.reason == "configured in models.toml"
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        choose_dtype("float8", CPU, tiny_config())


def test_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert cpu_bf16_flags(info) == ["amx_bf16", "avx512_bf16"]
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
    assert cpu_bf16_flags(info) == []
    assert cpu_bf16_flags(tmp_path / "absent") == []


def test_a_cpu_without_bf16_instructions_stays_in_float32(monkeypatch):
    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: [])
    monkeypatch.setattr(dtype_mod, "turn_ms", lambda *a: pytest.fail("nothing to measure without bf16"))
    choice = choose_dtype("auto", CPU, tiny_config())
    assert choice.dtype == torch.float32
    assert "no bf16 instructions" in choice.reason


@pytest.mark.parametrize(
    ("fp32_ms", "bf16_ms", "expected"), [(100.0, 40.0, torch.bfloat16), (100.0, 95.0, torch.float32)]
)
def test_bf16_is_picked_only_when_it_measures_faster(monkeypatch, fp32_ms, bf16_ms, expected):
    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: ["amx_bf16"])
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(dtype_mod, "turn_ms", lambda _config, dt: bf16_ms if dt == torch.bfloat16 else fp32_ms)
    choice = choose_dtype("auto", CPU, tiny_config())
    assert choice.dtype == expected
    assert f"{bf16_ms:.0f} ms in bfloat16 vs {fp32_ms:.0f} ms in float32" in choice.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_turn_is_measured_on_the_model_shapes(dtype):
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bf16 kernels on this CPU")
    assert 0 < turn_ms(tiny_config(), dtype, repeats=1) < 60_000
    # Heads x head_dim other than the hidden size (Gemma-3 270M: 4 x 256 against 640): the output projection's
    # input is the attention's width, not the hidden size.
    wide = tiny_config()
    wide.head_dim = 3 * wide.hidden_size // wide.num_attention_heads
    assert 0 < turn_ms(wide, dtype, repeats=1) < 60_000


def test_a_measurement_is_kept_for_later_starts_on_this_machine(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: ["amx_bf16"])
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(
        dtype_mod, "turn_ms", lambda _c, dt: calls.append(dt) or (40.0 if dt == torch.bfloat16 else 100.0)
    )
    memo = tmp_path / "cache" / "dtype-choices.json"
    first = choose_dtype("auto", CPU, tiny_config(), memo)
    assert first.dtype == torch.bfloat16
    assert len(calls) == 2 * dtype_mod.ROUNDS
    monkeypatch.setattr(dtype_mod, "turn_ms", lambda *a: pytest.fail("measured again"))
    again = choose_dtype("auto", CPU, tiny_config(), memo)  # a later start: the same answer, no measuring
    assert again.dtype == torch.bfloat16
    assert "measured on this machine earlier" in again.reason
    other = build_model(vocab_size=300, eos_id=1).config
    other.hidden_size = 128  # another model's shapes are measured for themselves
    monkeypatch.setattr(dtype_mod, "turn_ms", lambda _c, dt: 100.0)
    assert choose_dtype("auto", CPU, other, memo).dtype == torch.float32
    memo.write_text("not json")  # a damaged memo is measured anew, never trusted
    assert choose_dtype("auto", CPU, tiny_config(), memo).dtype == torch.float32


def test_processes_starting_at_once_measure_once_and_agree(monkeypatch, tmp_path, caplog):
    """Two loads at once on one cache directory (threads here; the lock is a file lock, so processes alike): one
    measures, the other waits for it and takes its choice, even where its own measurement would have differed."""
    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: ["amx_bf16"])
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    measuring, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def turn(_config, dt: torch.dtype) -> float:
        calls.append(threading.current_thread().name)
        measuring.set()
        assert release.wait(DEADLINE_S), "the test never let the measurement finish"
        first = calls[0] == threading.current_thread().name  # the first measures bf16 faster, a second would not
        return (40.0 if first else 100.0) if dt == torch.bfloat16 else 100.0

    monkeypatch.setattr(dtype_mod, "turn_ms", turn)
    memo = tmp_path / "cache" / "dtype-choices.json"
    choices = {}

    def load(name: str) -> None:
        choices[name] = choose_dtype("auto", CPU, tiny_config(), memo)

    first, second = (threading.Thread(target=load, args=(name,), name=name) for name in "ab")
    with caplog.at_level(logging.INFO, logger="kvserve.registry"):
        first.start()
        assert measuring.wait(DEADLINE_S), "the first never measured"
        second.start()  # while the first measures
        wait_until(lambda: "waiting for another process measuring" in caplog.text or len(set(calls)) > 1)
        release.set()
        first.join(DEADLINE_S)
        second.join(DEADLINE_S)
    assert set(calls) == {"a"}, "measured by both"
    assert choices["a"].dtype == choices["b"].dtype == torch.bfloat16
    assert "measured on this machine earlier" in choices["b"].reason

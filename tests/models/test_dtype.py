"""`dtype: auto`: bf16 on a CPU whose bf16 instructions torch's oneDNN computes with, fp32 on any other CPU, bf16
(or fp16) on CUDA; configured dtypes as given. Nothing is timed, so nothing here depends on the machine's load."""

from __future__ import annotations

import dataclasses
import json
import os
import platform

import pytest
import torch
from transformers import AutoConfig

from server.kv.kernels import cpuinfo_field
from server.models import dtype as dtype_mod
from server.models.dtype import choose_dtype, cpu_bf16_flags
from server.models.loader import load_model

CPU = torch.device("cpu")


def test_a_configured_dtype_is_used_as_is(monkeypatch):
    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: pytest.fail("a configured dtype looks at no CPU"))
    choice = choose_dtype("float64", CPU)
    assert choice.dtype == torch.float64
    assert choice.reason == "configured in models.toml"
    assert choose_dtype("float32", CPU).dtype == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        choose_dtype("float8", CPU)


def test_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert cpu_bf16_flags(info) == ["amx_bf16", "avx512_bf16"]
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
    assert cpu_bf16_flags(info) == []
    assert cpu_bf16_flags(tmp_path / "absent") == []


def test_a_cpu_without_bf16_instructions_stays_in_float32(monkeypatch):
    """Whatever oneDNN says: on AVX512 without AVX512-BF16 it emulates bf16, slower than fp32."""
    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: [])
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    choice = choose_dtype("auto", CPU)
    assert choice.dtype == torch.float32
    assert choice.reason == "auto: this CPU has no bf16 instructions (AMX-BF16 or AVX512-BF16)"


@pytest.mark.parametrize("flags", [["avx512_bf16"], ["amx_bf16"], ["amx_bf16", "avx512_bf16"]])
def test_a_cpu_with_bf16_instructions_that_onednn_uses_computes_in_bf16(monkeypatch, flags):
    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: flags)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    choice = choose_dtype("auto", CPU)
    assert choice.dtype == torch.bfloat16
    assert choice.reason == f"auto: the CPU has {'+'.join(flags)} and torch's oneDNN computes bf16 with it"


def test_bf16_instructions_without_onednn_bf16_stay_in_float32(monkeypatch):
    """A torch built without oneDNN (or one that does not know the CPU) would run bf16 on its slow fallbacks."""
    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: ["avx512_bf16"])
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    choice = choose_dtype("auto", CPU)
    assert choice.dtype == torch.float32
    assert choice.reason == "auto: the CPU has avx512_bf16 but this torch's oneDNN computes no bf16 on it"


def test_another_device_is_decided_by_what_it_supports(monkeypatch):
    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: pytest.fail("a GPU's choice reads no CPU flags"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert choose_dtype("auto", torch.device("cuda")).dtype == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert choose_dtype("auto", torch.device("cuda")) == dtype_mod.DtypeChoice(
        torch.float16, "auto: CUDA device without bfloat16 support"
    )
    assert choose_dtype("auto", torch.device("mps")).dtype == torch.float32


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 kernels on this CPU")
def test_a_float32_an_older_kvserve_measured_and_kept_in_the_cache_is_not_used(monkeypatch, tiny_spec, tmp_path):
    """Older versions timed bf16 against fp32 at start and kept the answer in <cache_dir>/dtype-choices.json, under
    this key; a busy start could keep float32 there for good. The CPU decides now, whatever that file says."""
    monkeypatch.setattr(dtype_mod, "cpu_bf16_flags", lambda: ["avx512_bf16"])
    spec = dataclasses.replace(tiny_spec, dtype="auto")
    text = AutoConfig.from_pretrained(tiny_spec.source).get_text_config(decoder=True)
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
    shape = [getattr(text, f, None) for f in (*fields, "num_key_value_heads")]
    cpu = cpuinfo_field("model name") or platform.processor() or platform.machine()
    old_key = f"{cpu}|{os.cpu_count()} cpus|avx512_bf16|torch {torch.__version__}|{shape}"
    reason = "auto: the CPU has avx512_bf16 but bfloat16 is not faster here; ... 147 ms in bfloat16 vs 83 ms in float32"
    memo = tmp_path / "dtype-choices.json"
    memo.write_text(json.dumps({old_key: {"dtype": "float32", "reason": reason}}))
    loaded = load_model(spec, tmp_path)
    assert loaded.dtype == torch.bfloat16
    assert loaded.dtype_reason == "auto: the CPU has avx512_bf16 and torch's oneDNN computes bf16 with it"
    assert json.loads(memo.read_text()) == {old_key: {"dtype": "float32", "reason": reason}}  # left for old replicas

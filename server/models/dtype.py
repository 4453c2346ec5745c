"""Which dtype a model computes (and keeps its K/V) in: `auto` decides by what the device can do.

CUDA: bfloat16 where the GPU supports it, else float16. CPU: bfloat16 where the CPU has bf16
instructions (AMX-BF16 or AVX512-BF16) and torch's oneDNN computes bf16 on them; float32 elsewhere
(a CPU without them emulates bf16, slower than float32). Nothing is timed: the same CPU and torch
always give the same answer, however busy the machine is at start, so replicas of one deployment on
one kind of machine compute in one dtype (one K/V fingerprint: they share blocks). The choice and its
reason are logged and shown in GET /v1/models/{id}.

Earlier versions timed a turn in bf16 against fp32 at start and kept the result in
`<cache_dir>/dtype-choices.json`; a start on a busy host could measure fp32 faster and keep it for
good. That file is no longer read (nor removed: an older replica on the same cache may still use it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from server.kv.kernels import cpuinfo_field

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def choose_dtype(name: str, device: torch.device) -> DtypeChoice:
    """The dtype to load a model in on `device`: `name` from models.toml, or what `auto` picks there."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; one of auto, {', '.join(DTYPES)}")
        return DtypeChoice(DTYPES[name], "configured in models.toml")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "auto: CUDA device with bfloat16 support")
        return DtypeChoice(torch.float16, "auto: CUDA device without bfloat16 support")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"auto: float32 on {device.type}")
    flags = cpu_bf16_flags()
    if not flags:
        return DtypeChoice(torch.float32, "auto: this CPU has no bf16 instructions (AMX-BF16 or AVX512-BF16)")
    has = "+".join(flags)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return DtypeChoice(torch.float32, f"auto: the CPU has {has} but this torch's oneDNN computes no bf16 on it")
    return DtypeChoice(torch.bfloat16, f"auto: the CPU has {has} and torch's oneDNN computes bf16 with it")


def cpu_bf16_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The bf16 instruction sets this CPU reports (Linux; elsewhere none, so float32)."""
    present = set((cpuinfo_field("flags", cpuinfo) or "").split())
    return [flag for flag in BF16_FLAGS if flag in present]

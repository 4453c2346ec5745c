"""Which dtype a model computes (and keeps its K/V) in: `auto` decides per machine, by measuring.

CUDA: bfloat16 where the GPU supports it, else float16. CPU: bfloat16 only where the CPU has
bf16 instructions (AMX-BF16 or AVX512-BF16) *and* a turn's matrix products measure faster in
it than in float32 on this machine; a CPU without them emulates bf16 and is slower. The turn
measured is the model's own linear shapes (every layer plus the LM head, packed as
served) over one 256-token prefill chunk and 32 single-token decode steps. The choice and its reason are logged and
shown in GET /v1/models/{id}.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from server.kv.kernels import cpuinfo_field
from server.models.packed_linear import PackedLinear, can_pack

log = logging.getLogger("kvserve.registry")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
PREFILL_ROWS, DECODE_STEPS = 256, 32
LM_HEAD_ROWS = 8192  # the LM head is timed on this many vocabulary rows and scaled: no 2 GB copy for a big vocab
ROUNDS = 3  # measurements of each dtype, alternating; the best of each counts
BF16_MARGIN = 0.9  # bf16 must be at least 10% faster: the measurement is noisy and fp32 is exact


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def choose_dtype(name: str, device: torch.device, config: Any, memo: Path | None = None) -> DtypeChoice:
    """The dtype to load a model in; `config` (a transformers config) gives the shapes to measure.

    On a CPU the measurement is kept in `memo` (a JSON file in the model cache), keyed by the model's
    shapes, the CPU and torch: later starts on this machine reuse it, so the choice (and with it the K/V
    snapshots' fingerprint) does not flip with a noisy neighbour, and a start costs no measuring.
    """
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
    if not flags or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return DtypeChoice(torch.float32, "auto: this CPU has no bf16 instructions (AMX-BF16 or AVX512-BF16)")
    key = _memo_key(config, flags)
    remembered = _read_memo(memo, key)  # no lock: the file is only ever replaced whole
    if remembered is not None:
        return remembered
    # Replicas starting together on one cache directory: one measures while the others wait, then they take its
    # choice. No measurement is disturbed by another's on the same cores, and every replica computes in the same
    # dtype (so with the same K/V fingerprint: they share blocks).
    with _memo_lock(memo, "waiting for another process measuring bfloat16 against float32"):
        remembered = _read_memo(memo, key)
        if remembered is not None:
            return remembered
        choice = _measure(config, flags)
        _write_memo(memo, key, choice)
    return choice


def _measure(config: Any, flags: list[str]) -> DtypeChoice:
    fp32_ms = bf16_ms = float("inf")
    for _ in range(ROUNDS):  # alternating, best of each: a burst of load on the machine hits both or neither
        fp32_ms = min(fp32_ms, turn_ms(config, torch.float32))
        bf16_ms = min(bf16_ms, turn_ms(config, torch.bfloat16))
    measured = (
        f"a turn's matrix products ({PREFILL_ROWS}-token prefill + {DECODE_STEPS} decode steps) took "
        f"{bf16_ms:.0f} ms in bfloat16 vs {fp32_ms:.0f} ms in float32"
    )
    if bf16_ms < BF16_MARGIN * fp32_ms:
        return DtypeChoice(torch.bfloat16, f"auto: the CPU has {'+'.join(flags)}; {measured}")
    reason = f"auto: the CPU has {'+'.join(flags)} but bfloat16 is not faster here; {measured}"
    return DtypeChoice(torch.float32, reason)


def _memo_key(config: Any, flags: list[str]) -> str:
    text = config.get_text_config(decoder=True)
    shape = [getattr(text, f, None) for f in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")]
    shape += [getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)]
    return f"{_cpu_model()}|{os.cpu_count()} cpus|{'+'.join(flags)}|torch {torch.__version__}|{shape}"


def _cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def _read_memo(memo: Path | None, key: str) -> DtypeChoice | None:
    if memo is None:
        return None
    try:
        entry = _load_memo(memo).get(key)
    except OSError:
        return None
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        return None
    return DtypeChoice(DTYPES[entry["dtype"]], f"{entry['reason']} (measured on this machine earlier: {memo})")


def _write_memo(memo: Path | None, key: str, choice: DtypeChoice) -> None:
    """Add this entry (the caller holds `_memo_lock`: two processes measuring other models each add theirs, none
    is lost), writing a whole new file and renaming it over the old one."""
    if memo is None:
        return
    try:
        known = _load_memo(memo)
        known[key] = {"dtype": choice.name, "reason": choice.reason}
        fd, partial = tempfile.mkstemp(dir=memo.parent, prefix=memo.name, suffix=".partial")
        with os.fdopen(fd, "w") as f:
            json.dump(known, f, indent=1)
        os.replace(partial, memo)
    except OSError as exc:  # a read-only cache: measure again next start
        log.warning("could not keep the dtype measurement in %s: %s", memo, exc)


def _load_memo(memo: Path) -> dict[str, Any]:
    try:
        known = json.loads(memo.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


@contextlib.contextmanager
def _memo_lock(memo: Path | None, waiting: str) -> Iterator[None]:
    """The memo's lock, across processes (`waiting` is logged when another holds it); none without a memo or where
    the cache directory takes no file (read-only: nothing is kept there either)."""
    holder = None
    if memo is not None:
        with contextlib.suppress(OSError):
            memo.parent.mkdir(parents=True, exist_ok=True)
            holder = open(memo.with_name(memo.name + ".lock"), "a")  # noqa: SIM115 - closed below
    if holder is None:
        yield
        return
    with holder:
        try:
            fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s (%s)", waiting, memo)
            fcntl.flock(holder, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(holder, fcntl.LOCK_UN)


def cpu_bf16_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The bf16 instruction sets this CPU reports (Linux; elsewhere none, so float32)."""
    present = set((cpuinfo_field("flags", cpuinfo) or "").split())
    return [flag for flag in BF16_FLAGS if flag in present]


def turn_ms(config: Any, dtype: torch.dtype, repeats: int = 5) -> float:
    """Milliseconds of one turn's linear layers for this model's shapes in this dtype (median of `repeats`)."""
    text = config.get_text_config(decoder=True)
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    inter = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    shapes = [(heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden)]
    shapes += [(hidden, heads * head_dim), (inter, hidden), (inter, hidden), (hidden, inter)]
    vocab = int(text.vocab_size)
    head_rows = min(vocab, LM_HEAD_ROWS)
    weights = [_layer(torch.randn(shape, dtype=dtype) * 0.02) for shape in shapes]
    head = _layer(torch.randn((head_rows, hidden), dtype=dtype) * 0.02)
    layers = int(text.num_hidden_layers)

    def step(rows: int) -> float:
        # Each layer's own input width: hidden, the MLP's inner size, and heads x head_dim for the output
        # projection (Gemma-3's differs from hidden)
        inputs = {width: torch.randn((rows, width), dtype=dtype) for _, width in shapes}
        layer = _median_s(lambda: [w(inputs[width]) for w, (_, width) in zip(weights, shapes, strict=True)], repeats)
        last = torch.randn((1, hidden), dtype=dtype)  # logits of the sampled position only
        lm_head = _median_s(lambda: head(last), repeats) * vocab / head_rows
        return layers * layer + lm_head

    with torch.inference_mode():
        step(8)  # warm-up: oneDNN builds its kernels on first use
        return 1000 * (step(PREFILL_ROWS) + DECODE_STEPS * step(1))


def _layer(weight: torch.Tensor) -> nn.Module:
    """A linear layer as the server would run it: packed for oneDNN (server/models/packed_linear.py)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data = weight
    return PackedLinear(linear) if can_pack(linear, weight.device, weight.dtype) else linear


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]

"""bf16 against fp32 on this CPU, for a few models' linear layers, by the clock of your choice.

`dtype: auto` computes in bf16 on a CPU with AMX-BF16 or AVX512-BF16 (server/models/dtype.py) and times
nothing at start. This is the measurement behind that: a turn's linear layers (each layer's 7 products,
packed for oneDNN as served, times the layer count, plus the LM head; a 256-token prefill chunk and 32
single-token decode steps) in fp32 and in bf16, alternating, for each model's shapes. `--clock thread` on
`--threads 1` is the one that holds under load (the measuring thread's own CPU time); `wall`, or more threads
(whose OpenMP workers spin while a descheduled peer finishes, in CPU time too), show how a start-time timing
went wrong on a busy host. `--busy N` runs N processes spinning beside it.

    python bench/probes/dtype_cpu.py [--threads 1] [--clock thread|process|wall] [--trials 3] [--busy 0]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the source tree
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py

import torch
from common import ROOT, machine_line
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from server.models.dtype import cpu_bf16_flags
from server.models.loader import read_specs, resolve_source
from server.models.packed_linear import PackedLinear, can_pack

PREFILL_ROWS, DECODE_STEPS, REPEATS = 256, 32, 5
LM_HEAD_ROWS = 8192  # the LM head is timed on this many vocabulary rows and scaled: no 2 GB copy for a big vocab
# Other models' text configs, by their published shapes (no weights needed: the products are of random ones)
SHAPES = {
    "gemma-3-270m": dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=256, vocab_size=262144),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256),
}  # fmt: skip
CLOCKS: dict[str, Callable[[], float]] = {
    "thread": time.thread_time,
    "process": time.process_time,
    "wall": time.perf_counter,
}


def turn_ms(config: PretrainedConfig, dtype: torch.dtype, clock: Callable[[], float]) -> float:
    """Milliseconds of one turn's linear layers for this model's shapes in this dtype (each product's median of
    REPEATS calls, by `clock`)."""
    text = config.get_text_config(decoder=True)
    hidden, heads, vocab = int(text.hidden_size), int(text.num_attention_heads), int(text.vocab_size)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    inter = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    shapes = [(heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden)]
    shapes += [(hidden, heads * head_dim), (inter, hidden), (inter, hidden), (hidden, inter)]
    head_rows = min(vocab, LM_HEAD_ROWS)
    weights = [layer(torch.randn(shape, dtype=dtype) * 0.02) for shape in shapes]
    head = layer(torch.randn((head_rows, hidden), dtype=dtype) * 0.02)

    def median_s(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(REPEATS):
            start = clock()
            fn()
            times.append(clock() - start)
        return sorted(times)[len(times) // 2]

    def step(rows: int) -> float:
        inputs = {width: torch.randn((rows, width), dtype=dtype) for _, width in shapes}  # each layer's own width
        one = median_s(lambda: [w(inputs[width]) for w, (_, width) in zip(weights, shapes, strict=True)])
        last = torch.randn((1, hidden), dtype=dtype)  # logits of the sampled position only
        return int(text.num_hidden_layers) * one + median_s(lambda: head(last)) * vocab / head_rows

    with torch.inference_mode():
        step(8)  # warm-up: oneDNN builds its kernels on first use
        return 1000 * (step(PREFILL_ROWS) + DECODE_STEPS * step(1))


def layer(weight: torch.Tensor) -> nn.Module:
    """A linear layer as the server runs it: packed for oneDNN (server/models/packed_linear.py)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data = weight
    return PackedLinear(linear) if can_pack(linear, weight.device, weight.dtype) else linear


@contextlib.contextmanager
def spinning(count: int) -> Iterator[None]:
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads while timing")
    parser.add_argument("--clock", choices=list(CLOCKS), default="thread")
    parser.add_argument("--trials", type=int, default=3, help="alternating fp32, bf16 measurements per model")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning beside the measurement")
    args = parser.parse_args()
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        sys.exit("this torch's oneDNN computes no bf16 on this CPU: nothing to compare")
    torch.set_num_threads(args.threads)
    (spec,) = read_specs(ROOT / "models" / "models.toml")
    models = {spec.id: AutoConfig.from_pretrained(resolve_source(spec, ROOT / "models" / "cache"))}
    models |= {name: PretrainedConfig(**shape) for name, shape in SHAPES.items()}
    clock = CLOCKS[args.clock]
    print(f"{machine_line()}; bf16 flags: {'+'.join(cpu_bf16_flags()) or 'none'}; torch {torch.__version__}")
    print(f"{args.threads} thread(s), {args.clock} clock, {args.busy} spinning, load {os.getloadavg()[0]:.1f}")
    with spinning(args.busy):
        for name, config in models.items():
            trials = []
            for _ in range(args.trials):
                fp32 = turn_ms(config, torch.float32, clock)
                trials.append((fp32, turn_ms(config, torch.bfloat16, clock)))
            shown = "  ".join(f"{bf16 / fp32:.2f} ({bf16:.0f} / {fp32:.0f} ms)" for fp32, bf16 in trials)
            print(f"{name:22} bf16 / fp32: {shown}", flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

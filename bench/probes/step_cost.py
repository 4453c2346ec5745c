"""Cost of one engine step on the default model, in-process, by what the model runner is built from.

One packed decode step of N sequences at a context of C tokens, and one prefill chunk, under:
fp32 / bf16 / bf16 with packed linears (server/models/packed_linear.py), and with decode rows
attended to one SDPA call per sequence vs one paged-kernel call per layer (server/kv/csrc).
Also where a batch-1 decode step's time goes (torch profiler, by operator). Medians of
repeated steps, side by side in one run.

    python bench/probes/step_cost.py [--context 1500] [--repeats 15]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the source tree
from server.kv import kernels
from server.kv.attention import DecodeRows, SeqSpan, StepMeta, install, stepping
from server.kv.pool import KVLayout, KVPool
from server.models.loader import read_specs, resolve_source
from server.models.packed_linear import pack_linears

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16
STEP = "step"  # the kwargs' StepMeta, set around the forward (server.kv.attention.stepping)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[repeats // 2]


def forward(model, kwargs: dict):
    with stepping(kwargs[STEP]):
        return model(**{k: v for k, v in kwargs.items() if k != STEP})


def step_ms(model, kwargs: dict, repeats: int) -> float:
    return median_ms(lambda: forward(model, kwargs), repeats)


def load(where: str, variant: str):
    dtype = torch.float32 if variant == "fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype).eval()
    if variant == "bf16-packed":
        pack_linears(model, dtype)
    install(model)
    return model, dtype


def decode_step(model, pool: KVPool, num: int, context: int, use_kernel: bool) -> dict:
    """Forward kwargs for one decode step of `num` sequences, each with `context` tokens before its new one."""
    stride = -(-(context + 1) // BLOCK) * BLOCK
    spans = [SeqSpan(i, 1, context + 1, None, i * stride, pool.device) for i in range(num)]
    meta = StepMeta(pool, torch.tensor([i * stride + context for i in range(num)]), [] if use_kernel else spans)
    if use_kernel:
        tables = [[i * stride // BLOCK + j for j in range(stride // BLOCK)] for i in range(num)]
        meta.decode = DecodeRows(
            torch.arange(num, dtype=torch.int32),
            torch.tensor(tables, dtype=torch.int32),
            torch.full((num,), context + 1, dtype=torch.int32),
        )
    return {
        "input_ids": torch.full((1, num), 5),
        "position_ids": torch.full((1, num), context),
        "use_cache": False,
        "logits_to_keep": torch.arange(num),
        STEP: meta,
    }


def prefill_chunk(pool: KVPool, length: int) -> dict:
    meta = StepMeta(pool, torch.arange(length), [SeqSpan(0, length, length, None, 0, pool.device)])
    return {
        "input_ids": torch.full((1, length), 5),
        "position_ids": torch.arange(length)[None],
        "use_cache": False,
        "logits_to_keep": torch.tensor([length - 1]),
        STEP: meta,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk length")
    parser.add_argument("--profile", action="store_true", help="also print the batch-1 step's operators")
    args = parser.parse_args()
    where = resolve_source(read_specs(ROOT / "models" / "models.toml")[0], ROOT / "models" / "cache")
    has_kernel = kernels.paged_decode_available()
    torch.set_grad_enabled(False)
    print(f"context {args.context}, {torch.get_num_threads()} threads; ms per step (median of {args.repeats})")
    print(f"{'variant':<12} {'attention':<8} " + " ".join(f"{f'decode x{n}':>10}" for n in args.batches), end="")
    print(f" {f'prefill {args.chunk}':>12}")
    for variant in ("fp32", "bf16", "bf16-packed"):
        model, dtype = load(where, variant)
        num_blocks = max(args.batches) * (-(-(args.context + 1) // BLOCK)) + args.chunk // BLOCK + 1
        pool = KVPool(KVLayout.of(model.config, dtype), num_blocks, BLOCK, torch.device("cpu"))
        for tensor in pool.k + pool.v:
            tensor.normal_()
        for path in ("sdpa", "kernel") if has_kernel else ("sdpa",):
            row = [
                step_ms(model, decode_step(model, pool, n, args.context, path == "kernel"), args.repeats)
                for n in args.batches
            ]
            chunk = step_ms(model, prefill_chunk(pool, args.chunk), max(3, args.repeats // 3))
            print(f"{variant:<12} {path:<8} " + " ".join(f"{ms:10.1f}" for ms in row) + f" {chunk:12.1f}")
        if args.profile:
            profile(model, decode_step(model, pool, 1, args.context, has_kernel), variant)


def profile(model, kwargs: dict, variant: str) -> None:
    from torch.profiler import profile as torch_profile

    forward(model, kwargs)
    with torch_profile() as prof:
        for _ in range(5):
            forward(model, kwargs)
    print(f"-- {variant}: batch-1 decode step, 5 steps, by operator (self CPU time)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()

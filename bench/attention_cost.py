"""Decode-row attention for one layer of the default model's shape: one SDPA call per sequence vs one call of the
paged kernel for all of them, by context length and batch (in-process, best of repeated calls).

This is what sets `KERNEL_MAX_CONTEXT` in server/engine/model_runner.py: the kernel saves SDPA's per-call cost,
SDPA's flash kernel streams a long context faster.

    python bench/attention_cost.py [--contexts 128,256,384,512,1024,1500] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from server.kv import kernels

KV_HEADS, HEADS, DIM, BLOCK = 3, 9, 64, 16  # SmolLM2-135M


def best_us(fn, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * min(times)


def compare(context: int, batch: int, dtype: torch.dtype) -> tuple[float, float]:
    stride = -(-context // BLOCK) * BLOCK + BLOCK
    k_pool = torch.randn(KV_HEADS, batch * stride, DIM, dtype=dtype)
    v_pool = torch.randn(KV_HEADS, batch * stride, DIM, dtype=dtype)
    query = torch.randn(1, HEADS, batch, DIM, dtype=dtype)
    out = torch.empty(batch, HEADS, DIM, dtype=dtype)

    def per_sequence() -> None:
        for i in range(batch):
            k = k_pool[:, i * stride : i * stride + context].unsqueeze(0)
            v = v_pool[:, i * stride : i * stride + context].unsqueeze(0)
            o = F.scaled_dot_product_attention(query[:, :, i : i + 1], k, v, scale=DIM**-0.5, enable_gqa=True)
            out[i : i + 1] = o[0].transpose(0, 1)

    tables = torch.tensor([[i * stride // BLOCK + j for j in range(stride // BLOCK)] for i in range(batch)])
    rows, lens = torch.arange(batch, dtype=torch.int32), torch.full((batch,), context, dtype=torch.int32)

    def kernel() -> None:
        torch.ops.kvserve.paged_decode(
            query[0].transpose(0, 1), k_pool, v_pool, out, rows, tables.int(), lens, BLOCK, 0, DIM**-0.5, 0.0
        )

    return best_us(per_sequence), best_us(kernel)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[128, 256, 384, 512, 1024, 1500]
    )
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    args = parser.parse_args()
    if not kernels.paged_decode_available():
        raise SystemExit(f"the paged kernel is not available: {kernels.unavailable_reason()}")
    torch.set_grad_enabled(False)
    print(f"one layer, {torch.get_num_threads()} threads, microseconds (best of 30)")
    print(f"{'dtype':<9} {'context':>7} {'batch':>5} {'SDPA per seq':>13} {'kernel':>8} {'kernel/SDPA':>12}")
    for dtype in (torch.float32, torch.bfloat16):
        for context in args.contexts:
            for batch in args.batches:
                sdpa, kernel = compare(context, batch, dtype)
                name = str(dtype).removeprefix("torch.")
                print(f"{name:<9} {context:7d} {batch:5d} {sdpa:13.0f} {kernel:8.0f} {kernel / sdpa:12.2f}")


if __name__ == "__main__":
    main()

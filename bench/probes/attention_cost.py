"""Decode-row attention for one layer of the default model's shape: one SDPA call per sequence vs one call of the
paged kernel for all of them, by context length and batch (in-process, best of repeated calls).

This is what sets `KERNEL_MAX_CONTEXT` in server/kv/backends.py: the kernel saves SDPA's per-call cost,
which is most of a short row's time. Which is faster for a long row depends on the CPU (the runner times it at
start: server/kv/routing.py).

The second table is cascade attention for long decode rows that share a head (a cached system prompt, one run of
blocks) and have scattered tails of their own: per-row SDPA on gathered slots (what such rows cost without
heads), the kernel on each whole row, and the head in one flash call for all rows plus the kernel on the tails.

The third table is a prefill chunk: SDPA on a view of the pool with the causal mask (one call per chunk) against
the paged prefill kernel (bf16, AVX512-BF16), by chunk length and the keys the chunk ends at.

    python bench/probes/attention_cost.py [--contexts 128,256,384,512,1024,1500] [--batches 1,8] [--head 1504]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the source tree
from server.kv import kernels
from server.kv.attention import SeqSpan, SharedHead, attend, flash_heads

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
            query[0].transpose(0, 1),
            k_pool,
            v_pool,
            out,
            rows,
            tables.int(),
            lens,
            *[torch.empty(0)] * 3,
            BLOCK,
            0,
            DIM**-0.5,
            0.0,
        )

    return best_us(per_sequence), best_us(kernel)


def cascade(batch: int, head: int, tail: int, dtype: torch.dtype) -> tuple[float, float, float]:
    """Rows sharing `head` keys (one run of blocks) with `tail` keys each in scattered blocks: us per layer."""
    num_blocks = 4096
    k_pool = torch.randn(KV_HEADS, num_blocks * BLOCK, DIM, dtype=dtype)
    v_pool = torch.randn(KV_HEADS, num_blocks * BLOCK, DIM, dtype=dtype)
    query = torch.randn(1, HEADS, batch, DIM, dtype=dtype)
    out = torch.empty(batch, HEADS, DIM, dtype=dtype)
    shared = list(range(10, 10 + head // BLOCK))
    own = -(-tail // BLOCK) + 1
    scattered = (torch.randperm(num_blocks - 200, generator=torch.Generator().manual_seed(0)) + 200).tolist()
    tables = [shared + scattered[i * own : (i + 1) * own] for i in range(batch)]
    context = head + tail
    slots = [torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)]) for t in tables]
    rows, lens = torch.arange(batch, dtype=torch.int32), torch.full((batch,), context, dtype=torch.int32)
    table = torch.tensor(tables, dtype=torch.int32)
    empty, scale = torch.empty(0), DIM**-0.5

    def gathered_sdpa() -> None:
        for i in range(batch):
            k, v = k_pool.index_select(1, slots[i]), v_pool.index_select(1, slots[i])
            o = F.scaled_dot_product_attention(query[:, :, i : i + 1], k[None], v[None], scale=scale, enable_gqa=True)
            out[i : i + 1] = o[0].transpose(0, 1)

    def kernel(first_keys: torch.Tensor, head_out: torch.Tensor, head_lse: torch.Tensor) -> None:
        torch.ops.kvserve.paged_decode(
            query[0].transpose(0, 1), k_pool, v_pool, out, rows, table, lens, first_keys, head_out, head_lse,
            BLOCK, 0, scale, 0.0,
        )  # fmt: skip

    heads = [SharedHead(torch.arange(batch), head, shared[0] * BLOCK, None)]
    first_keys = torch.full((batch,), head, dtype=torch.int32)

    def with_head() -> None:
        kernel(first_keys, *flash_heads(query, k_pool, v_pool, heads, scale))

    return best_us(gathered_sdpa), best_us(lambda: kernel(empty, empty, empty)), best_us(with_head)


def prefill(chunk: int, context: int) -> tuple[float, float]:
    """One chunk of `chunk` tokens ending at key `context`, bf16, blocks in one run: SDPA with the mask, the kernel."""
    dtype = torch.bfloat16
    blocks = -(-context // BLOCK)
    k_pool = torch.randn(KV_HEADS, blocks * BLOCK, DIM, dtype=dtype)
    v_pool = torch.randn(KV_HEADS, blocks * BLOCK, DIM, dtype=dtype)
    query = torch.randn(1, HEADS, chunk, DIM, dtype=dtype)
    out = torch.empty(chunk, HEADS, DIM, dtype=dtype)
    span = SeqSpan(0, chunk, context, None, 0, torch.device("cpu"))
    mask = span.mask(None)

    def int32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    starts, lens, ctxs, table = int32([0]), int32([chunk]), int32([context]), int32(list(range(blocks)))[None]

    def sdpa() -> None:
        attend(query, k_pool[None, :, :context], v_pool[None, :, :context], mask, DIM**-0.5, None)

    def kernel() -> None:
        q = query[0].transpose(0, 1)
        torch.ops.kvserve.paged_prefill(q, k_pool, v_pool, out, starts, lens, ctxs, table, BLOCK, DIM**-0.5)

    return best_us(sdpa, 10), best_us(kernel, 10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[128, 256, 384, 512, 1024, 1500]
    )
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--head", type=int, default=1504, help="shared keys of the cascade table")
    parser.add_argument("--tails", type=lambda s: [int(x) for x in s.split(",")], default=[96, 304])
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
    print(f"\ncascade: {args.head} shared keys (one run) + each row's own tail (scattered blocks)")
    print(f"{'dtype':<9} {'tail':>5} {'batch':>5} {'SDPA gathered':>14} {'kernel whole':>13} {'head+kernel':>12}")
    for dtype in (torch.float32, torch.bfloat16):
        for tail in args.tails:
            for batch in sorted({1, 4, *args.batches}):
                sdpa, whole, split = cascade(batch, args.head, tail, dtype)
                name = str(dtype).removeprefix("torch.")
                print(f"{name:<9} {tail:5d} {batch:5d} {sdpa:14.0f} {whole:13.0f} {split:12.0f}")
    if not kernels.paged_prefill_available(torch.bfloat16, DIM):
        print("\nno paged prefill kernel here (it needs AVX512-BF16): prefill chunks are SDPA calls")
        return
    print("\nprefill chunk, bf16, one layer: SDPA on a view with the causal mask vs the paged prefill kernel")
    print(f"{'chunk':>5} {'ends at key':>11} {'SDPA':>8} {'kernel':>8} {'kernel/SDPA':>12}")
    for chunk, context in ((256, 256), (256, 1024), (256, 1536), (512, 1536), (1024, 1024), (1024, 2048)):
        sdpa, kernel = prefill(chunk, context)
        print(f"{chunk:5d} {context:11d} {sdpa:8.0f} {kernel:8.0f} {kernel / sdpa:12.2f}")


if __name__ == "__main__":
    main()

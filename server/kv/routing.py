"""How decode rows and prefill chunks attend where there is a choice, chosen by timing the ways at start.

A decode row longer than the kernel's short-row limit that shares no head with another row can be
attended three ways: by the paged kernel whole, by SDPA on a view of the pool (when its blocks are
one run), or as a head (torch's CPU flash attention over its leading run of blocks, returning the
log-sum-exp) that the kernel resumes. Which is fastest depends on the CPU and the dtype, and not by
a little: SDPA's one-query path in bf16 is 7x slower than the kernel on an AVX512-BF16 EPYC without
AMX, and 1.8x faster on an AMX Xeon (bench/probes/attention_cost.py). So the runner times each, once, on
a representative context in the pool's own dtype and head shapes, and routes lone rows by the
fastest. The answer is the same either way up to rounding; only the time differs.

Prefill chunks likewise: the paged prefill kernel (bf16, AVX512-BF16) against SDPA on a view of
the pool with the causal mask, one chunk of PROBE_CHUNK tokens ending at key PROBE_CONTEXT.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from server.kv.attention import SeqSpan, SharedHead, attend, flash_heads
from server.kv.pool import KVPool

KERNEL, SDPA, HEAD = "kernel", "sdpa", "head"
PROBE_CONTEXT = 1024  # keys of the timed row: long enough that streaming them is most of the time
PROBE_CHUNK = 256  # tokens of the timed prefill chunk (the default step's token budget)
REPEATS = 15
PREFILL_REPEATS = 5  # a chunk takes milliseconds


@dataclass(frozen=True, slots=True)
class LoneRowRoute:
    way: str  # KERNEL, SDPA or HEAD
    times_us: dict[str, float]  # best of REPEATS per way

    @property
    def describe(self) -> str:
        timed = ", ".join(f"{way} {us:.0f} us" for way, us in self.times_us.items())
        return f"lone long decode rows take the {self.way} ({timed} per layer at {PROBE_CONTEXT} keys)"


def time_lone_row(pool: KVPool, num_heads: int) -> LoneRowRoute:
    """Times one decode row of PROBE_CONTEXT keys in layer 0 of `pool` (whose blocks must be free: it writes them)."""
    bs = pool.block_size
    context, num_blocks, k_pool, v_pool = _probe_blocks(pool)
    device, dim = k_pool.device, k_pool.shape[-1]
    query = torch.randn(1, num_heads, 1, dim, dtype=k_pool.dtype, device=device)
    out = query.new_empty((1, num_heads, dim))
    scale = dim**-0.5

    def int32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    rows, table, lens = int32([0]), int32(list(range(num_blocks)))[None], int32([context])
    head_len = (context - 1) // bs * bs
    head = SharedHead(torch.zeros(1, dtype=torch.long, device=device), head_len, 0, None)
    empty = torch.empty(0)

    def kernel(first_keys: torch.Tensor, head_out: torch.Tensor, head_lse: torch.Tensor) -> None:
        q = query[0].transpose(0, 1)
        torch.ops.kvserve.paged_decode(
            q, k_pool, v_pool, out, rows, table, lens, first_keys, head_out, head_lse, bs, 0, scale, 0.0
        )

    def with_head() -> None:
        head_out, head_lse = flash_heads(query, k_pool, v_pool, [head], scale)
        kernel(int32([head_len]), head_out, head_lse)

    ways: dict[str, Callable[[], object]] = {
        KERNEL: lambda: kernel(empty, empty, empty),
        SDPA: lambda: attend(query, k_pool[None, :, :context], v_pool[None, :, :context], None, scale, None),
    }
    if head_len > 0:
        ways[HEAD] = with_head
    times = {way: _best_us(fn) for way, fn in ways.items()}
    return LoneRowRoute(min(times, key=times.__getitem__), times)


@dataclass(frozen=True, slots=True)
class PrefillRoute:
    way: str  # KERNEL or SDPA
    times_us: dict[str, float]

    @property
    def describe(self) -> str:
        timed = ", ".join(f"{way} {us:.0f} us" for way, us in self.times_us.items())
        chunk = f"{PROBE_CHUNK} tokens ending at key {PROBE_CONTEXT}"
        return f"prefill chunks take the {self.way} ({timed} per layer for a chunk of {chunk})"


def time_prefill(pool: KVPool, num_heads: int) -> PrefillRoute:
    """Times one prefill chunk in layer 0 of `pool` (whose blocks must be free: it writes them) both ways."""
    bs = pool.block_size
    context, num_blocks, k_pool, v_pool = _probe_blocks(pool)
    chunk = min(PROBE_CHUNK, context)
    device, dim = k_pool.device, k_pool.shape[-1]
    query = torch.randn(1, num_heads, chunk, dim, dtype=k_pool.dtype, device=device)
    out = query.new_empty((chunk, num_heads, dim))
    scale = dim**-0.5
    span = SeqSpan(0, chunk, context, None, 0, device)

    def int32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    starts, lens, ctxs, table = int32([0]), int32([chunk]), int32([context]), int32(list(range(num_blocks)))[None]

    def kernel() -> None:
        q = query[0].transpose(0, 1)
        torch.ops.kvserve.paged_prefill(q, k_pool, v_pool, out, starts, lens, ctxs, table, bs, scale)

    def sdpa() -> torch.Tensor:
        return attend(query, k_pool[None, :, :context], v_pool[None, :, :context], span.mask(None), scale, None)

    times = {KERNEL: _best_us(kernel, PREFILL_REPEATS), SDPA: _best_us(sdpa, PREFILL_REPEATS)}
    return PrefillRoute(min(times, key=times.__getitem__), times)


def _probe_blocks(pool: KVPool) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """The probe's keys (PROBE_CONTEXT, or what the pool holds) in layer 0's first blocks, filled with noise:
    (keys, blocks, k_pool, v_pool)."""
    bs = pool.block_size
    context = min(PROBE_CONTEXT, pool.num_blocks * bs)
    num_blocks = -(-context // bs)
    k_pool, v_pool = pool.k[0], pool.v[0]
    k_pool[:, : num_blocks * bs].normal_()
    v_pool[:, : num_blocks * bs].normal_()
    return context, num_blocks, k_pool, v_pool


def _best_us(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    with torch.inference_mode():
        fn()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
    return best * 1e6

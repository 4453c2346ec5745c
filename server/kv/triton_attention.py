"""Triton kernels over the paged pool: the GPU's attention (the Triton backend, server/kv/backends.py).

The pool is per layer [kv_heads, slots, row] (server/kv/pool.py): a token's slot is its block's id times the
block size plus its offset, found through the sequence's block table for every key a kernel reads, so blocks
may lie anywhere and be of any size. A quantized pool's row is head_dim one-byte values (int8 or fp8 e4m3)
and their float32 scale in the last four bytes: the kernels read the scale through a float32 view of the same
storage and dequantize as they load (to the compute dtype, as `KVPool.read` does).

- `store_kv`: a step's new K/V into their slots (quantized in the kernel for an 8-bit pool; a slot < 0 is
  skipped: the padding rows of a captured CUDA graph).
- `decode`: one query row per sequence. A program takes one kv head's group of query heads (GQA: the group's
  rows are one tile of the products) over one split of the row's keys; a split is SPLIT_KEYS keys, fixed, so
  a long context spreads over many programs, and a second kernel merges a row's splits in order (their
  maxima and sums, as flash decoding does). The split never depends on the batch, so a row's result is
  the same whatever rows share its step: the deterministic mode's attention on CUDA.
- `prefill`: chunks of a sequence's tokens (a prompt's chunk, or a turn's new tokens after its cached
  K/V): a program takes BLOCK_M of a chunk's queries for one query head, walks the chunk's earlier K/V in
  place in the pool and its own keys causally (the step's K/V are written before attention runs).

Both honour a layer's sliding window (a key is visible when query_pos - key_pos < window) and Gemma-2's logit
softcap (cap * tanh(score / cap)). Without CUDA the kernels run on CPU tensors under `TRITON_INTERPRET=1`
(set before triton is imported): the tests check them there against float64 attention.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from server.kv.pool import SCALE_BYTES, KVLayout, KVPool

SPLIT_KEYS = 256  # keys a decode program walks: a row of n keys takes ceil(n / SPLIT_KEYS) programs per kv head
BLOCK_N = 32  # keys per tile
PREFILL_BLOCK_M = 16  # a prefill program's queries
_MIN_DOT = 16  # a decode program's query rows at least (one tensor-core tile's M): a GQA group is padded to it
_LARGEST = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def _dot_f32(dtype: torch.dtype) -> bool:
    """The products in fp32 (exact for 16-bit inputs, sums in fp32 as a 16-bit MMA's): for fp32 and fp64 models
    (no tf32), and under the interpreter, whose tl.dot reads bf16 as integers."""
    return dtype in (torch.float32, torch.float64) or os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Each launcher's constexprs come from one of these, and tests/kv/triton_sm90.py compiles what they return for the
# device's shapes: the compile check cannot drift from what the launchers pass.
Config = dict[str, int | float | bool]


def store_config(dim: int, pool_dtype: torch.dtype, quantized: bool) -> Config:
    """`_store_kv_kernel`'s constexprs for rows of `dim` values into a pool of `pool_dtype`."""
    largest = _LARGEST.get(pool_dtype, 1.0)
    return {
        "D": dim,
        "BLOCK_D": _pow2(dim),
        "QUANT": quantized,
        "IS_INT8": pool_dtype == torch.int8,
        "LARGEST": largest,
    }


def decode_config(
    num_heads: int, kv_heads: int, dim: int, dtype: torch.dtype, quantized: bool, windowed: bool, softcapped: bool
) -> Config:
    """`_decode_split_kernel`'s constexprs. A program's query rows are one kv head's GQA group, padded to _MIN_DOT
    rows (masked). Triton's compiler does not ask for it: its NVIDIA backend takes a tl.dot of fewer rows (M >= 1;
    only K has a floor, 16 for 16-bit operands) and pads them itself."""
    group = num_heads // kv_heads
    return {
        "GROUP": group,
        "BLOCK_G": max(_MIN_DOT, _pow2(group)),
        "D": dim,
        "BLOCK_D": _pow2(dim),
        "BLOCK_N": BLOCK_N,
        "SPLIT": SPLIT_KEYS,
        "QUANT": quantized,
        "SOFTCAP": softcapped,
        "WINDOW": windowed,
        "DOT_F32": _dot_f32(dtype),
    }


def merge_config(dim: int) -> Config:
    """`_decode_merge_kernel`'s constexprs."""
    return {"D": dim, "BLOCK_D": _pow2(dim), "SPLIT": SPLIT_KEYS}


def prefill_config(
    num_heads: int, kv_heads: int, dim: int, dtype: torch.dtype, quantized: bool, windowed: bool, softcapped: bool
) -> Config:
    """`_prefill_kernel`'s constexprs (a program takes PREFILL_BLOCK_M queries of one query head: no padding)."""
    return {
        "GROUP": num_heads // kv_heads,
        "D": dim,
        "BLOCK_D": _pow2(dim),
        "BLOCK_M": PREFILL_BLOCK_M,
        "BLOCK_N": BLOCK_N,
        "QUANT": quantized,
        "SOFTCAP": softcapped,
        "WINDOW": windowed,
        "DOT_F32": _dot_f32(dtype),
    }


@triton.jit
def _round_half_even(x):
    """torch.round's rounding (ties to even), in arithmetic the interpreter also runs."""
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(odd, f + 1.0, f)))


@triton.jit
def _round_e4m3(y):
    """y (fp32, |y| <= 448) rounded to fp8 e4m3's grid, ties to even, so the cast after it is exact: the
    interpreter's own fp8 cast mishandles a mantissa that rounds up into the next binade."""
    exponent = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased
    ulp_exp = tl.maximum(exponent - 127, -6) - 3  # 3 mantissa bits; below 2^-6 subnormals, 2^-9 apart
    ulp = ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)
    return _round_half_even(y / ulp) * ulp


@triton.jit
def _tanh(x):
    t = tl.exp(-2.0 * tl.abs(x))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -r, r)


@triton.jit
def _store_row(
    src, pool, scales, at, dst, scale_at, dmask, QUANT: tl.constexpr, IS_INT8: tl.constexpr, LARGEST: tl.constexpr
):
    x = tl.load(src + at, mask=dmask, other=0.0)
    if QUANT:
        xf = x.to(tl.float32)
        scale = tl.max(tl.abs(xf), axis=0) / LARGEST
        inv = tl.where(scale > 0, 1.0 / scale, 0.0)
        y = tl.minimum(tl.maximum(xf * inv, -LARGEST), LARGEST)
        y = _round_half_even(y) if IS_INT8 else _round_e4m3(y)
        tl.store(pool + dst, y.to(pool.dtype.element_ty), mask=dmask)
        tl.store(scales + scale_at, scale)
    else:
        tl.store(pool + dst, x.to(pool.dtype.element_ty), mask=dmask)


@triton.jit
def _store_kv_kernel(
    key,
    value,
    k_pool,
    v_pool,
    k_scales,
    v_scales,
    slots,
    stride_k_h,
    stride_k_t,
    stride_k_d,
    stride_v_h,
    stride_v_t,
    stride_v_d,
    stride_pool_h,
    stride_pool_s,
    stride_scale_h,
    stride_scale_s,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    IS_INT8: tl.constexpr,
    LARGEST: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        dst = h * stride_pool_h + slot * stride_pool_s + d
        scale_at = h * stride_scale_h + slot * stride_scale_s + D // 4
        k_at = h * stride_k_h + t * stride_k_t + d * stride_k_d
        _store_row(key, k_pool, k_scales, k_at, dst, scale_at, dmask, QUANT, IS_INT8, LARGEST)
        v_at = h * stride_v_h + t * stride_v_t + d * stride_v_d
        _store_row(value, v_pool, v_scales, v_at, dst, scale_at, dmask, QUANT, IS_INT8, LARGEST)


@triton.jit
def _load_rows(
    pool,
    scales,
    h,
    slots,
    valid,
    d,
    dmask,
    stride_pool_h,
    stride_pool_s,
    stride_scale_h,
    stride_scale_s,
    D: tl.constexpr,
    QUANT: tl.constexpr,
    like,
):
    """[BLOCK_N, BLOCK_D] rows of these slots (masked ones 0), dequantized for an 8-bit pool, in `like`'s dtype."""
    rows = tl.load(
        pool + h * stride_pool_h + slots[:, None] * stride_pool_s + d[None, :],
        mask=valid[:, None] & dmask[None, :],
        other=0.0,
    )
    if QUANT:
        scale = tl.load(scales + h * stride_scale_h + slots * stride_scale_s + D // 4, mask=valid, other=0.0)
        return (rows.to(tl.float32) * scale[:, None]).to(like.dtype)
    return rows.to(like.dtype)


@triton.jit
def _attend_tile(
    q,
    k_pool,
    v_pool,
    k_scales,
    v_scales,
    kvh,
    table,
    pos,
    valid,
    visible,
    block_size,
    d,
    dmask,
    stride_pool_h,
    stride_pool_s,
    stride_scale_h,
    stride_scale_s,
    scale,
    softcap,
    run_max,
    run_sum,
    acc,
    D: tl.constexpr,
    QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """One tile of keys at positions `pos` (`valid` ones in the row's table) for the query rows q [M, BLOCK_D]:
    their scores (softcapped), the keys each row may not see (`visible` false) masked, and the online softmax's
    running max, sum and weighted values [M, BLOCK_D] carried over it. The walk of decode and prefill alike."""
    block = tl.load(table + pos // block_size, mask=valid, other=0).to(tl.int64)
    slots = block * block_size + pos % block_size
    k = _load_rows(k_pool, k_scales, kvh, slots, valid, d, dmask, stride_pool_h, stride_pool_s, stride_scale_h,
                   stride_scale_s, D, QUANT, q)  # fmt: skip
    if DOT_F32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    s = tl.where(visible, s, float("-inf"))
    new_max = tl.maximum(run_max, tl.max(s, axis=1))
    safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that saw no key yet: no NaN
    alpha = tl.exp(run_max - safe)
    p = tl.exp(s - safe[:, None])
    v = _load_rows(v_pool, v_scales, kvh, slots, valid, d, dmask, stride_pool_h, stride_pool_s, stride_scale_h,
                   stride_scale_s, D, QUANT, q)  # fmt: skip
    if DOT_F32:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return new_max, run_sum * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _decode_split_kernel(
    query,
    k_pool,
    v_pool,
    k_scales,
    v_scales,
    acc_out,
    max_out,
    sum_out,
    rows,
    tables,
    lens,
    stride_q_t,
    stride_q_h,
    stride_table,
    stride_pool_h,
    stride_pool_s,
    stride_scale_h,
    stride_scale_s,
    stride_acc_b,
    stride_acc_h,
    stride_acc_s,
    stride_ms_b,
    stride_ms_h,
    scale,
    softcap,
    window,
    block_size,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens + b)
    row = tl.load(rows + b).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(
        query + row * stride_q_t + heads[:, None] * stride_q_h + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )
    lo = 0
    if WINDOW:
        lo = tl.maximum(ctx - window, 0)
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, ctx)
    first = tl.maximum(start, lo)
    run_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n in range(first, end, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        valid = pos < end
        run_max, run_sum, acc = _attend_tile(
            q, k_pool, v_pool, k_scales, v_scales, kvh, tables + b * stride_table, pos, valid, valid[None, :],
            block_size, d, dmask, stride_pool_h, stride_pool_s, stride_scale_h, stride_scale_s, scale, softcap,
            run_max, run_sum, acc, D, QUANT, SOFTCAP, DOT_F32,
        )  # fmt: skip
    at = b * stride_acc_b + heads * stride_acc_h + split * stride_acc_s
    tl.store(acc_out + at[:, None] + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
    ms = b * stride_ms_b + heads * stride_ms_h + split
    tl.store(max_out + ms, run_max, mask=gmask)
    tl.store(sum_out + ms, run_sum, mask=gmask)


@triton.jit
def _decode_merge_kernel(
    out,
    acc_in,
    max_in,
    sum_in,
    rows,
    lens,
    stride_o_t,
    stride_o_h,
    stride_acc_b,
    stride_acc_h,
    stride_acc_s,
    stride_ms_b,
    stride_ms_h,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(lens + b)
    row = tl.load(rows + b).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    splits = tl.cdiv(ctx, SPLIT)
    total_max = tl.full([], float("-inf"), tl.float32)
    for s in range(0, splits):
        total_max = tl.maximum(total_max, tl.load(max_in + b * stride_ms_b + h * stride_ms_h + s))
    safe = tl.where(total_max == float("-inf"), 0.0, total_max)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, splits):  # in order: the same sum whatever else the step holds
        weight = tl.exp(tl.load(max_in + b * stride_ms_b + h * stride_ms_h + s) - safe)
        total += tl.load(sum_in + b * stride_ms_b + h * stride_ms_h + s) * weight
        part = tl.load(acc_in + b * stride_acc_b + h * stride_acc_h + s * stride_acc_s + d, mask=dmask, other=0.0)
        acc += part * weight
    result = acc / tl.where(total > 0, total, 1.0)  # a padding row (no keys): 0
    tl.store(out + row * stride_o_t + h * stride_o_h + d, result.to(out.dtype.element_ty), mask=dmask)


@triton.jit
def _prefill_kernel(
    query,
    k_pool,
    v_pool,
    k_scales,
    v_scales,
    out,
    tiles,
    q_starts,
    q_lens,
    ctx_lens,
    tables,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_table,
    stride_pool_h,
    stride_pool_s,
    stride_scale_h,
    stride_scale_s,
    scale,
    softcap,
    window,
    block_size,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    c = tl.load(tiles + 2 * tile)
    m0 = tl.load(tiles + 2 * tile + 1)
    q_start = tl.load(q_starts + c)
    q_len = tl.load(q_lens + c)
    ctx = tl.load(ctx_lens + c)
    m = m0 + tl.arange(0, BLOCK_M)
    mmask = m < q_len
    qpos = ctx - q_len + m  # each query's position
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    at = (q_start + m).to(tl.int64)
    q = tl.load(
        query + at[:, None] * stride_q_t + h * stride_q_h + d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0
    )
    first_pos = ctx - q_len + m0
    lo = 0
    if WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    hi = tl.minimum(ctx, first_pos + BLOCK_M)  # past the tile's last query: nothing it sees
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n in range(lo, hi, BLOCK_N):
        pos = n + tl.arange(0, BLOCK_N)
        valid = pos < hi
        visible = valid[None, :] & (pos[None, :] <= qpos[:, None])
        if WINDOW:
            visible = visible & (pos[None, :] > qpos[:, None] - window)
        run_max, run_sum, acc = _attend_tile(
            q, k_pool, v_pool, k_scales, v_scales, kvh, tables + c * stride_table, pos, valid, visible,
            block_size, d, dmask, stride_pool_h, stride_pool_s, stride_scale_h, stride_scale_s, scale, softcap,
            run_max, run_sum, acc, D, QUANT, SOFTCAP, DOT_F32,
        )  # fmt: skip
    result = acc / tl.where(run_sum > 0, run_sum, 1.0)[:, None]  # masked rows: 0
    tl.store(
        out + at[:, None] * stride_o_t + h * stride_o_h + d[None, :],
        result.to(out.dtype.element_ty),
        mask=mmask[:, None] & dmask[None, :],
    )


# -- launchers --------------------------------------------------------------------------------------------------
def _scales(pool: torch.Tensor, quantized: bool) -> tuple[torch.Tensor, int, int]:
    """A quantized pool layer's float32 view (its rows' scales at column head_dim / 4) and its strides; else the
    pool itself (never read)."""
    if not quantized:
        return pool, 0, 0
    view = pool.view(torch.uint8).view(torch.float32)
    return view, view.stride(0), view.stride(1)


def store_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    quantized: bool,
) -> None:
    """key/value [kv_heads, T, D] (the compute dtype, any strides) into these slots of one layer's pools; slots
    [T] (int32 or int64; < 0: skipped)."""
    num_heads, num_tokens, dim = key.shape
    if num_tokens == 0:
        return
    k_scales, ssh, sss = _scales(k_pool, quantized)
    v_scales, _, _ = _scales(v_pool, quantized)
    if quantized:
        assert dim % 4 == 0
        assert k_pool.shape[2] == dim + SCALE_BYTES
    _store_kv_kernel[(num_tokens, num_heads)](
        key,
        value,
        k_pool,
        v_pool,
        k_scales,
        v_scales,
        slots,
        *key.stride(),
        *value.stride(),
        k_pool.stride(0),
        k_pool.stride(1),
        ssh,
        sss,
        **store_config(dim, k_pool.dtype, quantized),
    )


def decode_workspace(
    num_rows: int, num_heads: int, dim: int, max_keys: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split kernel's partial results for rows of up to `max_keys` keys: acc [B, H, S, D], max and sum
    [B, H, S] (float32); one per step, shared by its layers."""
    splits = max(1, -(-max_keys // SPLIT_KEYS))
    acc = torch.empty((num_rows, num_heads, splits, dim), dtype=torch.float32, device=device)
    run_max = torch.empty((num_rows, num_heads, splits), dtype=torch.float32, device=device)
    return acc, run_max, torch.empty_like(run_max)


def decode(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    quantized: bool = False,
) -> None:
    """Rows of one query each: query [T, H, D] (a view of the packed step), out [T, H, D]; rows [B] their index in
    it, tables [B, W] their blocks, lens [B] their keys (their own token last; 0: a padding row, out zero).
    `workspace` from `decode_workspace` for at least these rows and their longest row's keys."""
    num_rows = rows.numel()
    if num_rows == 0:
        return
    num_heads, dim = query.shape[1], query.shape[2]
    kv_heads = k_pool.shape[0]
    acc, run_max, run_sum = workspace
    splits = acc.shape[2]
    k_scales, ssh, sss = _scales(k_pool, quantized)
    v_scales, _, _ = _scales(v_pool, quantized)
    _decode_split_kernel[(num_rows, kv_heads, splits)](
        query,
        k_pool,
        v_pool,
        k_scales,
        v_scales,
        acc,
        run_max,
        run_sum,
        rows,
        tables,
        lens,
        query.stride(0),
        query.stride(1),
        tables.stride(0),
        k_pool.stride(0),
        k_pool.stride(1),
        ssh,
        sss,
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        run_max.stride(0),
        run_max.stride(1),
        scale,
        softcap or 1.0,
        window or 0,
        block_size,
        **decode_config(num_heads, kv_heads, dim, query.dtype, quantized, window is not None, softcap is not None),
    )
    _decode_merge_kernel[(num_rows, num_heads)](
        out,
        acc,
        run_max,
        run_sum,
        rows,
        lens,
        out.stride(0),
        out.stride(1),
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        run_max.stride(0),
        run_max.stride(1),
        **merge_config(dim),
    )


def prefill_tiles(q_lens: list[int], device: torch.device) -> torch.Tensor:
    """[N, 2] int32: each prefill program's chunk and first query (PREFILL_BLOCK_M queries a program)."""
    tiles = [(c, m) for c, n in enumerate(q_lens) for m in range(0, n, PREFILL_BLOCK_M)]
    return torch.tensor(tiles, dtype=torch.int32, device=device).reshape(-1, 2)


def prefill(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out: torch.Tensor,
    tiles: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    ctx_lens: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    quantized: bool = False,
) -> None:
    """Chunks: query [T, H, D] (the packed step), out [T, H, D]; chunk c's q_lens[c] queries start at row
    q_starts[c], are the last of its ctx_lens[c] keys (its earlier ones already in the pool), its blocks
    tables[c]; `tiles` from `prefill_tiles`."""
    num_tiles = tiles.shape[0]
    if num_tiles == 0:
        return
    num_heads, dim = query.shape[1], query.shape[2]
    k_scales, ssh, sss = _scales(k_pool, quantized)
    v_scales, _, _ = _scales(v_pool, quantized)
    _prefill_kernel[(num_tiles, num_heads)](
        query,
        k_pool,
        v_pool,
        k_scales,
        v_scales,
        out,
        tiles,
        q_starts,
        q_lens,
        ctx_lens,
        tables,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        tables.stride(0),
        k_pool.stride(0),
        k_pool.stride(1),
        ssh,
        sss,
        scale,
        softcap or 1.0,
        window or 0,
        block_size,
        **prefill_config(
            num_heads, k_pool.shape[0], dim, query.dtype, quantized, window is not None, softcap is not None
        ),
    )


def self_test(layout: KVLayout, block_size: int, num_heads: int, device: torch.device) -> str | None:
    """Run the three kernels once on a scratch pool of this layout (one layer, two blocks) and check their answer
    against torch's: None when they work here, else what failed. At load: a host whose triton cannot build or run
    its kernels (no C compiler for its launcher, a driver or GPU it does not support) serves by SDPA instead of
    failing every request."""
    try:
        pool = KVPool(KVLayout(1, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.kv_dtype), 2, block_size,
                      device)  # fmt: skip
        n, dim = block_size + 1, layout.head_dim  # two blocks, the second in the table first: an edge crossed
        generator = torch.Generator().manual_seed(0)
        key, value, query = (
            torch.randn(shape, generator=generator).to(device, layout.dtype)
            for shape in ((layout.num_kv_heads, n, dim), (layout.num_kv_heads, n, dim), (n, num_heads, dim))
        )
        slots = pool.slots([1, 0], n)
        store_kv(pool.k[0], pool.v[0], slots, key, value, pool.is_quantized)
        int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
        out = torch.zeros_like(query)
        prefill(query, pool.k[0], pool.v[0], out, prefill_tiles([n], device), int32([0]), int32([n]), int32([n]),
                int32([[1, 0]]), block_size, dim**-0.5, quantized=pool.is_quantized)  # fmt: skip
        last = torch.zeros_like(query)
        decode(query, pool.k[0], pool.v[0], last, int32([n - 1]), int32([[1, 0]]), int32([n]),
               decode_workspace(1, num_heads, dim, n, device), block_size, dim**-0.5,
               quantized=pool.is_quantized)  # fmt: skip
        k, v = pool.read(0, 0, 0, slots)
        group = num_heads // layout.num_kv_heads
        scores = torch.einsum("qhd,hkd->hqk", query.float(), k.float().repeat_interleave(group, 0)) * dim**-0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=device).triu(1), float("-inf"))
        want = torch.einsum("hqk,hkd->qhd", scores.softmax(-1), v.float().repeat_interleave(group, 0))
        for name, got in (("prefill", out), ("decode", last[n - 1 :])):
            error = (got.float() - want[-got.shape[0] :]).abs().max().item()
            if not error < 0.05:  # bf16 rounding is ~0.01 here; NaN fails too
                return f"the {name} kernel's answer is off by {error:.3g}"
    except Exception as exc:  # whatever triton raises where it cannot build or run here
        return " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
    return None

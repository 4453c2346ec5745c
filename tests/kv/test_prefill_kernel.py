"""The paged prefill kernel against causal attention over the same keys, gathered by hand, in float64."""

from __future__ import annotations

import pytest
import torch

from server.kv import kernels

pytestmark = pytest.mark.skipif(
    not kernels.paged_prefill_available(torch.bfloat16, 64), reason="no AVX512-BF16 build: prefill chunks use SDPA"
)
TOLERANCE = 2e-2  # bf16 in and out (SDPA in bf16 is off from float64 by as much)


def pool(kv_heads: int, dim: int, block: int, num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (kv_heads, num_blocks * block, dim)
    return (torch.randn(shape, generator=gen).to(torch.bfloat16), torch.randn(shape, generator=gen).to(torch.bfloat16))


def tables_for(spans: list[tuple[int, int]], block: int, num_blocks: int, seed: int) -> list[list[int]]:
    """Each span's blocks, scattered over the pool in no order, no block shared."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for _, ctx in spans:
        n = -(-ctx // block)
        tables.append(order[used : used + n])
        used += n
    return tables


def run_kernel(query, k_pool, v_pool, spans, tables, block, starts=None):
    """query [1, H, T, D] as transformers hands it; spans (tokens, keys) laid out one after another in the row."""
    out = torch.full((query.shape[2], query.shape[1], query.shape[3]), 7.0, dtype=query.dtype)  # 7: untouched
    if starts is None:
        starts = [sum(q for q, _ in spans[:i]) for i in range(len(spans))]
    width = max(len(t) for t in tables)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32)

    torch.ops.kvserve.paged_prefill(
        query[0].transpose(0, 1),
        k_pool,
        v_pool,
        out,
        i32(starts),
        i32([q for q, _ in spans]),
        i32([c for _, c in spans]),
        i32([t + [0] * (width - len(t)) for t in tables]),
        block,
        query.shape[-1] ** -0.5,
    )
    return out


def reference(query, k_pool, v_pool, start, q_len, ctx, table, block) -> torch.Tensor:
    """[q_len, H, D]: token i of the span (position ctx - q_len + i) over keys 0 .. its position, in float64."""
    heads, kv_heads, dim = query.shape[1], k_pool.shape[0], query.shape[-1]
    slots = torch.tensor([table[p // block] * block + p % block for p in range(ctx)])
    k = k_pool[:, slots].double().repeat_interleave(heads // kv_heads, 0)  # [H, ctx, D]
    v = v_pool[:, slots].double().repeat_interleave(heads // kv_heads, 0)
    q = query[0, :, start : start + q_len].double()  # [H, q, D]
    scores = q @ k.transpose(1, 2) * dim**-0.5
    positions = ctx - q_len + torch.arange(q_len)
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > positions[:, None], float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block", "spans"),
    [
        (9, 3, 64, 16, [(256, 1500)]),  # the default model's shapes: a chunk after a long context
        (9, 3, 64, 16, [(5, 5), (33, 40), (1, 17), (64, 64)]),  # first chunks, a ragged one, a single token
        (8, 2, 128, 4, [(100, 300), (7, 7)]),  # head size 128, small blocks
        (4, 4, 64, 1, [(17, 64)]),  # no grouping, one-token blocks
        (8, 1, 64, 16, [(3, 1000), (31, 33)]),  # all heads on one kv head
    ],
)
def test_each_token_attends_to_its_keys_through_the_block_table(heads, kv_heads, dim, block, spans):
    num_blocks = sum(-(-c // block) for _, c in spans) + 5
    k_pool, v_pool = pool(kv_heads, dim, block, num_blocks, seed=1)
    tables = tables_for(spans, block, num_blocks, seed=2)
    total = sum(q for q, _ in spans)
    query = torch.randn(1, heads, total, dim, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = run_kernel(query, k_pool, v_pool, spans, tables, block)
    start = 0
    for (q_len, ctx), table in zip(spans, tables, strict=True):
        want = reference(query, k_pool, v_pool, start, q_len, ctx, table, block)
        got = out[start : start + q_len].double()
        assert (got - want).abs().max().item() < TOLERANCE, (q_len, ctx)
        start += q_len


def test_rows_of_the_packed_row_outside_the_spans_are_not_written():
    k_pool, v_pool = pool(2, 64, 4, 20, seed=1)
    query = torch.randn(1, 4, 12, 64).to(torch.bfloat16)
    # Rows 0-2 and 9-11 belong to others (decode rows, say): spans at rows 3-5 and 6-8.
    out = run_kernel(query, k_pool, v_pool, [(3, 10), (3, 3)], [[4, 1, 7], [9]], 4, starts=[3, 6])
    assert bool((out[:3] == 7).all())
    assert bool((out[9:] == 7).all())
    assert not bool((out[3:9] == 7).any())


def test_a_key_past_a_token_never_reaches_it():
    """Causality: changing the keys and values after position p leaves token p's output unchanged."""
    k_pool, v_pool = pool(1, 64, 16, 4, seed=1)
    query = torch.randn(1, 2, 40, 64).to(torch.bfloat16)
    before = run_kernel(query, k_pool, v_pool, [(40, 60)], [[0, 1, 2, 3]], 16)
    k_pool[:, 40:] += 5.0  # positions 40 .. 59: tokens 20 .. 39 of the chunk see them
    v_pool[:, 40:] -= 3.0
    after = run_kernel(query, k_pool, v_pool, [(40, 60)], [[0, 1, 2, 3]], 16)
    assert torch.equal(before[:20], after[:20])  # tokens at positions 20 .. 39
    assert not torch.equal(before[20:], after[20:])


def test_indices_it_would_follow_out_of_bounds_are_refused():
    k_pool, v_pool = pool(2, 64, 4, 10, seed=1)
    query = torch.randn(1, 4, 8, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="not in the pool"):
        run_kernel(query, k_pool, v_pool, [(8, 8)], [[0, 10]], 4)
    with pytest.raises(RuntimeError, match="not in the row"):
        run_kernel(query, k_pool, v_pool, [(8, 8)], [[0, 1]], 4, starts=[1])
    with pytest.raises(RuntimeError, match="does not fit its table"):
        run_kernel(query, k_pool, v_pool, [(8, 12)], [[0, 1]], 4)
    with pytest.raises(RuntimeError, match="does not fit its table"):
        run_kernel(query, k_pool, v_pool, [(8, 7)], [[0, 1]], 4)  # fewer keys than its own tokens


def test_it_serves_bf16_pools_with_head_sizes_it_was_built_for():
    assert kernels.paged_prefill_available(torch.bfloat16, 128)
    assert not kernels.paged_prefill_available(torch.bfloat16, 96)
    assert not kernels.paged_prefill_available(torch.float32, 64)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block", "rows", "keys"), [(9, 3, 64, 16, 8, 1504), (8, 2, 128, 4, 3, 37)]
)
def test_rows_sharing_keys_attend_to_all_of_them_and_report_the_log_sum(heads, kv_heads, dim, block, rows, keys):
    """A head of cascade attention: every row sees every key; lse is each row and head's log of the softmax sum."""
    num_blocks = -(-keys // block) + 3
    k_pool, v_pool = pool(kv_heads, dim, block, num_blocks, seed=4)
    (table,) = tables_for([(1, keys)], block, num_blocks, seed=5)
    gen = torch.Generator().manual_seed(6)
    query = torch.randn(rows, heads, dim, generator=gen).to(torch.bfloat16)  # [n, H, D]
    out = torch.empty_like(query)
    lse = torch.empty(rows, heads)
    blocks = torch.tensor(table, dtype=torch.int32)
    torch.ops.kvserve.paged_shared_keys(query, k_pool, v_pool, out, lse, blocks, keys, block, dim**-0.5)
    slots = torch.tensor([table[p // block] * block + p % block for p in range(keys)])
    k = k_pool[:, slots].double().repeat_interleave(heads // kv_heads, 0)  # [H, keys, D]
    v = v_pool[:, slots].double().repeat_interleave(heads // kv_heads, 0)
    scores = torch.einsum("nhd,hkd->nhk", query.double(), k) * dim**-0.5
    want = torch.einsum("nhk,hkd->nhd", torch.softmax(scores, -1), v)
    assert (out.double() - want).abs().max().item() < TOLERANCE
    assert (lse.double() - torch.logsumexp(scores, -1)).abs().max().item() < 1e-3


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block", "rows", "keys"),
    [(9, 3, 64, 16, 8, 1504), (8, 2, 128, 4, 3, 37), (4, 4, 64, 4, 5, 130)],
)
def test_a_head_laid_out_once_answers_as_the_kernel_reading_the_pool(heads, kv_heads, dim, block, rows, keys):
    """A head's keys and values laid out once (kept across steps by the runner) give the very output and
    log-sum of the call that lays them out itself, and both match float64 attention."""
    num_blocks = -(-keys // block) + 3
    k_pool, v_pool = pool(kv_heads, dim, block, num_blocks, seed=14)
    (table,) = tables_for([(1, keys)], block, num_blocks, seed=15)
    blocks = torch.tensor(table, dtype=torch.int32)
    query = torch.randn(rows, heads, dim, generator=torch.Generator().manual_seed(16)).to(torch.bfloat16)
    out, lse = torch.empty_like(query), torch.empty(rows, heads)
    torch.ops.kvserve.paged_shared_keys(query, k_pool, v_pool, out, lse, blocks, keys, block, dim**-0.5)
    laid_keys, laid_values = torch.ops.kvserve.paged_keys_layout(k_pool, v_pool, blocks, keys, block)
    tiles = -(-keys // 16)
    assert laid_keys.shape == (kv_heads, tiles * 16 * dim // 2)
    assert laid_values.shape == (kv_heads, tiles * 8 * dim)
    got, got_lse = torch.full_like(query, 7.0), torch.zeros(rows, heads)
    torch.ops.kvserve.shared_keys_from_layout(query, laid_keys, laid_values, got, got_lse, keys, dim**-0.5)
    assert torch.equal(got, out)
    assert torch.equal(got_lse, lse)
    slots = torch.tensor([table[p // block] * block + p % block for p in range(keys)])
    k = k_pool[:, slots].double().repeat_interleave(heads // kv_heads, 0)
    v = v_pool[:, slots].double().repeat_interleave(heads // kv_heads, 0)
    scores = torch.einsum("nhd,hkd->nhk", query.double(), k) * dim**-0.5
    want = torch.einsum("nhk,hkd->nhd", torch.softmax(scores, -1), v)
    assert (got.double() - want).abs().max().item() < TOLERANCE
    assert (got_lse.double() - torch.logsumexp(scores, -1)).abs().max().item() < 1e-3


def test_a_layout_is_refused_for_keys_it_does_not_hold():
    k_pool, v_pool = pool(2, 64, 4, 10, seed=1)
    laid_keys, laid_values = torch.ops.kvserve.paged_keys_layout(
        k_pool, v_pool, torch.tensor([3, 1, 4, 0, 9], dtype=torch.int32), 17, 4
    )
    query = torch.randn(2, 4, 64).to(torch.bfloat16)
    out, lse = torch.empty_like(query), torch.empty(2, 4)
    with pytest.raises(RuntimeError, match="does not hold 33 keys"):  # 17 keys fill two tiles of 16, not three
        torch.ops.kvserve.shared_keys_from_layout(query, laid_keys, laid_values, out, lse, 33, 0.125)
    with pytest.raises(RuntimeError, match="not in the pool"):
        torch.ops.kvserve.paged_keys_layout(k_pool, v_pool, torch.tensor([0, 10], dtype=torch.int32), 8, 4)
    with pytest.raises(RuntimeError, match="do not fit the table"):
        torch.ops.kvserve.paged_keys_layout(k_pool, v_pool, torch.tensor([0, 1], dtype=torch.int32), 9, 4)


def test_shared_keys_refuse_a_table_too_short():
    k_pool, v_pool = pool(2, 64, 4, 10, seed=1)
    query = torch.randn(2, 4, 64).to(torch.bfloat16)
    out, lse = torch.empty_like(query), torch.empty(2, 4)
    with pytest.raises(RuntimeError, match="do not fit the table"):
        torch.ops.kvserve.paged_shared_keys(
            query, k_pool, v_pool, out, lse, torch.tensor([0, 1], dtype=torch.int32), 9, 4, 0.125
        )
    with pytest.raises(RuntimeError, match="not in the pool"):
        torch.ops.kvserve.paged_shared_keys(
            query, k_pool, v_pool, out, lse, torch.tensor([0, 10], dtype=torch.int32), 8, 4, 0.125
        )


def passes_for(spans, kv_heads: int, dim: int, limit: int) -> int:
    """Passes of (span, kv head) pairs, each pass's key and value layouts within `limit` bytes (or one pair)."""
    passes, used = 0, 0
    for _, ctx in spans:
        pair = -(-ctx // 16) * 16 * dim * 4
        for _ in range(kv_heads):
            if used and used + pair > limit:
                passes, used = passes + 1, 0
            used += pair
    return passes + 1


@pytest.mark.parametrize("limit", [1, 40_000], ids=["a pass per head", "passes across spans"])
def test_spans_and_heads_cut_into_passes_by_the_scratch_limit_answer_the_same(limit):
    """A step whose key layouts outgrow the scratch limit runs in passes of (span, kv head) pairs."""
    spans, block = [(5, 5), (33, 300), (16, 16), (7, 90)], 4
    num_blocks = sum(-(-c // block) for _, c in spans) + 5
    k_pool, v_pool = pool(3, 64, block, num_blocks, seed=7)
    tables = tables_for(spans, block, num_blocks, seed=8)
    query = torch.randn(1, 9, sum(q for q, _ in spans), 64, generator=torch.Generator().manual_seed(9))
    query = query.to(torch.bfloat16)
    start = torch.ops.kvserve.paged_prefill_passes()
    whole = run_kernel(query, k_pool, v_pool, spans, tables, block)
    assert torch.ops.kvserve.paged_prefill_passes() == start + 1  # within the default limit: one pass
    before = torch.ops.kvserve.paged_prefill_scratch_limit(limit)
    try:
        cut = run_kernel(query, k_pool, v_pool, spans, tables, block)
    finally:
        torch.ops.kvserve.paged_prefill_scratch_limit(before)
    assert torch.ops.kvserve.paged_prefill_passes() == start + 1 + passes_for(spans, 3, 64, limit)
    assert passes_for(spans, 3, 64, limit) > 1
    assert torch.equal(cut, whole)
    assert torch.ops.kvserve.paged_prefill_scratch_limit(0) == before

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


def head_state(rows: int, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cascade head's walk state, filled with 7 (untouched): acc [n, H, D], max and sum [n, H], float32."""
    return torch.full((rows, heads, dim), 7.0), torch.full((rows, heads), 7.0), torch.full((rows, heads), 7.0)


def over_keys(query, k_pool, v_pool, table, block, keys) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of query [n, H, D] over keys 0 .. keys - 1, in float64: (attention [n, H, D], log-sum-exp [n, H])."""
    heads, kv_heads, dim = query.shape[1], k_pool.shape[0], query.shape[-1]
    slots = torch.tensor([table[p // block] * block + p % block for p in range(keys)])
    k = k_pool[:, slots].double().repeat_interleave(heads // kv_heads, 0)  # [H, keys, D]
    v = v_pool[:, slots].double().repeat_interleave(heads // kv_heads, 0)
    scores = torch.einsum("nhd,hkd->nhk", query.double(), k) * dim**-0.5
    return torch.einsum("nhk,hkd->nhd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block", "rows", "keys"), [(9, 3, 64, 16, 8, 1504), (8, 2, 128, 4, 3, 37)]
)
def test_rows_sharing_keys_leave_the_walk_state_of_all_of_them(heads, kv_heads, dim, block, rows, keys):
    """A head of cascade attention: every row sees every key; the state is the walk's unnormalised output with its
    running max and sum (acc / sum is the attention, max + log(sum) the log of the softmax sum)."""
    num_blocks = -(-keys // block) + 3
    k_pool, v_pool = pool(kv_heads, dim, block, num_blocks, seed=4)
    (table,) = tables_for([(1, keys)], block, num_blocks, seed=5)
    gen = torch.Generator().manual_seed(6)
    query = torch.randn(rows, heads, dim, generator=gen).to(torch.bfloat16)  # [n, H, D]
    acc, run_max, run_sum = head_state(rows, heads, dim)
    blocks = torch.tensor(table, dtype=torch.int32)
    torch.ops.kvserve.paged_shared_keys(query, k_pool, v_pool, acc, run_max, run_sum, blocks, keys, block, dim**-0.5)
    want, lse = over_keys(query, k_pool, v_pool, table, block, keys)
    assert (acc.double() / run_sum.double()[..., None] - want).abs().max().item() < TOLERANCE
    assert (run_max.double() + run_sum.double().log() - lse).abs().max().item() < 1e-3


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block", "rows", "keys"),
    [(9, 3, 64, 16, 8, 1504), (8, 2, 128, 4, 3, 37), (4, 4, 64, 4, 5, 130)],
)
def test_a_head_laid_out_once_answers_as_the_kernel_reading_the_pool(heads, kv_heads, dim, block, rows, keys):
    """A head's keys and values laid out once (kept across steps by the runner) give the very state of the call
    that lays them out itself, and both match float64 attention."""
    num_blocks = -(-keys // block) + 3
    k_pool, v_pool = pool(kv_heads, dim, block, num_blocks, seed=14)
    (table,) = tables_for([(1, keys)], block, num_blocks, seed=15)
    blocks = torch.tensor(table, dtype=torch.int32)
    query = torch.randn(rows, heads, dim, generator=torch.Generator().manual_seed(16)).to(torch.bfloat16)
    state = head_state(rows, heads, dim)
    torch.ops.kvserve.paged_shared_keys(query, k_pool, v_pool, *state, blocks, keys, block, dim**-0.5)
    laid_keys, laid_values = torch.ops.kvserve.paged_keys_layout(k_pool, v_pool, blocks, keys, block)
    tiles = -(-keys // 16)
    assert laid_keys.shape == (kv_heads, tiles * 16 * dim // 2)
    assert laid_values.shape == (kv_heads, tiles * 8 * dim)
    got = head_state(rows, heads, dim)
    torch.ops.kvserve.shared_keys_from_layout(query, laid_keys, laid_values, *got, keys, dim**-0.5)
    for a, b in zip(got, state, strict=True):
        assert torch.equal(a, b)
    want, _ = over_keys(query, k_pool, v_pool, table, block, keys)
    assert (got[0].double() / got[2].double()[..., None] - want).abs().max().item() < TOLERANCE


def test_a_layout_is_refused_for_keys_it_does_not_hold():
    k_pool, v_pool = pool(2, 64, 4, 10, seed=1)
    laid_keys, laid_values = torch.ops.kvserve.paged_keys_layout(
        k_pool, v_pool, torch.tensor([3, 1, 4, 0, 9], dtype=torch.int32), 17, 4
    )
    query = torch.randn(2, 4, 64).to(torch.bfloat16)
    state = head_state(2, 4, 64)
    with pytest.raises(RuntimeError, match="does not hold 33 keys"):  # 17 keys fill two tiles of 16, not three
        torch.ops.kvserve.shared_keys_from_layout(query, laid_keys, laid_values, *state, 33, 0.125)
    with pytest.raises(RuntimeError, match="not in the pool"):
        torch.ops.kvserve.paged_keys_layout(k_pool, v_pool, torch.tensor([0, 10], dtype=torch.int32), 8, 4)
    with pytest.raises(RuntimeError, match="do not fit the table"):
        torch.ops.kvserve.paged_keys_layout(k_pool, v_pool, torch.tensor([0, 1], dtype=torch.int32), 9, 4)
    with pytest.raises(RuntimeError, match="acc is"):
        torch.ops.kvserve.shared_keys_from_layout(query, laid_keys, laid_values, *head_state(2, 4, 32)[:1],
                                                  *state[1:], 17, 0.125)  # fmt: skip


def test_shared_keys_refuse_a_table_too_short():
    k_pool, v_pool = pool(2, 64, 4, 10, seed=1)
    query = torch.randn(2, 4, 64).to(torch.bfloat16)
    state = head_state(2, 4, 64)
    with pytest.raises(RuntimeError, match="do not fit the table"):
        torch.ops.kvserve.paged_shared_keys(
            query, k_pool, v_pool, *state, torch.tensor([0, 1], dtype=torch.int32), 9, 4, 0.125
        )
    with pytest.raises(RuntimeError, match="not in the pool"):
        torch.ops.kvserve.paged_shared_keys(
            query, k_pool, v_pool, *state, torch.tensor([0, 10], dtype=torch.int32), 8, 4, 0.125
        )
    with pytest.raises(RuntimeError, match="max and sum"):
        torch.ops.kvserve.paged_shared_keys(
            query, k_pool, v_pool, state[0], state[1], torch.empty(3, 4), torch.tensor([0, 1], dtype=torch.int32),
            8, 4, 0.125,
        )  # fmt: skip


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


def decode_rows(query, k_pool, v_pool, rows, tables, lens, block, heads=None):
    """paged_decode_rows over query [T, H, D]; heads: (first_keys, acc, max, sum) for rows resuming a head."""
    out = torch.full_like(query, 7.0)  # 7: untouched
    width = max(len(t) for t in tables)
    empty = torch.empty(0)
    first_keys, acc, run_max, run_sum = heads or (None, empty, empty, empty)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32)

    torch.ops.kvserve.paged_decode_rows(
        query,
        k_pool,
        v_pool,
        out,
        i32(rows),
        i32([t + [0] * (width - len(t)) for t in tables]),
        i32(lens),
        empty if first_keys is None else i32(first_keys),
        acc,
        run_max,
        run_sum,
        block,
        query.shape[-1] ** -0.5,
    )
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block"),
    [(9, 3, 64, 16), (8, 2, 128, 4), (4, 4, 64, 1), (8, 1, 64, 16), (16, 2, 64, 32), (12, 4, 128, 16)],
)
def test_a_decode_row_is_bit_for_bit_the_token_of_a_prefill_chunk(heads, kv_heads, dim, block):
    """The decode walk and the prefill kernel compute a token's attention in the same steps: equal bits for every
    context length around the tile (16), step (64) and partition (256) edges, any group size (1 to 8 query heads
    per kv head), and within bf16 of float64."""
    lengths = [1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 700, 1100]
    num_blocks = sum(-(-c // block) for c in lengths) + 4
    k_pool, v_pool = pool(kv_heads, dim, block, num_blocks, seed=21)
    tables = tables_for([(1, c) for c in lengths], block, num_blocks, seed=22)
    query = torch.randn(1, heads, len(lengths) + 2, dim, generator=torch.Generator().manual_seed(23))
    query = query.to(torch.bfloat16)
    rows = list(range(1, len(lengths) + 1))  # rows 0 and the last are not decode rows: left untouched
    got = decode_rows(query[0].transpose(0, 1), k_pool, v_pool, rows, tables, lengths, block)
    chunks = run_kernel(query, k_pool, v_pool, [(1, c) for c in lengths], tables, block, starts=rows)
    assert torch.equal(got[rows], chunks[rows])
    assert (got[0] == 7).all()
    assert (got[-1] == 7).all()
    for row, ctx, table in zip(rows, lengths, tables, strict=True):
        want = reference(query, k_pool, v_pool, row, 1, ctx, table, block)
        assert (got[row : row + 1].double() - want).abs().max().item() < TOLERANCE, ctx


@pytest.mark.parametrize(("dim", "block", "head_keys"), [(64, 16, 256), (128, 4, 512), (64, 32, 768)])
def test_rows_resuming_a_head_equal_rows_walking_their_whole_context(dim, block, head_keys):
    """Cascade attention in the walk: rows sharing their first head_keys keys (a multiple of 256) resume one walk
    over them, from the state laid out or read in place, and come out bit for bit as walking everything alone."""
    heads, kv_heads, tails = 8, 2, [1, 40, 256, 700]  # tails within one partition, filling one, and several
    shared = head_keys // block
    num_blocks = shared + sum(-(-t // block) + 1 for t in tails) + 4
    k_pool, v_pool = pool(kv_heads, dim, block, num_blocks, seed=31)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(32)).tolist()
    head_table, used, tables, lens = order[:shared], shared, [], []
    for tail in tails:
        n = -(-tail // block)
        tables.append(head_table + order[used : used + n])
        lens.append(head_keys + tail)
        used += n
    query = torch.randn(len(tails), heads, dim, generator=torch.Generator().manual_seed(33)).to(torch.bfloat16)
    rows = list(range(len(tails)))
    alone = decode_rows(query, k_pool, v_pool, rows, tables, lens, block)
    blocks = torch.tensor(head_table, dtype=torch.int32)
    in_place = head_state(len(tails), heads, dim)
    torch.ops.kvserve.paged_shared_keys(query, k_pool, v_pool, *in_place, blocks, head_keys, block, dim**-0.5)
    laid_keys, laid_values = torch.ops.kvserve.paged_keys_layout(k_pool, v_pool, blocks, head_keys, block)
    laid = head_state(len(tails), heads, dim)
    torch.ops.kvserve.shared_keys_from_layout(query, laid_keys, laid_values, *laid, head_keys, dim**-0.5)
    for state in (in_place, laid):
        resumed = decode_rows(query, k_pool, v_pool, rows, tables, lens, block, ([head_keys] * len(tails), *state))
        assert torch.equal(resumed, alone)
    for row, (ctx, table) in enumerate(zip(lens, tables, strict=True)):
        want = reference(query.transpose(0, 1)[None], k_pool, v_pool, row, 1, ctx, table, block)
        assert (alone[row : row + 1].double() - want).abs().max().item() < TOLERANCE


def test_decode_rows_refuse_what_they_would_read_out_of_bounds():
    k_pool, v_pool = pool(2, 64, 4, 10, seed=1)
    query = torch.randn(3, 4, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="not in the pool"):
        decode_rows(query, k_pool, v_pool, [0], [[0, 10]], [8], 4)
    with pytest.raises(RuntimeError, match="does not fit its table"):
        decode_rows(query, k_pool, v_pool, [0], [[0, 1]], [9], 4)
    with pytest.raises(RuntimeError, match="out of range"):
        decode_rows(query, k_pool, v_pool, [3], [[0, 1]], [8], 4)
    state = head_state(1, 4, 64)
    k_pool, v_pool = pool(2, 64, 4, 100, seed=1)
    with pytest.raises(RuntimeError, match="multiple of 256"):  # a head must end on a partition's edge
        decode_rows(query, k_pool, v_pool, [0], [list(range(100))], [300], 4, ([64], *state))
    with pytest.raises(RuntimeError, match="has a head but no state"):  # one state given: row 0's, not row 1's
        decode_rows(query, k_pool, v_pool, [0, 1], [list(range(100))] * 2, [300, 300], 4, ([256, 256], *state))

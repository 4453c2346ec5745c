"""The paged decode kernel against plain attention over the same keys, gathered by hand."""

from __future__ import annotations

import pytest
import torch

from server.kv import kernels

pytestmark = pytest.mark.skipif(not kernels.paged_decode_available(), reason="no C++ compiler: the SDPA path serves")
KV_HEADS, HEADS, DIM, BLOCK, NUM_BLOCKS = 2, 6, 16, 4, 40
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def reference(q, k_pool, v_pool, table, ctx, window, softcap):
    """q [H, D] of the token at position ctx - 1; the keys it may see, gathered and attended to in float64."""
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)])
    lo = max(0, ctx - window) if window else 0
    k = k_pool[:, slots[lo:]].double().repeat_interleave(HEADS // KV_HEADS, 0)
    v = v_pool[:, slots[lo:]].double().repeat_interleave(HEADS // KV_HEADS, 0)
    scores = (q.double()[:, None, :] @ k.transpose(1, 2))[:, 0] * DIM**-0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return (torch.softmax(scores, -1)[:, None, :] @ v)[:, 0]


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (5, 0.0), (0, 30.0)])
def test_decode_rows_attend_to_their_own_blocks(dtype, window, softcap):
    gen = torch.Generator().manual_seed(0)
    k_pool = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, DIM, generator=gen).to(dtype)
    v_pool = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, DIM, generator=gen).to(dtype)
    query = torch.randn(1, HEADS, 5, DIM, generator=gen).to(dtype)  # transformers' [1, H, T, D]
    out = torch.zeros(5, HEADS, DIM, dtype=dtype)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # scattered blocks, as after evictions
    tables = [order[0:10], order[10:20], order[20:30]]
    rows, lens = [0, 2, 4], [1, 17, 33]  # rows 1 and 3 belong to a prefill span: the kernel leaves them alone
    torch.ops.kvserve.paged_decode(
        query[0].transpose(0, 1),
        k_pool,
        v_pool,
        out,
        torch.tensor(rows, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        BLOCK,
        window,
        DIM**-0.5,
        softcap,
    )
    for row, table, ctx in zip(rows, tables, lens, strict=True):
        expected = reference(query[0, :, row], k_pool, v_pool, table, ctx, window, softcap)
        assert (out[row].double() - expected).abs().max().item() < TOLERANCE[dtype]
    assert out[1].abs().sum() == 0
    assert out[3].abs().sum() == 0


def test_the_build_is_named_by_source_torch_and_cpu(monkeypatch, tmp_path):
    name = kernels.build_name()
    assert name.startswith("kvserve_kernels_")
    changed = tmp_path / "paged_decode.cpp"
    changed.write_text(kernels.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(kernels, "SOURCE", changed)
    assert kernels.build_name() != name

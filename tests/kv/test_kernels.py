"""The paged decode kernel against plain attention over the same keys, gathered by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server.kv import kernels

pytestmark = pytest.mark.skipif(not kernels.paged_decode_available(), reason="no C++ compiler: the SDPA path serves")
ROOT = Path(__file__).resolve().parents[2]
KV_HEADS, HEADS, BLOCK, NUM_BLOCKS = 2, 6, 4, 40
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def paged_decode(query, k_pool, v_pool, out, rows, tables, lens, window=0, softcap=0.0, heads=None):
    """The op as attention.py calls it: query in transformers' [1, H, T, D], metadata as int32 lists here.

    heads: (first_keys, head_out [Bh, H, D], head_lse [Bh, H]) for rows whose first keys are attended already.
    """
    as_int32 = [torch.tensor(x, dtype=torch.int32) for x in (rows, tables, lens)]
    empty = torch.empty(0)
    first_keys, head_out, head_lse = (empty, empty, empty) if heads is None else heads
    if heads is not None:
        first_keys = torch.tensor(first_keys, dtype=torch.int32)
    scale = query.shape[-1] ** -0.5
    torch.ops.kvserve.paged_decode(
        query[0].transpose(0, 1),
        k_pool,
        v_pool,
        out,
        *as_int32,
        first_keys,
        head_out,
        head_lse,
        BLOCK,
        window,
        scale,
        softcap,
    )


def reference(q, k_pool, v_pool, table, ctx, window, softcap, keys=None, lse=False):
    """q [H, D] of the token at position ctx - 1; the keys it may see, gathered and attended to in float64.

    keys: only these key positions (a head); lse: also return the log of the softmax sum per head.
    """
    dim = q.shape[-1]
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)])
    lo = max(0, ctx - window) if window else 0
    picked = slots[lo:] if keys is None else slots[keys]
    k = k_pool[:, picked].double().repeat_interleave(HEADS // KV_HEADS, 0)
    v = v_pool[:, picked].double().repeat_interleave(HEADS // KV_HEADS, 0)
    scores = (q.double()[:, None, :] @ k.transpose(1, 2))[:, 0] * dim**-0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    out = (torch.softmax(scores, -1)[:, None, :] @ v)[:, 0]
    return (out, scores.logsumexp(-1)) if lse else out


@pytest.mark.parametrize("dim", [16, 64])  # 64: the AVX512-BF16 path's dot products (a multiple of 32)
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (5, 0.0), (0, 30.0)])
def test_decode_rows_attend_to_their_own_blocks(dtype, window, softcap, dim):
    gen = torch.Generator().manual_seed(0)
    k_pool = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, dim, generator=gen).to(dtype)
    v_pool = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, dim, generator=gen).to(dtype)
    query = torch.randn(1, HEADS, 5, dim, generator=gen).to(dtype)  # transformers' [1, H, T, D]
    out = torch.zeros(5, HEADS, dim, dtype=dtype)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # scattered blocks, as after evictions
    tables = [order[0:10], order[10:20], order[20:30]]
    rows, lens = [0, 2, 4], [1, 17, 33]  # rows 1 and 3 belong to a prefill span: the kernel leaves them alone
    paged_decode(query, k_pool, v_pool, out, rows, tables, lens, window=window, softcap=softcap)
    for row, table, ctx in zip(rows, tables, lens, strict=True):
        expected = reference(query[0, :, row], k_pool, v_pool, table, ctx, window, softcap)
        assert (out[row].double() - expected).abs().max().item() < TOLERANCE[dtype]
    assert out[1].abs().sum() == 0
    assert out[3].abs().sum() == 0


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_a_row_resumes_from_the_head_it_is_given(dtype):
    """Cascade attention: keys 0 .. first - 1 come as an output and its log-sum-exp; the result is the whole row's."""
    gen = torch.Generator().manual_seed(1)
    dim = 64
    k_pool = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, dim, generator=gen).to(dtype)
    v_pool = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, dim, generator=gen).to(dtype)
    query = torch.randn(1, HEADS, 4, dim, generator=gen).to(dtype)
    out = torch.zeros(4, HEADS, dim, dtype=dtype)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [order[0:12], order[0:8] + order[12:16], order[20:32]]  # rows 0 and 1 share eight blocks
    rows, lens, first = [3, 1, 0], [45, 40, 21], [32, 32, 0]  # the third row has no head
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    head_out = torch.empty(2, HEADS, dim, dtype=dtype)
    head_lse = torch.empty(2, HEADS, dtype=lse_dtype)
    for b in range(2):
        o, lse = reference(query[0, :, rows[b]], k_pool, v_pool, tables[b], lens[b], 0, 0.0, range(first[b]), True)
        head_out[b], head_lse[b] = o.to(dtype), lse.to(lse_dtype)
    paged_decode(query, k_pool, v_pool, out, rows, tables, lens, heads=(first, head_out, head_lse))
    for row, table, ctx in zip(rows, tables, lens, strict=True):
        expected = reference(query[0, :, row], k_pool, v_pool, table, ctx, 0, 0.0)
        assert (out[row].double() - expected).abs().max().item() < TOLERANCE[dtype]
    assert out[2].abs().sum() == 0
    with pytest.raises(RuntimeError, match="without window and softcap"):
        paged_decode(query, k_pool, v_pool, out, rows, tables, lens, window=8, heads=(first, head_out, head_lse))
    with pytest.raises(RuntimeError, match="own key"):
        paged_decode(query, k_pool, v_pool, out, rows, tables, lens, heads=([45, 32, 0], head_out, head_lse))
    with pytest.raises(RuntimeError, match="no head output"):
        paged_decode(query, k_pool, v_pool, out, rows, tables, lens, heads=([*first[:2], 4], head_out, head_lse))


@pytest.mark.parametrize("which", [0, 1], ids=["decode", "prefill"])
def test_the_build_is_named_by_source_torch_and_cpu(monkeypatch, tmp_path, which):
    name = kernels.build_name()
    assert name.startswith("kvserve_kernels_")
    source = kernels.SOURCES[which]
    changed = tmp_path / source.name
    changed.write_text(source.read_text() + "\n// changed\n")
    monkeypatch.setattr(kernels, "SOURCES", [changed if s == source else s for s in kernels.SOURCES])
    assert kernels.build_name() != name


def test_two_checkouts_of_the_same_source_build_apart(monkeypatch, tmp_path):
    name = kernels.build_name()
    csrc = tmp_path / "checkout" / "server" / "kv" / "csrc"
    csrc.mkdir(parents=True)
    for source in kernels.SOURCES:
        (csrc / source.name).write_bytes(source.read_bytes())  # the same bytes in another checkout
    monkeypatch.setattr(kernels, "SOURCES", [csrc / s.name for s in kernels.SOURCES])
    other = kernels.build_name()
    assert other != name  # its own build directory: neither rebuilds the other's
    spelled = csrc.parent / ".." / "kv" / "csrc"
    monkeypatch.setattr(kernels, "SOURCES", [spelled / s.name for s in kernels.SOURCES])
    assert kernels.build_name() == other  # the same checkout, however its path is spelled


def test_a_build_lock_left_by_a_killed_build_does_not_hang_a_start():
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(kernels.build_name(), verbose=False))
    (build_dir / "lock").touch()  # what a build killed half-way leaves: torch's loader would wait on it forever
    code = "from server.kv import kernels; import sys; sys.exit(0 if kernels.paged_decode_available() else 1)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (build_dir / "lock").exists(), (build_dir, done.stdout, done.stderr[-1000:])


def test_indices_outside_the_pool_are_refused_not_followed():
    pool = torch.zeros(KV_HEADS, NUM_BLOCKS * BLOCK, 16)
    query, out = torch.zeros(1, HEADS, 2, 16), torch.zeros(2, HEADS, 16)

    def call(rows, tables, lens):
        paged_decode(query, pool, pool, out, rows, tables, lens)

    with pytest.raises(RuntimeError, match="not in the pool"):
        call([0], [[NUM_BLOCKS]], [1])
    with pytest.raises(RuntimeError, match="does not fit its table"):
        call([0], [[0]], [BLOCK + 1])
    with pytest.raises(RuntimeError, match="out of range"):
        call([2], [[0]], [1])
    with pytest.raises(RuntimeError, match="does not fit"):
        call([0], [[0]], [0])


def test_kernels_share_their_work_among_torchs_threads():
    """at::parallel_for spreads a kernel's items over torch's OpenMP team only in a build made with OpenMP;
    without it every kernel ran on one thread (measured: the prefill kernel took as long on two as on one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.ops.kvserve.parallel_threads(64) == 2
    finally:
        torch.set_num_threads(before)
    torch.set_num_threads(1)
    try:
        assert torch.ops.kvserve.parallel_threads(64) == 1
    finally:
        torch.set_num_threads(before)

"""The Triton kernels (server/kv/triton_attention.py) against float64 attention over a paged pool.

Without CUDA they run in triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1); on a
GPU (bench/gpu_check.sh) the same tests run the compiled kernels on the device. Blocks are scattered (a
shuffled table), lengths cross block edges and decode splits, GQA groups are 1 to 8, head sizes 64 and 128.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton.runtime.jit import mangle_type

from server.kv import triton_attention as ta
from server.kv.pool import KV_DTYPES, KVLayout, KVPool, quantize

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # the output's own rounding (bf16: 8 bits) and P in bf16


def make_pool(kv_heads: int, dim: int, dtype: torch.dtype, kv: str | None, block_size: int, num_blocks: int) -> KVPool:
    layout = KVLayout(1, kv_heads, dim, dtype, KV_DTYPES[kv] if kv else None)
    return KVPool(layout, num_blocks, block_size, DEVICE)


def fill(pool: KVPool, tables: list[list[int]], lens: list[int], gen: torch.Generator) -> None:
    """Random K/V in every slot the sequences use (written the pool's own way: quantized where it is)."""
    for table, n in zip(tables, lens, strict=True):
        slots = pool.slots(table, n)
        shape = (pool.layout.num_kv_heads, n, pool.layout.head_dim)
        k, v = (torch.randn(shape, generator=gen).to(DEVICE, pool.layout.dtype) for _ in range(2))
        pool.write(0, slots, k, v)


def context(pool: KVPool, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's keys and values [kv_heads, n, D] as the model computes with them, in float64."""
    k, v = pool.read(0, 0, 0, pool.slots(table, n))
    return k.double(), v.double()


def reference(q, k, v, positions, scale, window=None, softcap=None) -> torch.Tensor:
    """q [n, H, D], k/v [kvH, ctx, D], positions [n] -> [n, H, D] in float64."""
    group = q.shape[1] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [H, ctx, D]
    scores = torch.einsum("nhd,hkd->nhk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    keys = torch.arange(k.shape[1])
    pos = torch.tensor(positions)[:, None]
    visible = keys[None, :] <= pos
    if window is not None:
        visible &= keys[None, :] > pos - window
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("nhk,hkd->nhd", torch.softmax(scores, -1), v)


def scattered(num_seqs: int, lens: list[int], block_size: int, gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Block tables from one shuffled pool of blocks (no two sequences share one); the number of blocks."""
    need = [-(-n // block_size) for n in lens]
    total = sum(need) + 3
    order = torch.randperm(total, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    return tables, total


DECODE_CASES = [  # (group, kv_heads, dim, dtype, kv, window, softcap)
    (1, 2, 64, torch.float32, None, None, None),
    (4, 2, 128, torch.float32, None, None, None),
    (8, 1, 64, torch.bfloat16, None, None, None),
    (2, 2, 64, torch.float32, None, 40, None),
    (4, 1, 64, torch.float32, None, None, 30.0),
    (2, 2, 128, torch.bfloat16, None, 100, 50.0),
    (4, 2, 64, torch.float32, "int8", None, None),
    (2, 1, 128, torch.bfloat16, "fp8", None, None),
    (8, 1, 64, torch.float32, "int8", 33, 20.0),
    (6, 2, 80, torch.float32, None, None, None),  # a group and a head size that are not powers of two (masked)
]


@pytest.mark.parametrize(("group", "kv_heads", "dim", "dtype", "kv", "window", "softcap"), DECODE_CASES)
def test_decode_matches_float64(group, kv_heads, dim, dtype, kv, window, softcap):
    gen = torch.Generator().manual_seed(group * 1000 + dim)
    bs = 16
    lens = [1, bs - 1, bs, bs + 1, 2 * bs + 7, ta.SPLIT_KEYS + 3, 2 * ta.SPLIT_KEYS + bs]  # block and split edges
    tables, num_blocks = scattered(len(lens), lens, bs, gen)
    pool = make_pool(kv_heads, dim, dtype, kv, bs, num_blocks)
    fill(pool, tables, lens, gen)
    heads = group * kv_heads
    num_rows = len(lens) + 2  # the decode rows sit among other rows of the packed step
    query = torch.randn((num_rows, heads, dim), generator=gen).to(DEVICE, dtype)
    at = [2, 0, 5, 1, 8, 3, 7]
    out = torch.full((num_rows, heads, dim), float("nan"), dtype=dtype, device=DEVICE)
    width = max(len(t) for t in tables)
    int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    workspace = ta.decode_workspace(len(lens), heads, dim, max(lens), DEVICE)
    scale = dim**-0.5
    ta.decode(
        query, pool.k[0], pool.v[0], out, int32(at), int32([t + [0] * (width - len(t)) for t in tables]), int32(lens),
        workspace, bs, scale, window, softcap, pool.is_quantized,
    )  # fmt: skip
    for row, table, n in zip(at, tables, lens, strict=True):
        k, v = context(pool, table, n)
        want = reference(query[row : row + 1].cpu(), k.cpu(), v.cpu(), [n - 1], scale, window, softcap)[0]
        got = out[row].double().cpu()
        assert torch.allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype]), (n, (got - want).abs().max().item())
    untouched = [r for r in range(num_rows) if r not in at]
    assert torch.isnan(out[untouched]).all()  # rows not named are not written


PREFILL_CASES = [  # (group, kv_heads, dim, dtype, kv, window, softcap)
    (1, 2, 64, torch.float32, None, None, None),
    (4, 2, 128, torch.float32, None, None, None),
    (8, 1, 64, torch.bfloat16, None, None, None),
    (2, 2, 64, torch.float32, None, 20, None),
    (2, 1, 64, torch.float32, None, None, 25.0),
    (4, 1, 128, torch.float32, "int8", None, None),
    (2, 2, 64, torch.bfloat16, "fp8", 24, 30.0),
    (3, 1, 80, torch.float32, None, None, None),
]


@pytest.mark.parametrize(("group", "kv_heads", "dim", "dtype", "kv", "window", "softcap"), PREFILL_CASES)
def test_prefill_and_extend_match_float64(group, kv_heads, dim, dtype, kv, window, softcap):
    """Chunks: a whole prompt (no earlier K/V), a turn's new tokens after cached ones (ending mid-block), a chunk
    starting inside a block and longer than a program's queries."""
    gen = torch.Generator().manual_seed(7 * group + dim)
    bs = 16
    chunks = [(0, 21), (37, 5), (bs + 3, ta.PREFILL_BLOCK_M + 9)]  # (earlier keys, new tokens)
    lens = [e + n for e, n in chunks]
    tables, num_blocks = scattered(len(chunks), lens, bs, gen)
    pool = make_pool(kv_heads, dim, dtype, kv, bs, num_blocks)
    fill(pool, tables, lens, gen)
    heads = group * kv_heads
    num_tokens = sum(n for _, n in chunks) + 1
    query = torch.randn((num_tokens, heads, dim), generator=gen).to(DEVICE, dtype)
    out = torch.full((num_tokens, heads, dim), float("nan"), dtype=dtype, device=DEVICE)
    starts, at = [], 1  # row 0 is another sequence's
    for _, n in chunks:
        starts.append(at)
        at += n
    width = max(len(t) for t in tables)
    int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    scale = dim**-0.5
    ta.prefill(
        query, pool.k[0], pool.v[0], out, ta.prefill_tiles([n for _, n in chunks], DEVICE), int32(starts),
        int32([n for _, n in chunks]), int32(lens), int32([t + [0] * (width - len(t)) for t in tables]), bs, scale,
        window, softcap, pool.is_quantized,
    )  # fmt: skip
    for (earlier, n), start, table, ctx in zip(chunks, starts, tables, lens, strict=True):
        k, v = context(pool, table, ctx)
        want = reference(query[start : start + n].cpu(), k.cpu(), v.cpu(), list(range(earlier, ctx)), scale, window,
                         softcap)  # fmt: skip
        got = out[start : start + n].double().cpu()
        assert torch.allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype]), (earlier, n, (got - want).abs().max())
    assert torch.isnan(out[0]).all()


@pytest.mark.parametrize("kv", [None, "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter computes tl.where's both sides
def test_store_writes_what_the_pool_writes(kv, dtype):
    """The kernel's write is the pool's: the same bytes, scales and all (rounding as torch rounds: ties to even;
    an all-zero K or V row: scale 0 and zero values, as `quantize` writes it); a slot < 0 is skipped."""
    gen = torch.Generator().manual_seed(3)
    kv_heads, dim, bs = 2, 64, 4
    ours, theirs = (make_pool(kv_heads, dim, dtype, kv, bs, 6) for _ in range(2))
    for pool in (ours, theirs):
        for t in pool.k + pool.v:
            t.view(torch.uint8).fill_(0)
    # [kv_heads, T, D] views with the step's strides ([1, kvH, T, D] from a transposed projection)
    key = torch.randn((1, 5, kv_heads, dim), generator=gen).to(DEVICE, dtype).transpose(1, 2)[0]
    value = torch.randn((1, 5, kv_heads, dim), generator=gen).to(DEVICE, dtype).transpose(1, 2)[0]
    slots = torch.tensor([9, 3, -1, 22, 0], dtype=torch.long, device=DEVICE)
    key[1, 1] = 0  # all-zero rows in written slots: scale 0, values 0 (no 0 / 0)
    value[0, 3] = 0
    ta.store_kv(ours.k[0], ours.v[0], slots, key, value, ours.is_quantized)
    kept = slots >= 0
    theirs.write(0, slots[kept], key[:, kept], value[:, kept])
    for a, b in ((ours.k[0], theirs.k[0]), (ours.v[0], theirs.v[0])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_deterministic_split_is_independent_of_the_batch():
    """A row's output is bit for bit the same alone and among others (the fixed split: deterministic mode)."""
    gen = torch.Generator().manual_seed(11)
    bs, dim, kv_heads, group = 16, 64, 2, 2
    lens = [ta.SPLIT_KEYS * 2 + 5, 40, 300]
    tables, num_blocks = scattered(3, lens, bs, gen)
    pool = make_pool(kv_heads, dim, torch.bfloat16, None, bs, num_blocks)
    fill(pool, tables, lens, gen)
    query = torch.randn((3, kv_heads * group, dim), generator=gen).to(DEVICE, torch.bfloat16)
    int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]

    def run(rows: list[int]) -> torch.Tensor:
        out = torch.zeros_like(query)
        space = ta.decode_workspace(len(rows), kv_heads * group, dim, max(lens[r] for r in rows), DEVICE)
        ta.decode(query, pool.k[0], pool.v[0], out, int32(rows), int32([padded[r] for r in rows]),
                  int32([lens[r] for r in rows]), space, bs, dim**-0.5)  # fmt: skip
        return out

    together = run([0, 1, 2])
    assert torch.equal(run([0])[0], together[0])
    assert torch.equal(run([2, 0])[0], together[0])
    assert torch.equal(run([1])[1], together[1])


def test_padding_rows_write_nothing_and_read_zero():
    """A captured graph's padding rows: slot -1 (no write), no keys (output zero)."""
    pool = make_pool(1, 64, torch.float32, None, 16, 2)
    query = torch.randn((2, 2, 64)).to(DEVICE)
    out = torch.full_like(query, float("nan"))
    int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    space = ta.decode_workspace(2, 2, 64, 1, DEVICE)
    pool.k[0].zero_(), pool.v[0].zero_()
    pool.k[0][0, 0] = 1.0
    pool.v[0][0, 0] = 2.0
    ta.decode(query, pool.k[0], pool.v[0], out, int32([0, 1]), int32([[0], [0]]), int32([1, 0]), space, 16, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.allclose(out[0], torch.full_like(out[0], 2.0))


def test_quantize_matches_the_kernel_scale_layout():
    """The kernels read a row's scale as float32 column D/4 of the row's bytes: the pool's layout (pool.py)."""
    rows = quantize(torch.randn(3, 64), torch.int8)
    raw = rows.view(torch.uint8).view(torch.float32)
    assert torch.equal(raw[:, 16], rows.view(torch.uint8)[:, 64:].contiguous().view(torch.float32)[:, 0])


class Launches:
    """A kernel standing in for itself: each launch recorded (its arguments' types as triton names them, and its
    constexprs: the keyword arguments), then run."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.seen: list[tuple[dict[str, str], dict]] = []

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            names = self.kernel.arg_names[: len(args)]  # the positional ones; the constexprs follow by name
            self.seen.append(({n: mangle_type(a) for n, a in zip(names, args, strict=True)}, constexprs))
            return self.kernel[grid](*args, **constexprs)

        return launch


KERNELS = ("_store_kv_kernel", "_decode_split_kernel", "_decode_merge_kernel", "_prefill_kernel")


def spy_launches(monkeypatch) -> dict[str, Launches]:
    spies = {name: Launches(getattr(ta, name)) for name in KERNELS}
    for name, spy in spies.items():
        monkeypatch.setattr(ta, name, spy)
    return spies


def attend_once(kv_heads: int, group: int, dim: int, dtype, kv, window=None, softcap=None) -> None:
    """One store, one prefill chunk and one decode row on a scratch pool of this shape, each against float64."""
    gen = torch.Generator().manual_seed(group * 100 + dim)
    bs, n = 4, 6  # two blocks, shuffled: the second in the table first
    pool = make_pool(kv_heads, dim, dtype, kv, bs, 2)
    table, heads, scale = [1, 0], group * kv_heads, dim**-0.5
    key, value = (torch.randn((kv_heads, n, dim), generator=gen).to(DEVICE, dtype) for _ in range(2))
    ta.store_kv(pool.k[0], pool.v[0], pool.slots(table, n), key, value, pool.is_quantized)
    query = torch.randn((n, heads, dim), generator=gen).to(DEVICE, dtype)
    k, v = context(pool, table, n)
    want = reference(query.cpu(), k.cpu(), v.cpu(), list(range(n)), scale, window, softcap)
    int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    out = torch.full_like(query, float("nan"))
    ta.prefill(query, pool.k[0], pool.v[0], out, ta.prefill_tiles([n], DEVICE), int32([0]), int32([n]), int32([n]),
               int32([table]), bs, scale, window, softcap, pool.is_quantized)  # fmt: skip
    last = torch.full_like(query, float("nan"))
    ta.decode(query, pool.k[0], pool.v[0], last, int32([n - 1]), int32([table]), int32([n]),
              ta.decode_workspace(1, heads, dim, n, DEVICE), bs, scale, window, softcap, pool.is_quantized)  # fmt: skip
    for got, rows in ((out, slice(0, n)), (last[n - 1 :], slice(n - 1, n))):
        assert torch.allclose(got.double().cpu(), want[rows], atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("group", range(1, 9))
def test_decode_pads_the_gqa_group_to_the_smallest_tile_tl_dot_takes(group, monkeypatch):
    """A decode program's query rows are one kv head's GQA group, padded to 16 (one tensor-core tile's M), the
    padding rows masked; the answer is float64's. What `decode()` launches is `decode_config`'s, which the sm_90
    compile check compiles. (The check cannot see a missing padding: triton compiles a dot of fewer rows.)"""
    spies = spy_launches(monkeypatch)
    attend_once(2, group, 64, torch.float32, None)
    launched = [constexprs for _, constexprs in spies["_decode_split_kernel"].seen]
    assert [(c["GROUP"], c["BLOCK_G"]) for c in launched] == [(group, 16)]
    assert launched == [ta.decode_config(2 * group, 2, 64, torch.float32, False, False, False)]


def test_the_sm_90_check_compiles_what_the_launchers_launch_for_the_device_shapes(monkeypatch):
    """Every launch the device shapes make (each pool and each layer extra the check lists) is a variant the check
    compiles, and it compiles nothing else: the two cannot drift (a fixed block of the check's own would)."""
    from tests.kv import triton_sm90

    def key(kernel, types: dict[str, str], constexprs: dict) -> tuple:
        return kernel, tuple(sorted(types.items())), tuple(sorted(constexprs.items()))

    compiled = set()
    for _, fn, pointers, constexprs in triton_sm90.variants():
        types = {n: t for n, t in triton_sm90.signature(fn, pointers, constexprs).items() if t != "constexpr"}
        compiled.add(key(fn, types, constexprs))
    launched = set()
    for dtype, num_heads, kv_heads, dim in triton_sm90.DEVICE_SHAPES.values():
        for kv_dtype, extras in triton_sm90.POOLS[dtype]:
            kv = {dtype: name for name, dtype in KV_DTYPES.items()}.get(kv_dtype)
            for windowed, softcapped in extras:
                spies = spy_launches(monkeypatch)
                attend_once(kv_heads, num_heads // kv_heads, dim, dtype, kv, 8 if windowed else None,
                            30.0 if softcapped else None)  # fmt: skip
                monkeypatch.undo()
                launched |= {key(s.kernel, *launch) for s in spies.values() for launch in s.seen}
    assert len(launched) == len(compiled) == 16
    assert launched == compiled


@pytest.mark.timeout(660)  # the compiles' own limit is 600 s (below); under load they ran past pytest's 300 s cap
def test_every_kernel_compiles_for_sm_90(tmp_path):
    """The compiler's view, which the interpreter skips (tests/kv/triton_sm90.py): each kernel as its launcher
    launches it for the device shapes, down to an sm_90 cubin, in processes of its own with its own cache (no
    artefacts shared with another checkout)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PYTHONPATH": str(root)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, str(root / "tests" / "kv" / "triton_sm90.py")], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert len(lines) == (3 + 2 * 4 + 1) + (1 + 2 + 1)  # per device shape: stores, decode and prefill, the merge
    assert all(line.startswith("OK ") for line in lines), lines


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_store_rounds_ties_to_even_and_fp8_subnormals_as_the_pool_does(kv):
    """Rows whose scaled values sit on ties (int8: x.5) and in fp8's subnormal range (below 2^-6): the same bytes
    as `pool.write` (torch's rounding)."""
    dim = 64
    if kv == "int8":  # a largest value of 127: scale 1, the values as they are
        values = [127.0, 0.5, 1.5, 2.5, -2.5, 3.5, 126.5, -0.5]
    else:  # a largest value of 448: scale 1; subnormals are multiples of 2^-9
        values = [448.0] + [v * 2.0**-9 for v in (1.3, 2.7, 5.4, -1.3, 7.2, 0.5, 1.5)]
    row = torch.tensor(values * (dim // len(values)), dtype=torch.float32)
    key = row.view(1, 1, dim).to(DEVICE)
    ours, theirs = (make_pool(1, dim, torch.float32, kv, 4, 1) for _ in range(2))
    slots = torch.tensor([2], device=DEVICE)
    ta.store_kv(ours.k[0], ours.v[0], slots, key, key, quantized=True)
    theirs.write(0, slots, key, key)
    assert torch.equal(ours.k[0].view(torch.uint8)[:, 2], theirs.k[0].view(torch.uint8)[:, 2])


def test_products_are_full_fp32_for_fp32_models_on_a_gpu(monkeypatch):
    """tf32 would cost an fp32 model its precision: fp32 and fp64 take `ieee` products; 16-bit ones the MMA."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert ta._dot_f32(torch.float32)
    assert ta._dot_f32(torch.float64)
    assert not ta._dot_f32(torch.bfloat16)
    assert not ta._dot_f32(torch.float16)


def test_prefill_with_query_tiles_longer_than_key_tiles(monkeypatch):
    """A window narrower than a program's queries: some of a tile's rows see no key in its first key tiles (the
    softmax's guard keeps them finite)."""
    monkeypatch.setattr(ta, "PREFILL_BLOCK_M", 64)
    test_prefill_and_extend_match_float64(2, 2, 64, torch.float32, None, 20, None)


@pytest.mark.parametrize(
    ("dtype", "kv"), [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "int8"), (torch.float32, "fp8")]
)
def test_the_self_test_passes_where_the_kernels_work(dtype, kv):
    layout = KVLayout(2, 2, 64, dtype, KV_DTYPES[kv] if kv else None)
    assert ta.self_test(layout, 16, 4, DEVICE) is None


def test_the_self_test_says_what_failed(monkeypatch):
    layout = KVLayout(2, 2, 64, torch.float32)
    monkeypatch.setattr(ta, "decode", lambda *args, **kwargs: None)  # leaves its output zero: a wrong answer
    assert ta.self_test(layout, 16, 4, DEVICE).startswith("the decode kernel's answer is off by")
    monkeypatch.undo()

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(ta, "store_kv", no_compiler)
    assert ta.self_test(layout, 16, 4, DEVICE) == (
        "RuntimeError: Failed to find C compiler. Please specify via CC environment variable."
    )

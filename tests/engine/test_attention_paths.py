"""The attention backends: which one serves a model (one pure choice), and which path each row of a step takes in
it: the decode kernel, cascade heads, SDPA (the kernel backend), or one walk for every row (the tiled backend)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from server.engine import model_runner
from server.kv import backends, kernels
from server.kv.backends import BackendFacts, DecodeRow, StepRow, choose_backend
from server.kv.blocks import Block
from server.kv.routing import HEAD, KERNEL, SDPA
from server.models.loader import load_model
from tests.helpers import make_engine, reference_greedy, run, wait_until_async

TILED = kernels.paged_prefill_available(torch.bfloat16, 64)
needs_tiled = pytest.mark.skipif(not TILED, reason="no AVX512-BF16 build: bf16 pools take the kernel backend")


@pytest.fixture(scope="module")
def tiny32(tiny_spec):
    return load_model(dataclasses.replace(tiny_spec, dtype="float32"), Path("unused"))


def words(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


def spy_steps(runner, monkeypatch, record) -> None:
    """Calls record(rows, meta) with each step's plan."""
    prepare = runner._prepare

    def spy(rows):
        meta, *rest = prepare(rows)
        record(rows, meta)
        return (meta, *rest)

    monkeypatch.setattr(runner, "_prepare", spy)


# -- the choice ----------------------------------------------------------------------------------------------------
def facts(**changes) -> BackendFacts:
    base = BackendFacts("cpu", True, True, False, True, False)
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    ("changes", "backend"),
    [
        ({}, "tiled"),
        ({"deterministic": True}, "tiled"),  # the tiled walk is deterministic as it is
        ({"tiled_serves": False}, "kernel"),  # fp32, fp16, a head size other than 64 or 128, no AVX512-BF16
        ({"tiled_serves": False, "deterministic": True}, "kernel"),
        ({"is_quantized": True}, "kernel"),  # the walk reads bf16 keys; the kernel dequantizes 8-bit ones
        ({"plain_layers": False}, "kernel"),  # windows and softcaps: the decode kernel and SDPA honour them
        ({"has_kernels": False}, "sdpa"),  # no compiler here
        ({"device": "cuda"}, "sdpa"),  # no triton installed
        ({"device": "cuda", "has_triton": True}, "triton"),
        ({"device": "cuda", "has_triton": True, "deterministic": True, "is_quantized": True}, "triton"),
        ({"has_triton": True}, "tiled"),  # on a CPU triton runs only in its interpreter (tests)
        ({"device": "mps", "tiled_serves": False}, "sdpa"),
    ],
)
def test_one_pure_function_chooses_the_backend(changes, backend):
    assert choose_backend(facts(**changes)) == backend


def test_the_engine_runs_the_chosen_backend_and_says_so(tiny32, wide_heads_bf16, monkeypatch):
    for loaded, expected in ((tiny32, "kernel"), (wide_heads_bf16[0], "tiled" if TILED else "kernel")):
        engine = make_engine(loaded, budget_bytes=4 << 20)
        engine.stop()
        assert engine.runner.backend.name == expected
        assert engine.runner.facts.device == "cpu"
    monkeypatch.setattr(kernels, "paged_decode_available", lambda: False)
    engine = make_engine(tiny32, budget_bytes=4 << 20)
    engine.stop()
    assert engine.runner.backend.name == "sdpa"


# -- the kernel backend (fp32 here) ----------------------------------------------------------------------------------
async def test_short_and_long_rows_of_one_step_take_both_attention_paths(tiny32, monkeypatch):
    monkeypatch.setattr(backends, "KERNEL_MAX_CONTEXT", 24)  # the short prompts' rows: kernel; the long: SDPA
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    backend = engine.runner.backend
    if backend.name != "kernel":
        engine.stop()
        pytest.skip("no C++ compiler: every row is an SDPA call")
    backend.uses_heads = False  # else the long row reads its leading blocks as a head (tested below)
    backend.lone_rows = SDPA  # as where SDPA was timed fastest for a lone long row
    seen: list[tuple[int, int]] = []
    spy_steps(
        engine.runner,
        monkeypatch,
        lambda rows, meta: seen.append((0 if meta.decode is None else len(meta.decode.rows), len(meta.spans))),
    )
    prompts = [words(tiny32, "Paris is"), words(tiny32, "The quick brown fox jumps over the lazy dog. " * 4)]
    try:
        got = await asyncio.gather(
            *(run(engine, p, rid=f"r{i}", max_tokens=10, ignore_eos=True) for i, p in enumerate(prompts))
        )
    finally:
        engine.stop()
    assert any(kernel_rows and sdpa_rows for kernel_rows, sdpa_rows in seen)  # one step used both
    for prompt, result in zip(prompts, got, strict=True):
        assert result.token_ids == reference_greedy(tiny32.model, prompt, 10)


@pytest.mark.parametrize("gathered", [False, True], ids=["view", "gathered"])
async def test_rows_behind_one_cached_prefix_attend_to_it_in_one_call(tiny32, monkeypatch, gathered):
    """Cascade attention: decode rows sharing prefix blocks get one head; each row's ids stay HF generate()'s."""
    monkeypatch.setattr(backends, "KERNEL_MAX_CONTEXT", 8)  # every row here is long: heads or SDPA
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    backend = engine.runner.backend
    if backend.name != "kernel" or not backend.uses_heads:
        engine.stop()
        pytest.skip("no C++ compiler: every long row is an SDPA call")
    if gathered:  # as when the prefix's blocks are scattered: the head's keys are gathered by slot ids
        bs = backend.pool.block_size
        monkeypatch.setattr(backend, "_head_slots", lambda b: backend._long(backend.pool.slot_ids(b, 0, len(b) * bs)))
    heads: list[int] = []  # per head seen: how many rows shared it
    spy_steps(
        engine.runner,
        monkeypatch,
        lambda rows, meta: heads.extend(h.rows.numel() for h in meta.decode.heads) if meta.decode else None,
    )
    system = words(tiny32, "You are a terse assistant who answers in one word. " * 3)
    prompts = [system + words(tiny32, tail) for tail in ("Paris is", "Rome was", "The sea")]
    try:
        await run(engine, system, rid="warm", max_tokens=1)  # caches the shared prefix's blocks
        got = await asyncio.gather(
            *(run(engine, p, rid=f"r{i}", max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts))
        )
    finally:
        engine.stop()
    assert max(heads, default=0) == 3, heads  # the three conversations' rows shared one head
    for prompt, result in zip(prompts, got, strict=True):
        assert result.token_ids == reference_greedy(tiny32.model, prompt, 12)


async def test_a_lone_long_row_reads_its_leading_run_as_a_head(tiny32, monkeypatch):
    """A row sharing nothing: its leading run of consecutive blocks is its head, the scattered rest the kernel's."""
    monkeypatch.setattr(backends, "KERNEL_MAX_CONTEXT", 8)
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    backend = engine.runner.backend
    if backend.name != "kernel" or not backend.uses_heads:
        engine.stop()
        pytest.skip("no C++ compiler: every long row is an SDPA call")
    backend.lone_rows = HEAD  # as where a head was timed fastest for a lone long row
    lengths: list[int] = []
    spy_steps(
        engine.runner,
        monkeypatch,
        lambda rows, meta: lengths.extend(h.length for h in meta.decode.heads) if meta.decode else None,
    )
    # Two sequences decoding side by side take new blocks in turn: neither context stays one run of blocks.
    prompts = [words(tiny32, "The quick brown fox jumps over the lazy dog. " * 3), words(tiny32, "Paris is " * 9)]
    try:
        got = await asyncio.gather(
            *(run(engine, p, rid=f"r{i}", max_tokens=16, ignore_eos=True) for i, p in enumerate(prompts))
        )
    finally:
        engine.stop()
    assert lengths, "no decode step took a head"
    assert min(lengths) >= 8, lengths
    for prompt, result in zip(prompts, got, strict=True):
        assert result.token_ids == reference_greedy(tiny32.model, prompt, 16)


def decode_row(at: int, table: list[int], ctx_len: int) -> DecodeRow:
    """A decode row on these blocks (each with its stamp: the contents it was handed out for)."""
    return DecodeRow(at, table, ctx_len, [Block(i, stamp=1000 + i) for i in table])


def kernel_backend(tiny32):
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    engine.stop()
    if engine.runner.backend.name != "kernel":
        pytest.skip("no C++ compiler: every row is an SDPA call")
    return engine.runner.backend


def test_heads_group_rows_by_their_shared_blocks(tiny32):
    """Routing: shared full blocks make one head, a lone row's consecutive run its own, a long tail goes to SDPA."""
    backend, Row = kernel_backend(tiny32), decode_row
    backend.lone_rows = SDPA  # as where SDPA on a view was timed fastest for a lone long row
    k = backends.KERNEL_MAX_CONTEXT
    shared = [90, 7, 3, 50] * (k // 16 + 1)  # scattered blocks, 4 keys each: more keys than the kernel takes
    a = Row(0, [*shared, 11, 12], len(shared) * 4 + 5)
    b = Row(1, [*shared, 13], len(shared) * 4 + 2)
    lone = Row(2, [*range(200, 200 + 2 * k // 4), 5], 2 * k + 3)
    too_long = Row(3, [60, *range(300, 300 + k // 2)], 4 + k * 2 + 1)  # a 4-key run, then k * 2 keys
    one_run = Row(4, list(range(400, 400 + k // 2)), k * 2)  # SDPA on a view beats a head here
    heads, taken = backend._heads([a, b, lone, too_long, one_run])
    assert taken == [a, b, lone]
    assert [h.rows.tolist() for h in heads] == [[0, 1], [2]]
    assert [h.length for h in heads] == [len(shared) * 4, 2 * k]
    assert heads[0].slots is not None
    assert heads[1].slots is None
    assert heads[1].first_slot == 200 * 4
    assert (a.head, b.head, lone.head, too_long.head, one_run.head) == (len(shared) * 4, len(shared) * 4, 2 * k, 0, 0)


def test_a_decode_row_of_kernel_max_context_keys_is_the_kernels_and_one_more_is_long(tiny32):
    """docs/architecture.md: a single-token row whose context is at most KERNEL_MAX_CONTEXT keys goes to the decode
    kernel; one key more and it is a long row (here, where SDPA was timed fastest and no heads are taken: SDPA on a
    view of its one run of blocks)."""
    backend = kernel_backend(tiny32)
    backend.lone_rows, backend.uses_heads = SDPA, False
    k, bs = backends.KERNEL_MAX_CONTEXT, backend.pool.block_size

    def row(at: int, first: int, ctx_len: int) -> StepRow:
        table = list(range(first, first + -(-ctx_len // bs)))
        return StepRow(at, 1, ctx_len, table, [Block(i, stamp=1000 + i) for i in table])

    meta = backend.plan([row(0, 0, k), row(1, 100, k + 1)], torch.zeros(2, dtype=torch.long))
    assert meta.decode is not None
    assert meta.decode.rows.tolist() == [0]
    assert meta.decode.context_lens.tolist() == [k]
    assert [(span.q_start, span.ctx_len) for span in meta.spans] == [(1, k + 1)]


def lone_rows_case():
    """A shared pair, a lone row on scattered blocks and a lone row on one run of blocks, all long."""
    Row, k = decode_row, backends.KERNEL_MAX_CONTEXT
    shared = [90, 7, 3, 50] * (k // 16 + 1)
    a = Row(0, [*shared, 11, 12], len(shared) * 4 + 5)
    b = Row(1, [*shared, 13], len(shared) * 4 + 2)
    lone = Row(2, [*range(200, 200 + 2 * k // 4), 5], 2 * k + 3)
    one_run = Row(3, list(range(400, 400 + k // 2)), k * 2)
    return a, b, lone, one_run


@pytest.mark.parametrize("way", ["kernel", "head"])
def test_lone_long_rows_go_the_way_timed_fastest(tiny32, way):
    """Timed fastest, the kernel takes lone rows whole (no head, no SDPA); heads take even a one-run row's lead."""
    backend = kernel_backend(tiny32)
    backend.lone_rows = way
    a, b, lone, one_run = lone_rows_case()
    _heads, taken = backend._heads([a, b, lone, one_run])
    k = backends.KERNEL_MAX_CONTEXT
    if way == "kernel":
        assert taken == [a, b]  # rows that share blocks still share a head
        assert (lone.head, one_run.head) == (0, 0)
    else:
        assert taken == [a, b, lone, one_run]
        assert (lone.head, one_run.head) == (2 * k, 2 * k - 4)  # whole blocks before the row's own token


async def test_a_lone_row_on_one_run_of_blocks_goes_to_sdpa_only_where_sdpa_was_fastest(tiny32, monkeypatch):
    monkeypatch.setattr(backends, "KERNEL_MAX_CONTEXT", 8)
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    backend = engine.runner.backend
    if backend.name != "kernel":
        engine.stop()
        pytest.skip("no C++ compiler: every row is an SDPA call")
    # Each alone, sharing no prefix with the other: its blocks are one run.
    prompts = {
        SDPA: words(tiny32, "The quick brown fox jumps over the lazy dog. " * 3),
        KERNEL: words(tiny32, "Paris is the capital of France, and Rome of Italy. " * 3),
    }
    decode_paths: dict[str, set[str]] = {}

    def record(rows, meta):
        if len(rows) == 1 and len(rows[0].token_ids) == 1:
            decode_paths.setdefault(backend.lone_rows, set()).add("kernel" if meta.decode else "sdpa")

    spy_steps(engine.runner, monkeypatch, record)
    try:
        for way, prompt in prompts.items():
            backend.lone_rows = way
            result = await run(engine, prompt, rid=way, max_tokens=6, ignore_eos=True)
            assert result.token_ids == reference_greedy(tiny32.model, prompt, 6)
    finally:
        engine.stop()
    assert decode_paths == {"sdpa": {"sdpa"}, "kernel": {"kernel"}}


def test_timing_a_lone_row_picks_the_fastest_way(tiny32, monkeypatch):
    """The start-up timing runs each way on the pool (the head only where there is one); the backend takes the
    least time's way."""
    from server.kv import routing

    fake = {routing.KERNEL: 3.0, routing.SDPA: 2.0, routing.HEAD: 1.0}
    timed: list[str] = []

    def best_us(fn):
        fn()
        way = list(fake)[len(timed) % len(fake)]
        timed.append(way)
        return fake[way]

    monkeypatch.setattr(routing, "_best_us", best_us)
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    engine.stop()
    if engine.runner.backend.name != "kernel":
        pytest.skip("no C++ compiler: no choice to make")
    assert timed == [routing.KERNEL, routing.SDPA, routing.HEAD]
    assert engine.runner.backend.lone_rows == routing.HEAD
    fake[routing.KERNEL] = 0.5
    route = routing.time_lone_row(engine.runner.pool, int(tiny32.model.config.num_attention_heads))
    assert route.way == routing.KERNEL
    assert "kernel 0 us" in route.describe
    assert "head 1 us" in route.describe


# -- the tiled backend (bf16, head size 64) ----------------------------------------------------------------------------
def close_to_float64(loaded, directory, prompts, results) -> float:
    """The worst gap between each decoded token's log-probability and float64's over the same ids."""
    from transformers import LlamaForCausalLM

    exact = LlamaForCausalLM.from_pretrained(directory).to(torch.bfloat16).to(torch.float64)  # bf16 weights, in fp64
    worst = 0.0
    for prompt, result in zip(prompts, results, strict=True):
        ids = prompt + result.token_ids
        with torch.inference_mode():
            want = torch.log_softmax(exact(torch.tensor([ids[:-1]])).logits[0, len(prompt) - 1 :], -1)
        for step, lp in enumerate(result.logprobs):
            worst = max(worst, abs(lp.logprob - float(want[step, lp.token_id])))
    return worst


@needs_tiled
async def test_prefill_chunks_of_one_step_go_to_the_prefill_kernel_in_one_call(wide_heads_bf16, monkeypatch):
    """Two prompts prefilled side by side in chunks, later chunks reading earlier ones' K/V through the table: the
    first token's log-probabilities are as close to float64's as the SDPA path's (greedy ids may part later: bf16
    rounds differently on each path, as it does between batch neighbours)."""
    loaded, directory = wide_heads_bf16
    prompts = [
        words(loaded, "The quick brown fox jumps over the lazy dog. " * 6),
        words(loaded, "Paris is the capital of France; Berlin is the capital of Germany. " * 3),
    ]
    errors: dict[bool, float] = {}
    chunks_seen: dict[bool, list[int]] = {}
    behind: list[int] = []  # keys before a chunk's own tokens, per chunk the kernel took
    for use_kernel in (True, False):
        engine = make_engine(loaded, budget_bytes=4 << 20, block_size=4, max_batch_tokens=8)
        engine.runner.backend.chunks_by_kernel = use_kernel
        seen = chunks_seen.setdefault(use_kernel, [])

        def record(rows, meta, seen=seen):
            seen.append(0 if meta.prefill is None else meta.prefill.q_starts.numel())
            if meta.prefill is not None:
                behind.extend((meta.prefill.context_lens - meta.prefill.q_lens).tolist())

        spy_steps(engine.runner, monkeypatch, record)
        try:
            got = await asyncio.gather(
                *(run(engine, p, rid=f"r{i}", max_tokens=1, num_logprobs=5) for i, p in enumerate(prompts))
            )
        finally:
            engine.stop()
        errors[use_kernel] = close_to_float64(loaded, directory, prompts, got)
    assert max(chunks_seen[True]) == 2  # both prompts' chunks in one call
    assert max(behind) > 0  # and chunks that read earlier chunks' K/V from the pool
    assert max(chunks_seen[False]) == 0  # SDPA: spans
    assert errors[True] < 0.5, errors  # a chunk that missed its earlier keys is off by units
    assert errors[True] <= 2 * errors[False] + 0.05, errors


@needs_tiled
async def test_every_decode_row_of_a_step_walks_in_one_call_close_to_float64(wide_heads_bf16, monkeypatch):
    """Short and long decode rows alike, on blocks scattered by neighbours: one call of the walk per step."""
    loaded, directory = wide_heads_bf16
    prompts = [words(loaded, "Paris is"), words(loaded, "The quick brown fox jumps over the lazy dog. " * 12)]
    decode_rows: list[int] = []  # per step: decode rows in the walk's call (-1: a decode row went to SDPA)
    engine = make_engine(loaded, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    spy_steps(
        engine.runner,
        monkeypatch,
        lambda rows, meta: decode_rows.append(
            -1 if any(s.q_len == 1 for s in meta.spans) else (0 if meta.decode is None else meta.decode.rows.numel())
        ),
    )
    try:
        got = await asyncio.gather(
            *(run(engine, p, rid=f"r{i}", max_tokens=8, ignore_eos=True, num_logprobs=1) for i, p in enumerate(prompts))
        )
    finally:
        engine.stop()
    assert -1 not in decode_rows  # no SDPA span: the walk took every row
    assert max(decode_rows) == 2  # both prompts' decode rows (one of 600 keys, one of a few) in one call
    assert close_to_float64(loaded, directory, prompts, got) < 0.5


async def tiled_rows_behind_a_prefix(loaded, monkeypatch, *, head_min_keys: int, keep_layouts: bool = True):
    """Three conversations behind one cached 600-token prompt, decoded together: their results, and per step the
    heads seen (rows sharing each, its keys, whether kept laid out), the layouts made and whether they were dropped
    once the engine had nothing to run."""
    monkeypatch.setattr(backends, "TILED_HEAD_MIN_KEYS", head_min_keys)
    system = words(loaded, "You are a terse assistant who answers in one word. " * 16)
    prompts = [system + words(loaded, tail) for tail in ("Paris is", "Rome was", "The sea")]
    # deterministic: rows batched however the steps fall, chunks by the walk (not by what timing at start chose)
    engine = make_engine(loaded, budget_bytes=8 << 20, block_size=4, max_batch_tokens=256, deterministic=True)
    backend = engine.runner.backend
    if not keep_layouts:
        backend.head_layouts.limit_bytes = 0  # nothing fits: each call lays its head out
    heads: list[tuple[int, int, bool]] = []
    spy_steps(
        engine.runner,
        monkeypatch,
        lambda rows, meta: heads.extend(
            (h.rows.numel(), h.length, h.laid_out is not None) for h in (meta.decode.heads if meta.decode else [])
        ),
    )
    try:
        await run(engine, system, rid="warm", max_tokens=1)  # caches the shared prefix's blocks
        before = backend.head_layouts.num_made
        results = await asyncio.gather(
            *(run(engine, p, rid=f"r{i}", max_tokens=6, num_logprobs=2) for i, p in enumerate(prompts))
        )
        made = backend.head_layouts.num_made - before
        layouts = backend.head_layouts
        await wait_until_async(lambda: layouts.num_kept == 0, what="the kept layouts dropped when idle")
    finally:
        engine.stop()
    return prompts, results, heads, made


def same_answers(a, b) -> bool:
    def exact(result):
        return result.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in result.logprobs]

    return [exact(x) for x in a] == [exact(y) for y in b]


@needs_tiled
async def test_rows_behind_a_cached_prefix_share_a_head_and_answer_bit_for_bit_as_without(wide_heads_bf16, monkeypatch):
    """Cascade heads in the walk: the rows' shared prefix is walked once for all of them, to a partition edge (256
    keys), and each row resumes from there; every token and log-probability is exactly the one walking alone gives,
    kept laid out across steps (one layout per layer) or laid out on each call."""
    loaded, directory = wide_heads_bf16
    prompts, kept, heads, made = await tiled_rows_behind_a_prefix(loaded, monkeypatch, head_min_keys=256)
    _, per_call, heads_per_call, made_per_call = await tiled_rows_behind_a_prefix(
        loaded, monkeypatch, head_min_keys=256, keep_layouts=False
    )
    _, alone, no_heads, _ = await tiled_rows_behind_a_prefix(loaded, monkeypatch, head_min_keys=1 << 30)
    shared_heads = [h for h in heads if h[0] > 1]
    assert len(shared_heads) >= 3, heads  # the head served several steps ...
    assert {rows for rows, _, _ in shared_heads} == {3}  # ... of the three rows
    assert all(keys % 256 == 0 and keys >= 256 for _, keys, _ in heads)
    assert all(laid_out for _, _, laid_out in heads)
    assert made == loaded.model.config.num_hidden_layers  # laid out once per layer, then kept
    assert made_per_call == 0
    assert heads_per_call
    assert not any(laid_out for _, _, laid_out in heads_per_call)
    assert not no_heads
    assert same_answers(kept, alone)
    assert same_answers(per_call, alone)
    monkeypatch.setattr(kernels, "paged_decode_available", lambda: False)  # the same turns, every row by SDPA
    sdpa = make_engine(loaded, budget_bytes=8 << 20, block_size=4)
    try:
        assert sdpa.runner.backend.name == "sdpa"
        by_sdpa = await asyncio.gather(
            *(run(sdpa, p, rid=f"s{i}", max_tokens=6, num_logprobs=2) for i, p in enumerate(prompts))
        )
    finally:
        sdpa.stop()
    error, sdpa_error = (close_to_float64(loaded, directory, prompts, got) for got in (kept, by_sdpa))
    assert error <= 2 * sdpa_error + 0.05, (error, sdpa_error)  # bf16's own distance from float64, not more


def test_tiled_heads_take_rows_sharing_enough_whole_walk_steps(wide_heads_bf16):
    """Routing: rows sharing blocks make a head of their common keys cut to a partition edge (and never their own
    token's), when that is at least TILED_HEAD_MIN_KEYS; a lone row walks alone; layouts are keyed by stamps."""
    if not TILED:
        pytest.skip("no AVX512-BF16 build")
    engine = make_engine(wide_heads_bf16[0], budget_bytes=8 << 20, block_size=4)
    engine.stop()
    backend, Row = engine.runner.backend, decode_row
    shared = list(range(100, 100 + 75))  # 300 keys: a head of 256
    a = Row(0, [*shared, 11], 303)
    b = Row(1, [*shared, 12, 13], 305)
    short = [Row(2, [*shared[:60], 14], 242), Row(3, [*shared[:60], 15], 242)]  # 240 shared: not enough
    lone = Row(4, list(range(300, 400)), 400)
    heads, taken = backend._heads([a, *short, b, lone])
    assert taken == [a, b]
    assert [(h.rows.tolist(), h.length) for h in heads] == [([0, 1], 256)]
    assert heads[0].blocks.tolist() == shared[:64]
    assert (a.head, b.head, short[0].head, lone.head) == (256, 256, 0, 0)
    again, _ = backend._heads([Row(0, [*shared, 11], 303), Row(1, [*shared, 12], 303)])
    assert again[0].laid_out is heads[0].laid_out  # same blocks, same stamps: the kept layout
    restamped = [DecodeRow(0, [*shared, 11], 303, [Block(i, stamp=9000 + i) for i in [*shared, 11]])] * 2
    other, _ = backend._heads(restamped)
    assert other[0].laid_out is not heads[0].laid_out  # the blocks were handed out again: a new layout
    backend.rest()
    assert backend.head_layouts.num_kept == 0


def wide_family(family: str, directory: Path):
    """A tiny model of `family` in bf16 with head size 64 (shapes the prefill kernel serves): Mistral with a window
    shorter than the prompts, or Gemma-2 with soft-capped scores and alternating windowed layers."""
    from transformers import AutoModelForCausalLM, Gemma2Config, MistralConfig

    from server.models.loader import ModelSpec
    from tests.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    shape = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, vocab_size=len(tokenizer), initializer_range=0.2)
    if family == "window":
        config = MistralConfig(**shape, sliding_window=6)
    else:
        config = Gemma2Config(
            **shape, head_dim=64, sliding_window=6, attn_logit_softcapping=1.0, final_logit_softcapping=None
        )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return load_model(ModelSpec(id=family, source=str(directory), dtype="bfloat16", device="cpu"), directory)


@pytest.mark.parametrize("family", ["window", "softcap"])
async def test_prefill_chunks_over_an_8_bit_pool_with_windows_or_softcaps_are_spans(family, tmp_path, monkeypatch):
    """The prefill kernel has neither window nor softcap: on an 8-bit pool too, such layers' chunks are spans,
    which honour both (on a plain model's 8-bit pool the kernel takes them: tests/kv/test_quantized_kv.py)."""
    if not kernels.paged_prefill_available(torch.bfloat16, 64):
        pytest.skip("no AVX512-BF16 build: prefill chunks are spans anyway")
    loaded = wide_family(family, tmp_path)
    engine = make_engine(loaded, budget_bytes=4 << 20, block_size=4, max_batch_tokens=8, kv_dtype="int8")
    assert engine.runner.layout.is_quantized
    assert engine.runner.backend.name == "kernel"
    assert not engine.runner.backend.chunks_by_kernel
    chunks: list[tuple[int, int]] = []  # per step: (chunks for the prefill kernel, spans)
    prepare = engine.runner._prepare

    def spy(rows):
        meta, *rest = prepare(rows)
        if any(len(r.token_ids) > 1 for r in rows):
            chunks.append((0 if meta.prefill is None else meta.prefill.q_starts.numel(), len(meta.spans)))
        return (meta, *rest)

    monkeypatch.setattr(engine.runner, "_prepare", spy)
    try:
        result = await run(engine, words(loaded, "The quick brown fox jumps over the lazy dog. " * 8), max_tokens=2)
    finally:
        engine.stop()
    assert result.error is None
    assert len(chunks) > 2  # the prompt, in chunks of 8 tokens
    assert all(by_kernel == 0 and spans == 1 for by_kernel, spans in chunks), chunks


async def test_rows_behind_one_cached_prefix_of_an_8_bit_pool_take_no_head(tiny, monkeypatch):
    """Cascade heads read the pool's rows as they are (flash attention, or the kernel's layout): never an 8-bit
    pool's, whose rows each kernel row dequantizes as it reads them. Every long decode row goes to the kernel
    whole, and each conversation's ids are those it gets alone on a fresh 8-bit pool."""
    monkeypatch.setattr(backends, "KERNEL_MAX_CONTEXT", 8)  # every decode row here is long: heads, were they used
    engine = make_engine(tiny, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256, kv_dtype="int8")
    if engine.runner.backend.name != "kernel":
        engine.stop()
        pytest.skip("no C++ compiler: every row is an SDPA call")
    assert not engine.runner.backend.uses_heads
    steps: list[tuple[int, int, int]] = []  # decode-only steps: (heads, kernel rows, spans)
    prepare = engine.runner._prepare

    def spy(rows):
        meta, *rest = prepare(rows)
        if all(len(r.token_ids) == 1 for r in rows):
            decode = meta.decode
            heads, kernel_rows = (0, 0) if decode is None else (len(decode.heads), decode.rows.numel())
            steps.append((heads, kernel_rows, len(meta.spans)))
        return (meta, *rest)

    monkeypatch.setattr(engine.runner, "_prepare", spy)
    system = words(tiny, "You are a terse assistant who answers in one word. " * 3)
    prompts = [system + words(tiny, tail) for tail in ("Paris is", "Rome was", "The sea")]
    fresh = make_engine(tiny, budget_bytes=4 << 20, block_size=4, kv_dtype="int8")
    try:
        await run(engine, system, rid="warm", max_tokens=1)  # caches the shared prefix's blocks
        got = await asyncio.gather(
            *(run(engine, p, rid=f"r{i}", max_tokens=8, ignore_eos=True) for i, p in enumerate(prompts))
        )
        alone = [await run(fresh, p, max_tokens=8, ignore_eos=True, use_cache=False) for p in prompts]
    finally:
        engine.stop()
        fresh.stop()
    assert max(rows for _, rows, _ in steps) == 3  # the three conversations decoded side by side ...
    assert all(heads == 0 and spans == 0 for heads, _, spans in steps), steps  # ... every row by the kernel, whole
    for result, reference in zip(got, alone, strict=True):
        assert result.token_ids == reference.token_ids


@pytest.mark.parametrize("way", [KERNEL, SDPA])
async def test_prefill_chunks_go_the_way_timed_faster_at_start(wide_heads_bf16, monkeypatch, way):
    """Where the prefill kernel serves the pool (the tiled backend, out of deterministic mode), chunks go the way the
    start-up timing found faster."""
    from server.kv.routing import PrefillRoute

    if not kernels.paged_prefill_available(torch.bfloat16, 64):
        pytest.skip("no AVX512-BF16 build: prefill chunks are spans, nothing is timed")
    timed: list[str] = []

    def time_prefill(pool, num_heads):
        timed.append(way)
        other = SDPA if way == KERNEL else KERNEL
        return PrefillRoute(way, {way: 1.0, other: 2.0})

    monkeypatch.setattr(model_runner, "time_prefill", time_prefill)
    loaded, _ = wide_heads_bf16
    engine = make_engine(loaded, budget_bytes=4 << 20, block_size=4, max_batch_tokens=8)
    calls: list[int] = []  # steps with chunks: how many the prefill kernel took
    prepare = engine.runner._prepare

    def spy(rows):
        meta, *rest = prepare(rows)
        if any(len(r.token_ids) > 1 for r in rows):
            calls.append(0 if meta.prefill is None else meta.prefill.q_starts.numel())
        return (meta, *rest)

    monkeypatch.setattr(engine.runner, "_prepare", spy)
    try:
        result = await run(engine, words(loaded, "The quick brown fox jumps over the lazy dog. " * 8), max_tokens=1)
    finally:
        engine.stop()
    assert timed == [way]
    assert engine.runner.backend.chunks_by_kernel == (way == KERNEL)
    assert result.error is None
    assert len(calls) > 2
    assert all(n == (1 if way == KERNEL else 0) for n in calls), calls

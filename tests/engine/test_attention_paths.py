"""Which attention path a decode row takes: the paged kernel (one call for the short rows) or SDPA (each longer one)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from server.engine import model_runner
from server.kv import kernels
from server.kv.blocks import Block
from server.models.loader import load_model
from tests.helpers import make_engine, reference_greedy, run, wait_until_async


@pytest.fixture(scope="module")
def tiny32(tiny_spec):
    return load_model(dataclasses.replace(tiny_spec, dtype="float32"), Path("unused"))


def words(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


async def test_short_and_long_rows_of_one_step_take_both_attention_paths(tiny32, monkeypatch):
    monkeypatch.setattr(model_runner, "KERNEL_MAX_CONTEXT", 24)  # the short prompts' rows: kernel; the long: SDPA
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    if not engine.runner.uses_kernel:
        engine.stop()
        pytest.skip("no C++ compiler: every row is an SDPA call")
    engine.runner.uses_heads = False  # else the long row reads its leading blocks as a head (tested below)
    engine.runner.lone_rows = model_runner.SDPA  # as where SDPA was timed fastest for a lone long row
    seen: list[tuple[int, int]] = []
    prepare = engine.runner._prepare

    def spy(rows):
        meta, *rest = prepare(rows)
        seen.append((0 if meta.decode is None else len(meta.decode.rows), len(meta.spans)))
        return (meta, *rest)

    monkeypatch.setattr(engine.runner, "_prepare", spy)
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
    monkeypatch.setattr(model_runner, "KERNEL_MAX_CONTEXT", 8)  # every row here is long: heads or SDPA
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    if not engine.runner.uses_heads:
        engine.stop()
        pytest.skip("no C++ compiler: every long row is an SDPA call")
    if gathered:  # as when the prefix's blocks are scattered: the head's keys are gathered by slot ids
        runner, bs = engine.runner, engine.runner.pool.block_size
        monkeypatch.setattr(runner, "_head_slots", lambda b: runner._long(runner.pool.slot_ids(b, 0, len(b) * bs)))
    heads: list[list[int]] = []  # per head seen: how many rows shared it
    prepare = engine.runner._prepare

    def spy(rows):
        meta, *rest = prepare(rows)
        if meta.decode is not None:
            heads.extend([head.rows.numel() for head in meta.decode.heads])
        return (meta, *rest)

    monkeypatch.setattr(engine.runner, "_prepare", spy)
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
    monkeypatch.setattr(model_runner, "KERNEL_MAX_CONTEXT", 8)
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    if not engine.runner.uses_heads:
        engine.stop()
        pytest.skip("no C++ compiler: every long row is an SDPA call")
    engine.runner.lone_rows = model_runner.HEAD  # as where a head was timed fastest for a lone long row
    lengths: list[int] = []
    prepare = engine.runner._prepare

    def spy(rows):
        meta, *rest = prepare(rows)
        if meta.decode is not None:
            lengths.extend(head.length for head in meta.decode.heads)
        return (meta, *rest)

    monkeypatch.setattr(engine.runner, "_prepare", spy)
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


def decode_row(at: int, table: list[int], ctx_len: int) -> model_runner.DecodeRow:
    """A decode row on these blocks (each with its stamp: the contents it was handed out for)."""
    return model_runner.DecodeRow(at, table, ctx_len, [Block(i, stamp=1000 + i) for i in table])


def test_heads_group_rows_by_their_shared_blocks(tiny32):
    """Routing: shared full blocks make one head, a lone row's consecutive run its own, a long tail goes to SDPA."""
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    engine.stop()
    runner, Row = engine.runner, decode_row
    runner.lone_rows = model_runner.SDPA  # as where SDPA on a view was timed fastest for a lone long row
    k = model_runner.KERNEL_MAX_CONTEXT
    shared = [90, 7, 3, 50] * (k // 16 + 1)  # scattered blocks, 4 keys each: more keys than the kernel takes
    a = Row(0, [*shared, 11, 12], len(shared) * 4 + 5)
    b = Row(1, [*shared, 13], len(shared) * 4 + 2)
    lone = Row(2, [*range(200, 200 + 2 * k // 4), 5], 2 * k + 3)
    too_long = Row(3, [60, *range(300, 300 + k // 2)], 4 + k * 2 + 1)  # a 4-key run, then k * 2 keys
    one_run = Row(4, list(range(400, 400 + k // 2)), k * 2)  # SDPA on a view beats a head here
    heads, taken = runner._heads([a, b, lone, too_long, one_run])
    assert taken == [a, b, lone]
    assert [h.rows.tolist() for h in heads] == [[0, 1], [2]]
    assert [h.length for h in heads] == [len(shared) * 4, 2 * k]
    assert heads[0].slots is not None
    assert heads[1].slots is None
    assert heads[1].first_slot == 200 * 4
    assert (a.head, b.head, lone.head, too_long.head, one_run.head) == (len(shared) * 4, len(shared) * 4, 2 * k, 0, 0)


def test_a_head_keeps_its_layout_while_its_blocks_keep_their_stamps(tiny32):
    """The runner keys a kept layout by its blocks' stamps: the same blocks handed out again (new stamps) get a
    new layout, and a step without the head drops it."""
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    engine.stop()
    runner = engine.runner
    runner.prefill_kernel = True  # heads of several rows go to the kernel (routing only: nothing runs here)
    k = model_runner.KERNEL_MAX_CONTEXT
    shared = list(range(10, 10 + k // 4 + 2))

    def pair(stamp_base: int) -> list[model_runner.DecodeRow]:
        blocks = [Block(i, stamp=stamp_base + i) for i in shared]
        rows = [
            model_runner.DecodeRow(at, [*shared, 90 + at], len(shared) * 4 + 3, [*blocks, Block(90 + at)])
            for at in (0, 1)
        ]
        return rows

    (first,), _ = runner._heads(pair(1000))
    (again,), _ = runner._heads(pair(1000))
    (reused,), _ = runner._heads(pair(5000))
    assert first.laid_out is not None
    assert again.laid_out is first.laid_out
    assert reused.laid_out is not first.laid_out
    runner._heads([])
    assert runner.head_layouts.num_kept == 0


def lone_rows_case(runner):
    """A shared pair, a lone row on scattered blocks and a lone row on one run of blocks, all long."""
    Row, k = decode_row, model_runner.KERNEL_MAX_CONTEXT
    shared = [90, 7, 3, 50] * (k // 16 + 1)
    a = Row(0, [*shared, 11, 12], len(shared) * 4 + 5)
    b = Row(1, [*shared, 13], len(shared) * 4 + 2)
    lone = Row(2, [*range(200, 200 + 2 * k // 4), 5], 2 * k + 3)
    one_run = Row(3, list(range(400, 400 + k // 2)), k * 2)
    return a, b, lone, one_run


@pytest.mark.parametrize("way", ["kernel", "head"])
def test_lone_long_rows_go_the_way_timed_fastest(tiny32, way):
    """Timed fastest, the kernel takes lone rows whole (no head, no SDPA); heads take even a one-run row's lead."""
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    engine.stop()
    runner = engine.runner
    if not runner.uses_heads:
        pytest.skip("no C++ compiler: every long row is an SDPA call")
    runner.lone_rows = way
    a, b, lone, one_run = lone_rows_case(runner)
    _heads, taken = runner._heads([a, b, lone, one_run])
    k = model_runner.KERNEL_MAX_CONTEXT
    if way == "kernel":
        assert taken == [a, b]  # rows that share blocks still share a head
        assert (lone.head, one_run.head) == (0, 0)
    else:
        assert taken == [a, b, lone, one_run]
        assert (lone.head, one_run.head) == (2 * k, 2 * k - 4)  # whole blocks before the row's own token


async def test_a_lone_row_on_one_run_of_blocks_goes_to_sdpa_only_where_sdpa_was_fastest(tiny32, monkeypatch):
    monkeypatch.setattr(model_runner, "KERNEL_MAX_CONTEXT", 8)
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    if not engine.runner.uses_kernel:
        engine.stop()
        pytest.skip("no C++ compiler: every row is an SDPA call")
    # Each alone, sharing no prefix with the other: its blocks are one run.
    prompts = {
        model_runner.SDPA: words(tiny32, "The quick brown fox jumps over the lazy dog. " * 3),
        model_runner.KERNEL: words(tiny32, "Paris is the capital of France, and Rome of Italy. " * 3),
    }
    decode_paths: dict[str, set[str]] = {}
    prepare = engine.runner._prepare

    def spy(rows):
        meta, *rest = prepare(rows)
        if len(rows) == 1 and len(rows[0].token_ids) == 1:
            decode_paths.setdefault(engine.runner.lone_rows, set()).add("kernel" if meta.decode else "sdpa")
        return (meta, *rest)

    monkeypatch.setattr(engine.runner, "_prepare", spy)
    try:
        for way, prompt in prompts.items():
            engine.runner.lone_rows = way
            result = await run(engine, prompt, rid=way, max_tokens=6, ignore_eos=True)
            assert result.token_ids == reference_greedy(tiny32.model, prompt, 6)
    finally:
        engine.stop()
    assert decode_paths == {"sdpa": {"sdpa"}, "kernel": {"kernel"}}


def test_timing_a_lone_row_picks_the_fastest_way(tiny32, monkeypatch):
    """The start-up timing runs each way on the pool (the head only where there is one); the runner takes the
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
    if not engine.runner.uses_kernel:
        pytest.skip("no C++ compiler: no choice to make")
    assert timed == [routing.KERNEL, routing.SDPA, routing.HEAD]
    assert engine.runner.lone_rows == routing.HEAD
    fake[routing.KERNEL] = 0.5
    route = routing.time_lone_row(engine.runner.pool, int(tiny32.model.config.num_attention_heads))
    assert route.way == routing.KERNEL
    assert "kernel 0 us" in route.describe
    assert "head 1 us" in route.describe


async def test_prefill_chunks_of_one_step_go_to_the_prefill_kernel_in_one_call(wide_heads_bf16, monkeypatch):
    """Two prompts prefilled side by side in chunks, later chunks reading earlier ones' K/V through the table: the
    first token's log-probabilities are as close to float64's as the SDPA path's (greedy ids may part later: bf16
    rounds differently on each path, as it does between batch neighbours)."""
    from transformers import LlamaForCausalLM

    loaded, directory = wide_heads_bf16
    prompts = [
        words(loaded, "The quick brown fox jumps over the lazy dog. " * 6),
        words(loaded, "Paris is the capital of France; Berlin is the capital of Germany. " * 3),
    ]
    exact = LlamaForCausalLM.from_pretrained(directory).to(torch.bfloat16).to(torch.float64)  # bf16 weights, in fp64
    with torch.inference_mode():
        want = [torch.log_softmax(exact(torch.tensor([p])).logits[0, -1], -1) for p in prompts]
    errors: dict[bool, float] = {}
    chunks_seen: dict[bool, list[int]] = {}
    behind: list[int] = []  # keys before a chunk's own tokens, per chunk the kernel took
    for use_kernel in (True, False):
        engine = make_engine(loaded, budget_bytes=4 << 20, block_size=4, max_batch_tokens=8)
        if not kernels.paged_prefill_available(torch.bfloat16, 64):
            engine.stop()
            pytest.skip("no AVX512-BF16 build: prefill chunks use SDPA")
        engine.runner.prefill_kernel = use_kernel
        seen = chunks_seen.setdefault(use_kernel, [])
        prepare = engine.runner._prepare

        def spy(rows, prepare=prepare, seen=seen):
            meta, *rest = prepare(rows)
            seen.append(0 if meta.prefill is None else meta.prefill.q_starts.numel())
            if meta.prefill is not None:
                behind.extend((meta.prefill.context_lens - meta.prefill.q_lens).tolist())
            return (meta, *rest)

        monkeypatch.setattr(engine.runner, "_prepare", spy)
        try:
            got = await asyncio.gather(
                *(run(engine, p, rid=f"r{i}", max_tokens=1, num_logprobs=5) for i, p in enumerate(prompts))
            )
        finally:
            engine.stop()
        errors[use_kernel] = max(
            abs(logprob - float(reference[token]))
            for result, reference in zip(got, want, strict=True)
            for token, logprob in result.logprobs[0].top
        )
        for result, reference in zip(got, want, strict=True):
            assert result.token_ids == [int(reference.argmax())]
    assert max(chunks_seen[True]) == 2  # both prompts' chunks in one call
    assert max(behind) > 0  # and chunks that read earlier chunks' K/V from the pool
    assert max(chunks_seen[False]) == 0  # the SDPA path: spans
    assert errors[True] < 0.5, errors  # a chunk that missed its earlier keys is off by units
    assert errors[True] <= 2 * errors[False] + 0.05, errors


async def test_rows_behind_one_cached_prefix_read_it_through_the_kernel_as_exactly_as_through_flash(
    wide_heads_bf16, monkeypatch
):
    """Cascade heads by the paged kernel (its blocks read in place, once for all rows): the log-probabilities of
    each decoded token are as close to float64's as with torch's flash attention for the heads."""
    from transformers import LlamaForCausalLM

    loaded, directory = wide_heads_bf16
    system = words(loaded, "You are a terse assistant who answers in one word. " * 8)
    prompts = [system + words(loaded, tail) for tail in ("Paris is", "Rome was", "The sea")]
    errors: dict[bool, float] = {}
    head_blocks: dict[bool, list[bool]] = {}
    exact = LlamaForCausalLM.from_pretrained(directory).to(torch.bfloat16).to(torch.float64)
    for use_kernel in (True, False):
        engine = make_engine(loaded, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
        if not kernels.paged_prefill_available(torch.bfloat16, 64):
            engine.stop()
            pytest.skip("no AVX512-BF16 build: heads use flash attention")
        monkeypatch.setattr(model_runner, "KERNEL_MAX_CONTEXT", 8)  # every decode row here is long
        engine.runner.prefill_kernel = use_kernel
        seen = head_blocks.setdefault(use_kernel, [])
        prepare = engine.runner._prepare

        def spy(rows, prepare=prepare, seen=seen):
            meta, *rest = prepare(rows)
            if meta.decode is not None:
                seen.extend(head.blocks is not None for head in meta.decode.heads if head.rows.numel() > 1)
            return (meta, *rest)

        monkeypatch.setattr(engine.runner, "_prepare", spy)
        try:
            await run(engine, system, rid="warm", max_tokens=1)  # caches the shared prefix's blocks
            got = await asyncio.gather(
                *(run(engine, p, rid=f"r{i}", max_tokens=6, num_logprobs=1) for i, p in enumerate(prompts))
            )
        finally:
            engine.stop()
        worst = 0.0
        for prompt, result in zip(prompts, got, strict=True):
            ids = prompt + result.token_ids
            with torch.inference_mode():
                logits = exact(torch.tensor([ids[:-1]])).logits[0, len(prompt) - 1 :]
            want = torch.log_softmax(logits, -1)
            for step, lp in enumerate(result.logprobs):
                worst = max(worst, abs(lp.logprob - float(want[step, lp.token_id])))
        errors[use_kernel] = worst
    assert head_blocks[True], "no step shared a head"
    assert all(head_blocks[True])  # each shared head read by the kernel
    assert not any(head_blocks[False])  # by flash attention
    assert errors[True] < 0.5, errors
    assert errors[True] <= 2 * errors[False] + 0.05, errors


async def test_a_head_kept_laid_out_across_steps_answers_exactly_as_one_laid_out_each_call(
    wide_heads_bf16, monkeypatch
):
    """Rows behind one cached prefix decode from its layout, made once per layer and kept while they decode;
    every token and log-probability is the one the kernel gives when it lays the head out on every call."""
    loaded, _ = wide_heads_bf16
    system = words(loaded, "You are a terse assistant who answers in one word. " * 8)
    prompts = [system + words(loaded, tail) for tail in ("Paris is", "Rome was", "The sea")]
    monkeypatch.setattr(model_runner, "KERNEL_MAX_CONTEXT", 8)  # every decode row here is long
    results, made, kept_heads, steps_with_head = {}, {}, {}, {}
    for keep in (True, False):
        engine = make_engine(loaded, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
        if not engine.runner.prefill_kernel:
            engine.stop()
            pytest.skip("no AVX512-BF16 build (or SDPA timed faster): heads use flash attention")
        if not keep:
            engine.runner.head_layouts.limit_bytes = 0  # nothing fits: each call lays its head out
        layouts, steps = kept_heads.setdefault(keep, set()), steps_with_head.setdefault(keep, [0])
        prepare = engine.runner._prepare

        def spy(rows, prepare=prepare, layouts=layouts, steps=steps):
            meta, *rest = prepare(rows)
            shared = [h for h in (meta.decode.heads if meta.decode else []) if h.rows.numel() > 1]
            steps[0] += bool(shared)
            layouts.update(id(h.laid_out) for h in shared if h.laid_out is not None)
            return (meta, *rest)

        monkeypatch.setattr(engine.runner, "_prepare", spy)
        try:
            await run(engine, system, rid="warm", max_tokens=1)  # caches the shared prefix's blocks
            before = engine.runner.head_layouts.num_made
            results[keep] = await asyncio.gather(
                *(run(engine, p, rid=f"r{i}", max_tokens=6, num_logprobs=2) for i, p in enumerate(prompts))
            )
            made[keep] = engine.runner.head_layouts.num_made - before
            # once the engine has nothing to run, the kept layouts' memory goes (at its next tick at the latest)
            layouts_of = engine.runner.head_layouts
            await wait_until_async(lambda kept=layouts_of: kept.num_kept == 0, what="the layouts dropped")
        finally:
            engine.stop()
    layers = loaded.model.config.num_hidden_layers
    assert steps_with_head[True][0] >= 3  # the head served several steps ...
    assert len(kept_heads[True]) == 1
    assert made[True] == layers
    assert made[False] == 0
    assert not kept_heads[False]
    for kept, per_call in zip(results[True], results[False], strict=True):
        assert kept.token_ids == per_call.token_ids
        assert [(lp.token_id, lp.logprob, lp.top) for lp in kept.logprobs] == [
            (lp.token_id, lp.logprob, lp.top) for lp in per_call.logprobs
        ]


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
    assert not engine.runner.prefill_kernel
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
    monkeypatch.setattr(model_runner, "KERNEL_MAX_CONTEXT", 8)  # every decode row here is long: heads, were they used
    engine = make_engine(tiny, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256, kv_dtype="int8")
    if not engine.runner.uses_kernel:
        engine.stop()
        pytest.skip("no C++ compiler: every row is an SDPA call")
    assert not engine.runner.uses_heads
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


@pytest.mark.parametrize("way", [model_runner.KERNEL, model_runner.SDPA])
async def test_prefill_chunks_go_the_way_timed_faster_at_start(wide_heads_bf16, monkeypatch, way):
    """Where the prefill kernel serves the pool, chunks go the way the start-up timing found faster."""
    from server.kv.routing import PrefillRoute

    if not kernels.paged_prefill_available(torch.bfloat16, 64):
        pytest.skip("no AVX512-BF16 build: prefill chunks are spans, nothing is timed")
    timed: list[str] = []

    def time_prefill(pool, num_heads):
        timed.append(way)
        other = model_runner.SDPA if way == model_runner.KERNEL else model_runner.KERNEL
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
    assert engine.runner.prefill_kernel == (way == model_runner.KERNEL)
    assert result.error is None
    assert len(calls) > 2
    assert all(n == (1 if way == model_runner.KERNEL else 0) for n in calls), calls

"""Which attention path a decode row takes: the paged kernel (one call for the short rows) or SDPA (each longer one)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from server.engine import model_runner
from server.models.loader import load_model
from tests.helpers import make_engine, reference_greedy, run


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


def test_heads_group_rows_by_their_shared_blocks(tiny32):
    """Routing: shared full blocks make one head, a lone row's consecutive run its own, a long tail goes to SDPA."""
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    engine.stop()
    runner, Row = engine.runner, model_runner.DecodeRow
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

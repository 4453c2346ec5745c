"""Prompts behind one prefix that a running prefill is computing: they wait for its blocks and share them."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import pytest

from server.kv.tiers import TierStore
from server.models.loader import load_model
from server.sessions.record import SessionKey, common_prefix_len
from tests.helpers import (
    Result,
    collect,
    make_engine,
    paused,
    reference_greedy,
    request,
    run,
    wait_until,
    wait_until_async,
)

BLOCK = 4


@pytest.fixture(scope="module")
def tiny32(tiny_spec):
    return load_model(dataclasses.replace(tiny_spec, dtype="float32"), Path("unused"))


@pytest.fixture
def engine(tiny32):
    eng = make_engine(tiny32, budget_bytes=4 << 20, block_size=BLOCK, max_batch_tokens=32, max_queue=16)
    yield eng
    eng.stop()


def ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


def admission_steps(engine, since: int) -> dict[str, int]:
    """Each request's first admission, as the index of the engine's step record (since `since`) it happened in."""
    steps: dict[str, int] = {}
    for index, record in enumerate(list(engine.loop.step_log)[since:]):
        for rid in record.admitted:
            steps.setdefault(rid, index)
    return steps


async def submitted(engine, req) -> Result:
    """`req`'s outcome, submitted when the task first runs (tasks made in a row submit in that order)."""
    return await collect(engine.submit(req))


async def test_conversations_opening_with_one_new_prompt_compute_it_once(engine, tiny32):
    """Taken in one step, three prompts behind one uncached system prompt: the first computes it, the others
    wait for its blocks and compute only their own tails. Meanwhile the requests behind them go at once: an
    unrelated prompt, and another tenant's copy of the first (tenants never share blocks: it computes its own)."""
    system = ids(tiny32, "You are a terse assistant who answers in one word. " * 3)
    prompts = [system + ids(tiny32, question) for question in (" Paris is", " Rome was", " The sea")]
    unrelated = ids(tiny32, "Numbers 0123456789 and symbols")
    assert common_prefix_len(unrelated, system) < BLOCK
    since, before = len(engine.loop.step_log), engine.runner.counter.num_prefill_tokens
    async with paused(engine):
        tasks = [
            asyncio.ensure_future(run(engine, p, rid=f"c{i}", max_tokens=6, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        tasks.append(asyncio.ensure_future(run(engine, unrelated, rid="u", max_tokens=6, ignore_eos=True)))
        elsewhere = dataclasses.replace(request(prompts[0], rid="acme", max_tokens=6, ignore_eos=True), tenant="acme")
        tasks.append(asyncio.ensure_future(submitted(engine, elsewhere)))
        await asyncio.sleep(0)  # every task submits, in this order, before the engine takes the queue
    results = await asyncio.gather(*tasks)
    steps = admission_steps(engine, since)
    assert steps["c0"] == 0
    assert steps["u"] == 0, f"the prompts waiting for c0 held back the queue behind them: {steps}"
    assert steps["acme"] == 0, f"another tenant's prompt waited for c0, whose blocks it can never share: {steps}"
    assert steps["c1"] == steps["c2"] > 0, f"c1 and c2 should wait for c0's blocks, then go together: {steps}"
    shared = min(common_prefix_len(prompts[0], p) for p in prompts[1:]) // BLOCK * BLOCK
    assert shared >= len(system) - BLOCK
    computed = engine.runner.counter.num_prefill_tokens - before
    others = sum(len(p) - shared for p in prompts[1:]) + len(unrelated) + len(prompts[0])
    assert computed == len(prompts[0]) + others
    assert [r.usage.cached_tokens for r in results] == [0, shared, shared, 0, 0]
    for prompt, result in zip([*prompts, unrelated, prompts[0]], results, strict=True):
        assert result.token_ids == reference_greedy(tiny32.model, prompt, 6)


async def test_prompts_behind_a_cached_prefix_are_admitted_in_one_step(engine, tiny32):
    """Eight requests behind a system prompt the pool holds already: each finds it cached, none computes it for
    another, so none waits for another; they are all admitted in the step that takes them."""
    system = ids(tiny32, "You are a terse assistant who answers in one word. " * 3)
    system = system[: len(system) // BLOCK * BLOCK]
    await run(engine, [*system, 5], rid="warm", max_tokens=1)  # the system prompt's blocks, idle and cached
    prompts = [[*system, 100 + i, 7, 8, 9, 10, 11] for i in range(8)]  # they part at the first token after it
    since = len(engine.loop.step_log)
    async with paused(engine):
        handles = [engine.submit(request(p, rid=f"q{i}", max_tokens=4, ignore_eos=True)) for i, p in enumerate(prompts)]
    results = [await collect(h) for h in handles]
    steps = admission_steps(engine, since)
    assert sorted(steps) == [f"q{i}" for i in range(8)]
    assert set(steps.values()) == {0}, f"admitted one after another, not together: {steps}"
    assert [r.usage.cached_tokens for r in results] == [len(system)] * 8
    assert [r.token_ids for r in results[:2]] == [reference_greedy(tiny32.model, p, 4) for p in prompts[:2]]


async def test_prompts_behind_a_restoring_prefill_wait_one_step_and_share_its_blocks(tiny32, monkeypatch):
    """A session's turn restores its snapshot, whose leading blocks (a system prompt) another prompt taken in the
    same step shares. That prompt waits one step, until the restored blocks are published, and then reuses them
    instead of computing them again."""
    system = ids(tiny32, "You are a terse assistant who answers in one word. " * 3)
    system = system[: len(system) // BLOCK * BLOCK]
    source = make_engine(tiny32, budget_bytes=4 << 20, block_size=BLOCK)
    try:
        first = await run(source, [*system, 5, 6], session="a", max_tokens=3, ignore_eos=True)
        transcript = [*system, 5, 6, *first.token_ids]
        snapshot = await source.query(lambda: source.offloader.gather(SessionKey("default", "a"), transcript))
    finally:
        source.stop()
    tiers = TierStore(1 << 30, 0, None, block_size=BLOCK)  # a host tier only
    tiers.put(snapshot)
    eng = make_engine(tiny32, tiers=tiers, budget_bytes=4 << 20, block_size=BLOCK)  # an empty pool
    read, fetch = threading.Event(), eng.offloader.fetch

    def held_fetch(key, prompt_ids):
        assert read.wait(30), "the test never let the snapshot be read"
        return fetch(key, prompt_ids)

    monkeypatch.setattr(eng.offloader, "fetch", held_fetch)
    try:
        since = len(eng.loop.step_log)
        turn = asyncio.ensure_future(run(eng, [*transcript, 7, 8], session="a", rid="a", max_tokens=3))
        await wait_until_async(lambda: eng.stats.num_waiting == 1, what="a to read its snapshot")
        # f and then a second hold go into the inbox together: the engine takes f into its queue and stops. The
        # snapshot is read meanwhile, so the next step re-admits a (restoring it) and plans f in one go.
        entered, gate = threading.Event(), threading.Event()
        async with paused(eng):
            other = asyncio.ensure_future(
                submitted(eng, request([*system, 9, 10, 11], rid="f", max_tokens=3, ignore_eos=True))
            )
            await asyncio.sleep(0)  # f is in the inbox
            held = asyncio.ensure_future(eng.query(lambda: entered.set() or gate.wait(30)))
            await asyncio.sleep(0)  # and the hold behind it
        assert await asyncio.to_thread(entered.wait, 30), "the engine never took f"
        read.set()
        await asyncio.to_thread(
            wait_until, lambda: all(s.loading is not None and s.loading.done() for s in eng.scheduler.loading)
        )
        gate.set()
        await held
        a, f = await asyncio.gather(turn, other)
        steps = [record.admitted for record in list(eng.loop.step_log)[since:] if record.admitted]
        assert steps == [("a",), ("a",), ("f",)], steps  # the load, the restore; f one step after it
        assert a.admitted.source == "host"
        assert f.admitted.source == "device"
        assert f.usage.cached_tokens == len(system)  # the restored blocks, not computed again
        assert f.token_ids == reference_greedy(tiny32.model, [*system, 9, 10, 11], 3)
    finally:
        eng.stop()

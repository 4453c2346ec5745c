"""Prompts behind one prefix that a running prefill is computing: they wait for its blocks and share them."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from server.models.loader import load_model
from server.sessions.record import common_prefix_len
from tests.helpers import collect, make_engine, paused, reference_greedy, request, run

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


async def test_conversations_opening_with_one_new_prompt_compute_it_once(engine, tiny32):
    """Taken in one step, three prompts behind one uncached system prompt: the first computes it, the others
    wait for its blocks and compute only their own tails. Another tenant's copy is computed on its own."""
    system = ids(tiny32, "You are a terse assistant who answers in one word. " * 3)
    prompts = [system + ids(tiny32, question) for question in (" Paris is", " Rome was", " The sea")]
    before = engine.runner.counter.num_prefill_tokens
    async with paused(engine):
        tasks = [
            asyncio.ensure_future(run(engine, p, rid=f"c{i}", max_tokens=6, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        elsewhere = dataclasses.replace(request(prompts[0], rid="acme", max_tokens=6, ignore_eos=True), tenant="acme")
        tasks.append(asyncio.ensure_future(collect(engine.submit(elsewhere))))
        await asyncio.sleep(0)  # every task submits before the engine takes the queue
    results = await asyncio.gather(*tasks)
    shared = min(common_prefix_len(prompts[0], p) for p in prompts[1:]) // BLOCK * BLOCK
    assert shared >= len(system) - BLOCK
    computed = engine.runner.counter.num_prefill_tokens - before
    assert computed == len(prompts[0]) + sum(len(p) - shared for p in prompts[1:]) + len(prompts[0])
    assert [r.usage.cached_tokens for r in results] == [0, shared, shared, 0]
    for prompt, result in zip([*prompts, prompts[0]], results, strict=True):
        assert result.token_ids == reference_greedy(tiny32.model, prompt, 6)

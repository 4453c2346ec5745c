"""Continuous batching on the paged pool: exactness, chunked prefill, prefix sharing, admission, faults."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from server.engine import batch_engine as batch_module
from server.engine.batch_engine import BatchEngine, PoolConfig, QueueFull
from server.engine.kv_store import KVStore
from server.engine.registry import load_model
from server.engine.sampler import Sampler
from server.engine.types import Failed, GenerationRequest, SamplingParams, SessionKey
from tests.helpers import reference_greedy, run

BLOCK = 4


@pytest.fixture(scope="module")
def tiny32(tiny_spec):
    """The tiny model in fp32, as the batching contract is stated for fp32 on CPU."""
    return load_model(dataclasses.replace(tiny_spec, dtype="float32"), Path("unused"))


def make_engine(loaded, **overrides) -> BatchEngine:
    config = PoolConfig(budget_bytes=4 << 20, block_size=BLOCK, max_batch_tokens=32, max_queue=16)
    engine = BatchEngine(loaded, KVStore(budget_bytes=1 << 30, ttl_s=3600), dataclasses.replace(config, **overrides))
    engine.start()
    return engine


@pytest.fixture()
def engine(tiny32):
    eng = make_engine(tiny32)
    yield eng
    eng.stop()


def ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


CASES = [  # (prompt, params): different lengths, sampling settings and seeds
    ("The quick brown fox jumps over the lazy dog.", dict(max_tokens=12)),
    ("Paris is", dict(max_tokens=20, temperature=0.8, seed=3)),
    ("Sessions keep their cache between turns. Hello world, hello kvserve.", dict(max_tokens=6, top_k=5, seed=9)),
    ("Emoji and CJK are split", dict(max_tokens=16, repetition_penalty=1.3)),
    ("Numbers 0123456789 and symbols", dict(max_tokens=9, temperature=1.2, top_p=0.9, seed=11)),
]


async def test_batched_equals_unbatched(tiny32):
    alone = make_engine(tiny32, is_prefix_caching=False)
    expected = [await run(alone, ids(tiny32, p), ignore_eos=True, **kw) for p, kw in CASES]
    alone.stop()
    batched = make_engine(tiny32, is_prefix_caching=False)

    async def staggered(i, prompt, kw):
        await asyncio.sleep(0.003 * i)  # join mid-flight; different max_tokens leave at different steps
        return await run(batched, ids(tiny32, prompt), rid=f"r{i}", ignore_eos=True, **kw)

    got = await asyncio.gather(*(staggered(i, p, kw) for i, (p, kw) in enumerate(CASES)))
    batched.stop()
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert batched.max_batch_seen >= 4  # equal outputs alone would also pass a one-at-a-time engine
    prompt, kw = CASES[0]
    assert expected[0].token_ids == reference_greedy(tiny32.model, ids(tiny32, prompt), kw["max_tokens"])


async def test_prefix_sharing_gives_the_same_ids_and_computes_less(tiny32):
    outputs = {}
    for caching in (False, True):
        eng = make_engine(tiny32, is_prefix_caching=caching)
        prompt = ids(tiny32, "Sessions keep their cache between turns. Hello world")
        first = await run(eng, prompt, max_tokens=8, ignore_eos=True)
        before = eng.counter.num_prefill_tokens
        second = await run(eng, prompt + ids(tiny32, ", hello"), max_tokens=8, ignore_eos=True)
        computed = eng.counter.num_prefill_tokens - before
        assert computed == second.usage.prompt_tokens - second.usage.cached_tokens
        assert (second.usage.cached_tokens > 0) == caching
        outputs[caching] = (first.token_ids, second.token_ids)
        eng.stop()
    assert outputs[True] == outputs[False]


async def test_chunked_prefill_keeps_running_streams_flowing(engine, tiny32):
    long = {"max_tokens": 150, "ignore_eos": True}
    streams = [asyncio.create_task(run(engine, ids(tiny32, f"Hello world {i}"), rid=f"s{i}", **long)) for i in range(3)]
    while sum(1 for r in engine.step_log if len(r.decode) == 3) < 2:  # all three are decoding
        await asyncio.sleep(0.001)
    big = ids(tiny32, "The quick brown fox jumps over the lazy dog. " * 12)
    assert len(big) > 3 * 32
    await run(engine, big, rid="big", max_tokens=2)
    prefill_steps = [r for r in engine.step_log if any(rid == "big" for rid, _ in r.prefill)]
    assert len(prefill_steps) >= 3  # the long prompt was split into chunks
    for record in prefill_steps:
        assert sorted(record.decode) == ["s0", "s1", "s2"]  # every running stream gained a token in that step
        assert sum(n for _, n in record.prefill) <= 32 - 3
    for task in streams:
        task.cancel()


async def test_shared_prefix_blocks_are_counted_once(engine, tiny32):
    prefix = ids(tiny32, "The quick brown fox jumps over the lazy dog. Paris is the capital")
    prefix = prefix[: len(prefix) // BLOCK * BLOCK]  # P a multiple of the block size
    await run(engine, prefix + ids(tiny32, " warm"), session="warm", max_tokens=1)  # computes the prefix once
    n = 4
    tasks = [
        asyncio.create_task(
            run(engine, prefix + ids(tiny32, f" own {i}"), session=f"s{i}", rid=f"s{i}", max_tokens=60, ignore_eos=True)
        )
        for i in range(n)
    ]
    while len(engine._running) < n or not all(s.is_prefilled for s in engine._running):
        await asyncio.sleep(0.001)
    with engine.blocks.lock:
        seqs = list(engine._running)
        shared = [b for b in seqs[0].blocks if b.ref_count == n]
        own = sum(len(s.blocks) for s in seqs) - n * len(shared)
        assert len(shared) == len(prefix) // BLOCK
        assert engine.blocks.num_used == len(shared) + own
        assert all(s.num_cached >= len(prefix) for s in seqs)
    results = await asyncio.gather(*tasks)
    assert all(r.usage.cached_tokens >= len(prefix) for r in results)
    for name in ["warm"] + [f"s{i}" for i in range(n)]:
        assert engine.store.delete(SessionKey("default", name))
    assert engine.blocks.num_used == 0 and engine.blocks.num_reserved == 0


async def test_idle_session_blocks_are_evictable_and_reported_honestly(tiny32):
    eng = make_engine(tiny32, budget_bytes=24 * BLOCK * 512)  # a pool of 24 blocks of 4 tokens
    assert eng.blocks.num_blocks == 24
    first_prompt = ids(tiny32, "Hello world, hello kvserve.")
    first = await run(eng, first_prompt, session="a", max_tokens=4, ignore_eos=True)
    filler = ids(tiny32, "Numbers 0123456789 and symbols appear in text.")
    await run(eng, filler, max_tokens=23 * BLOCK - len(filler), ignore_eos=True)  # 23 of 24 blocks: evicts a's
    again = await run(eng, first_prompt + first.token_ids, session="a", max_tokens=2)
    assert 0 < again.usage.cached_tokens < len(first_prompt)  # the tail was evicted first, the prefix kept
    assert again.usage.cached_tokens % BLOCK == 0
    assert eng.blocks.num_evictions > 0
    eng.stop()


async def test_admission_waits_for_blocks_and_bounds_the_queue(tiny32):
    eng = make_engine(tiny32, budget_bytes=20 * BLOCK * 512, max_queue=1)  # 20 blocks
    prompt = ids(tiny32, "Hello world")
    first = asyncio.create_task(run(eng, prompt, rid="a", max_tokens=60, ignore_eos=True))  # 16 blocks reserved
    while not eng._running:
        await asyncio.sleep(0.001)
    second = asyncio.create_task(run(eng, prompt, rid="b", max_tokens=60, ignore_eos=True))
    await asyncio.sleep(0.05)
    assert [s.request.request_id for s in eng._waiting] == ["b"]  # no room: it waits, a is never preempted
    with pytest.raises(QueueFull):
        eng.submit(GenerationRequest("c", prompt, SamplingParams(max_tokens=4)))
    a, b = await asyncio.gather(first, second)
    assert a.usage.completion_tokens == b.usage.completion_tokens == 60
    assert eng.blocks.num_used == 0
    eng.stop()


async def test_a_failed_forward_fails_that_step_and_the_engine_goes_on(engine, tiny32, monkeypatch):
    real = batch_module.run_forward
    calls = {"n": 0}

    def failing_once(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return real(*args)

    monkeypatch.setattr(batch_module, "run_forward", failing_once)
    prompt = ids(tiny32, "Hello world")
    results = await asyncio.gather(*(run(engine, prompt, rid=f"f{i}", max_tokens=8, ignore_eos=True) for i in range(3)))
    assert any(r.error is not None and r.error.code == "internal_error" for r in results)
    after = await run(engine, prompt, max_tokens=3, ignore_eos=True)
    assert after.usage.completion_tokens == 3 and engine.blocks.num_used == 0


async def test_a_sampling_error_fails_only_its_request(engine, tiny32, monkeypatch):
    real = Sampler.sample

    def flaky(self, logits):
        if self.params.seed == 666:
            raise RuntimeError("boom")
        return real(self, logits)

    monkeypatch.setattr(Sampler, "sample", flaky)
    prompt = ids(tiny32, "Hello world")
    bad, good = await asyncio.gather(
        run(engine, prompt, rid="bad", seed=666, max_tokens=5),
        run(engine, prompt, rid="good", max_tokens=5, ignore_eos=True),
    )
    assert bad.error.code == "internal_error" and good.usage.completion_tokens == 5


async def test_out_of_memory_fails_the_step_and_the_engine_serves_on(engine, tiny32, monkeypatch):
    prompt = ids(tiny32, "Hello world, hello kvserve.")
    await run(engine, prompt, session="cached", max_tokens=4, ignore_eos=True)
    real = batch_module.run_forward

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(batch_module, "run_forward", out_of_memory)
    failed = await run(engine, ids(tiny32, "Paris is"), max_tokens=4)
    assert failed.error.code == "out_of_memory"  # 503 over HTTP
    assert engine.blocks.num_used == 0 and engine.blocks.num_reserved == 0  # the failed step's blocks came back
    monkeypatch.setattr(batch_module, "run_forward", real)
    again = await run(engine, prompt, max_tokens=3, ignore_eos=True)
    # The pool is allocated up front: other tenants' cache is kept (dropping it would free no memory).
    assert again.error is None and again.usage.cached_tokens > 0


async def test_a_stream_left_unread_is_ended_without_stalling_the_batch(engine, tiny32):
    prompt = ids(tiny32, "Hello world")
    unread = engine.submit(
        GenerationRequest("slow", prompt, SamplingParams(max_tokens=500, ignore_eos=True), max_unread_events=8)
    )
    other = await run(engine, prompt, rid="reader", max_tokens=40, ignore_eos=True)  # runs alongside
    assert other.usage.completion_tokens == 40
    while engine.num_active:
        await asyncio.sleep(0.01)
    events = [event async for event in unread]
    assert isinstance(events[-1], Failed) and events[-1].code == "slow_reader"
    assert len(events) < 20  # ended soon after 8 unread events, not after 500 tokens
    assert engine.blocks.num_used == 0

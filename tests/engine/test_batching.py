"""Continuous batching on the paged pool: exactness, chunked prefill, prefix sharing, admission, faults."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from server.engine.model_runner import ModelRunner
from server.engine.request import Failed, QueueFull
from server.models.loader import load_model
from server.sessions.record import SessionKey, common_prefix_len
from tests.engine.test_shared_prefill import admission_steps
from tests.helpers import collect, make_engine, paused, reference_greedy, request, run, settled, wait_until_async

BLOCK = 4


@pytest.fixture(scope="module")
def tiny32(tiny_spec):
    """The tiny model in fp32, as the batching contract is stated for fp32 on CPU."""
    return load_model(dataclasses.replace(tiny_spec, dtype="float32"), Path("unused"))


def batching_engine(loaded, **overrides):
    config = dict(budget_bytes=4 << 20, block_size=BLOCK, max_batch_tokens=32, max_queue=16)
    return make_engine(loaded, **(config | overrides))


@pytest.fixture
def engine(tiny32):
    eng = batching_engine(tiny32)
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
    alone = batching_engine(tiny32, is_prefix_caching=False)
    expected = [await run(alone, ids(tiny32, p), ignore_eos=True, **kw) for p, kw in CASES]
    alone.stop()
    batched = batching_engine(tiny32, is_prefix_caching=False)

    async def staggered(i, prompt, kw):
        await asyncio.sleep(0.003 * i)  # join mid-flight; different max_tokens leave at different steps
        return await run(batched, ids(tiny32, prompt), rid=f"r{i}", ignore_eos=True, **kw)

    got = await asyncio.gather(*(staggered(i, p, kw) for i, (p, kw) in enumerate(CASES)))
    batched.stop()
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert batched.loop.max_batch_seen >= 4  # equal outputs alone would also pass a one-at-a-time engine
    prompt, kw = CASES[0]
    assert expected[0].token_ids == reference_greedy(tiny32.model, ids(tiny32, prompt), kw["max_tokens"])


async def test_prefix_sharing_gives_the_same_ids_and_computes_less(tiny32):
    outputs = {}
    for caching in (False, True):
        eng = batching_engine(tiny32, is_prefix_caching=caching)
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
    await wait_until_async(
        lambda: sum(1 for r in list(engine.loop.step_log) if len(r.decode) == 3) >= 2, what="all three streams decoding"
    )
    big = ids(tiny32, "The quick brown fox jumps over the lazy dog. " * 12)
    assert len(big) > 3 * 32
    await run(engine, big, rid="big", max_tokens=2)
    prefill_steps = [r for r in list(engine.loop.step_log) if any(rid == "big" for rid, _ in r.prefill)]
    assert len(prefill_steps) >= 3  # the long prompt was split into chunks
    for record in prefill_steps:
        assert sorted(record.decode) == ["s0", "s1", "s2"]  # every running stream gained a token in that step
        assert sum(n for _, n in record.prefill) <= 32 - 3
    for task in streams:
        task.cancel()


def pool_view(engine):
    """Read on the engine thread: (each running sequence's block ids and num_cached, block ref counts, blocks used)."""

    def read():
        seqs = [([b.block_id for b in s.blocks], s.num_cached, s.is_prefilled) for s in engine.scheduler.running]
        refs = {b.block_id: b.ref_count for s in engine.scheduler.running for b in s.blocks}
        return seqs, refs, engine.blocks.num_used

    return engine.query(read)


async def test_shared_prefix_blocks_are_counted_once(engine, tiny32):
    prefix = ids(tiny32, "The quick brown fox jumps over the lazy dog. Paris is the capital")
    prefix = prefix[: len(prefix) // BLOCK * BLOCK]  # P a multiple of the block size
    await run(engine, prefix + ids(tiny32, " warm"), session="warm", max_tokens=1)  # computes the prefix once
    n = 4
    prompts = [prefix + ids(tiny32, f" own {i}") for i in range(n)]
    since = len(engine.loop.step_log)
    async with paused(engine):  # taken in one step
        tasks = [
            asyncio.create_task(run(engine, p, session=f"s{i}", rid=f"s{i}", max_tokens=60, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        await asyncio.sleep(0)  # every task submits, in this order
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        seqs, refs, num_used = await pool_view(engine)
        if len(seqs) == n and all(is_prefilled for _, _, is_prefilled in seqs):
            break
        assert asyncio.get_running_loop().time() < deadline, "the four sequences never ran together"
        await asyncio.sleep(0.001)
    shared = [b for b in seqs[0][0] if refs[b] == n]
    own = sum(len(blocks) for blocks, _, _ in seqs) - n * len(shared)
    # the cached prefix, and the block after it that the four prompts also share (" own" before the digit):
    # the first to arrive computes it, the others wait for it and share it
    common = min(common_prefix_len(prompts[0], p) for p in prompts[1:])
    assert common // BLOCK > len(prefix) // BLOCK
    assert len(shared) == common // BLOCK
    assert num_used == len(shared) + own
    assert all(num_cached >= len(prefix) for _, num_cached, _ in seqs)
    steps = admission_steps(engine, since)  # s0 computes the shared block; the others wait for it, then go together
    assert steps["s1"] == steps["s2"] == steps["s3"] > steps["s0"], steps
    results = await asyncio.gather(*tasks)
    assert all(r.usage.cached_tokens >= len(prefix) for r in results)
    for name in ["warm"] + [f"s{i}" for i in range(n)]:
        assert engine.store.delete(SessionKey("default", name))
    assert (await settled(engine)).num_blocks_used == 0
    assert await engine.query(lambda: engine.blocks.num_reserved) == 0


async def test_idle_session_blocks_are_evictable_and_reported_honestly(tiny32):
    eng = batching_engine(tiny32, budget_bytes=24 * BLOCK * 512)  # a pool of 24 blocks of 4 tokens
    assert eng.blocks.num_blocks == 24
    first_prompt = ids(tiny32, "Hello world, hello kvserve.")
    first = await run(eng, first_prompt, session="a", max_tokens=4, ignore_eos=True)
    filler = ids(tiny32, "Numbers 0123456789 and symbols appear in text.")
    await run(eng, filler, max_tokens=23 * BLOCK - len(filler), ignore_eos=True)  # 23 of 24 blocks: evicts a's
    again = await run(eng, first_prompt + first.token_ids, session="a", max_tokens=2)
    assert 0 < again.usage.cached_tokens < len(first_prompt)  # the tail was evicted first, the prefix kept
    assert again.usage.cached_tokens % BLOCK == 0
    assert (await settled(eng)).num_evictions > 0
    eng.stop()


async def test_admission_waits_for_blocks_and_bounds_the_queue(tiny32):
    eng = batching_engine(tiny32, budget_bytes=20 * BLOCK * 512, max_queue=1)  # 20 blocks
    prompt = ids(tiny32, "Hello world")
    first = asyncio.create_task(run(eng, prompt, rid="a", max_tokens=60, ignore_eos=True))  # 16 blocks reserved
    await wait_until_async(lambda: eng.stats.num_running == 1, what="a to run")
    second = asyncio.create_task(run(eng, prompt, rid="b", max_tokens=60, ignore_eos=True))
    await wait_until_async(lambda: eng.stats.num_waiting == 1, what="b to wait for blocks")
    waiting = await eng.query(lambda: [s.request.request_id for s in eng.scheduler.waiting])
    assert waiting == ["b"]  # no room: it waits, a is never preempted
    with pytest.raises(QueueFull):
        eng.submit(request(prompt, rid="c", max_tokens=4))
    a, b = await asyncio.gather(first, second)
    assert a.usage.completion_tokens == b.usage.completion_tokens == 60
    assert (await settled(eng)).num_blocks_used == 0
    eng.stop()


async def reserving_33_blocks(eng, tiny32) -> asyncio.Task:
    """Request R, running (and holding a reservation of 33 blocks) by the time this returns."""
    other = ids(tiny32, "Numbers 0123")
    running = asyncio.create_task(run(eng, other, rid="R", max_tokens=33 * BLOCK - len(other), ignore_eos=True))
    await wait_until_async(lambda: eng.stats.num_running == 1, what="R to run")
    return running


async def queues(eng) -> tuple[list[str], list[str]]:
    """The request ids running and waiting, between two steps."""
    return await eng.query(
        lambda: (
            [s.request.request_id for s in eng.scheduler.running],
            [s.request.request_id for s in eng.scheduler.waiting],
        )
    )


async def test_idle_cached_blocks_a_request_reuses_are_not_counted_as_free(tiny32):
    """Idle cached blocks a request shares are pinned by it: they cannot also be evicted to make its room."""
    eng = batching_engine(tiny32, budget_bytes=40 * BLOCK * 512)  # 40 blocks
    prefix = ids(tiny32, "The quick brown fox jumps over the lazy dog.")[: 4 * BLOCK]
    await run(eng, prefix, max_tokens=1)  # leaves 4 idle cached blocks
    assert await eng.query(lambda: eng.blocks.num_cached_idle) == 4
    running = await reserving_33_blocks(eng, tiny32)
    async with paused(eng):
        # P shares the 4 cached blocks and needs 6 more (10 in all); 3 are free beyond R's reservation. Counting
        # its own pinned blocks as evictable (3 + 4 >= 6) would admit it, and the pool would run dry mid-stream.
        shared = asyncio.create_task(run(eng, [*prefix, 5], rid="P", max_tokens=10 * BLOCK - len(prefix) - 1))
        await asyncio.sleep(0)  # P is submitted
    await eng.query(lambda: None)  # P is in the scheduler; the next answer comes after a step tried to admit it
    assert await queues(eng) == (["R"], ["P"])
    eng.stop()
    assert (await running).error.code == (await shared).error.code == "shutting_down"


async def test_a_partially_matching_block_is_reserved_not_counted_as_reused(tiny32):
    """A prompt that matches part of a cached block copies those slots into a new block of its own: that block is
    part of its reservation, like every block it does not share whole."""
    eng = batching_engine(tiny32, budget_bytes=40 * BLOCK * 512)  # 40 blocks
    history = ids(tiny32, "The quick brown fox jumps over the lazy dog.")[: 4 * BLOCK + 2]
    await run(eng, history, max_tokens=1)  # leaves 5 idle cached blocks: 4 full, the last holding 2 tokens
    assert await eng.query(lambda: eng.blocks.num_cached_idle) == 5
    running = await reserving_33_blocks(eng, tiny32)
    async with paused(eng):
        # P shares the 4 full blocks and copies 1 slot of the fifth: 7 blocks in all, 3 of them new. Beyond R's
        # reservation and the 5 cached blocks P pins, 2 are left: P must wait. Counting the partially matching
        # block as reused (7 - 5 = 2) would admit it, and the pool would run dry mid-stream.
        prompt = [*history[: 4 * BLOCK + 1], 5]
        shared = asyncio.create_task(run(eng, prompt, rid="P", max_tokens=7 * BLOCK - len(prompt)))
        await asyncio.sleep(0)  # P is submitted
    await eng.query(lambda: None)  # P is in the scheduler; the next answer comes after a step tried to admit it
    assert await queues(eng) == (["R"], ["P"])
    eng.stop()
    assert (await running).error.code == (await shared).error.code == "shutting_down"


async def test_admissions_in_one_step_never_copy_from_a_block_another_one_evicts(tiny):
    """A partially matching cached block stays pinned until its slots are copied, whatever is admitted with it."""
    eng = make_engine(tiny, budget_bytes=8 * BLOCK * 1024, block_size=BLOCK)  # 8 blocks (float64: 1 KiB a token)
    assert eng.blocks.num_blocks == 8
    histories = [[10 + 10 * i + j for j in range(6)] for i in range(4)]
    for i, ids in enumerate(histories):
        await run(eng, ids, rid=f"h{i}", max_tokens=1)  # every block idle and cached: any new one evicts
    a = [*histories[3][:2], 300]  # copies 2 slots of a cached block
    b = [*histories[0][:5], 301]  # shares one block, copies 1 slot of the next
    async with paused(eng):  # both are admitted in the same step
        handles = [
            eng.submit(request(ids, rid=rid, max_tokens=4, ignore_eos=True)) for rid, ids in (("a", a), ("b", b))
        ]
    ra, rb = [await collect(h) for h in handles]
    assert ra.admitted.num_cached == 2
    assert rb.admitted.num_cached == 5
    assert ra.token_ids == reference_greedy(tiny.model, a, 4)
    assert rb.token_ids == reference_greedy(tiny.model, b, 4)  # computed from its own tokens' K/V, not a's
    assert await eng.query(lambda: (eng.blocks.num_used, eng.blocks.num_reserved)) == (0, 0)
    eng.stop()


async def test_a_failed_forward_fails_that_step_and_the_engine_goes_on(engine, tiny32, monkeypatch):
    real = ModelRunner.run
    calls = {"n": 0}

    def failing_once(self, rows, is_abandoned=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return real(self, rows, is_abandoned)

    monkeypatch.setattr(ModelRunner, "run", failing_once)
    prompt = ids(tiny32, "Hello world")
    results = await asyncio.gather(*(run(engine, prompt, rid=f"f{i}", max_tokens=8, ignore_eos=True) for i in range(3)))
    assert any(r.error is not None and r.error.code == "internal_error" for r in results)
    after = await run(engine, prompt, max_tokens=3, ignore_eos=True)
    assert after.usage.completion_tokens == 3
    assert (await settled(engine)).num_blocks_used == 0


async def test_out_of_memory_fails_the_step_and_the_engine_serves_on(engine, tiny32, monkeypatch):
    prompt = ids(tiny32, "Hello world, hello kvserve.")
    await run(engine, prompt, session="cached", max_tokens=4, ignore_eos=True)

    def out_of_memory(self, rows, is_abandoned=None):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(ModelRunner, "run", out_of_memory)
    failed = await run(engine, ids(tiny32, "Paris is"), max_tokens=4)
    assert failed.error.code == "out_of_memory"  # 503 over HTTP
    reserved = await engine.query(lambda: engine.blocks.num_reserved)
    assert (await settled(engine)).num_blocks_used == 0
    assert reserved == 0  # the failed step's blocks came back
    monkeypatch.undo()
    again = await run(engine, prompt, max_tokens=3, ignore_eos=True)
    # The pool is allocated up front: the tenants' cache is kept (dropping it would free no memory).
    assert again.error is None
    assert again.usage.cached_tokens > 0


async def test_a_stream_left_unread_is_ended_without_stalling_the_batch(engine, tiny32):
    prompt = ids(tiny32, "Hello world")
    unread = engine.submit(request(prompt, rid="slow", max_tokens=500, ignore_eos=True, max_unread_events=8))
    other = await run(engine, prompt, rid="reader", max_tokens=40, ignore_eos=True)  # runs alongside
    assert other.usage.completion_tokens == 40
    await wait_until_async(lambda: engine.num_active == 0, what="the unread stream to be ended")
    events = [event async for event in unread]
    assert isinstance(events[-1], Failed)
    assert events[-1].code == "slow_reader"
    assert len(events) < 20  # ended soon after 8 unread events, not after 500 tokens
    assert (await settled(engine)).num_blocks_used == 0

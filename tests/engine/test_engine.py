"""Greedy exactness against HF generate, continuation exactness, and the forward-token counter."""

from __future__ import annotations

import asyncio

import pytest
import torch

from server.engine.kv_store import KVStore
from server.engine.sampler import Sampler
from server.engine.types import GenerationRequest, SamplingParams, SessionKey
from server.engine.worker import Engine
from tests.helpers import reference_greedy, run


@pytest.fixture()
async def engine(tiny):
    eng = Engine(tiny, KVStore(budget_bytes=1 << 30, ttl_s=3600))
    eng.start()
    yield eng
    eng.stop()


def ids(tiny, text: str) -> list[int]:
    return tiny.tokenizer(text)["input_ids"]


async def test_greedy_equals_hf_generate(engine, tiny):
    prompt = ids(tiny, "The quick brown fox jumps over")
    result = await run(engine, prompt, max_tokens=24, ignore_eos=True)
    assert result.token_ids == reference_greedy(tiny.model, prompt, 24)
    assert result.finish_reason == "length"
    assert result.usage.completion_tokens == 24


async def test_continued_turns_equal_fresh_runs(engine, tiny):
    """Each turn continues from the session cache and yields the ids of a fresh run over the same prompt."""
    prompt = ids(tiny, "Sessions keep their cache")
    num_extra = 0
    for turn, extra in enumerate([" between turns.", " Hello world,", " Paris is"]):
        before = engine.counter.num_prefill_tokens
        result = await run(engine, prompt, session="s", max_tokens=6, ignore_eos=True)
        assert result.token_ids == reference_greedy(tiny.model, prompt, 6), f"turn {turn + 1}"
        computed = engine.counter.num_prefill_tokens - before
        assert computed == result.usage.prompt_tokens - result.usage.cached_tokens
        if turn > 0:  # everything the previous turn fed is reused
            assert result.usage.cached_tokens == len(prompt) - num_extra - 1
        prompt = prompt + result.token_ids + ids(tiny, extra)
        num_extra = len(ids(tiny, extra))


async def test_edited_history_reuses_the_common_prefix(engine, tiny):
    base = ids(tiny, "Paris is the capital of France; Berlin is")
    first = await run(engine, base, session="e", max_tokens=4, ignore_eos=True)
    edited = base[:5] + ids(tiny, " quick brown fox")
    before = engine.counter.num_prefill_tokens
    result = await run(engine, edited, session="e", max_tokens=5, ignore_eos=True)
    assert first.usage.cached_tokens == 0
    assert result.usage.cached_tokens == 5
    assert engine.counter.num_prefill_tokens - before == len(edited) - 5
    assert result.token_ids == reference_greedy(tiny.model, edited, 5)


async def test_identical_retry_recomputes_one_token(engine, tiny):
    prompt = ids(tiny, "Hello world, hello kvserve.")
    await run(engine, prompt, session="r", max_tokens=3, ignore_eos=True)
    first = await run(engine, prompt, session="r", max_tokens=3, ignore_eos=True)
    again = await run(engine, prompt, session="r", max_tokens=3, ignore_eos=True)
    assert first.usage.cached_tokens == again.usage.cached_tokens == len(prompt) - 1
    assert first.token_ids == again.token_ids == reference_greedy(tiny.model, prompt, 3)


async def test_stateless_requests_never_reuse(engine, tiny):
    prompt = ids(tiny, "Numbers and symbols")
    for _ in range(2):
        result = await run(engine, prompt, max_tokens=2)
        assert result.usage.cached_tokens == 0
    assert engine.store.stats().num_entries == 0


async def test_timeout_ends_request_and_keeps_the_transcript(engine, tiny):
    prompt = ids(tiny, "The quick brown fox")
    await run(engine, prompt, session="t", max_tokens=2, ignore_eos=True)
    req = GenerationRequest("slow", prompt, SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True))
    req.session, req.timeout_s = SessionKey("default", "t"), 0.05
    events = [e async for e in engine.submit(req)]
    assert events[-1].code == "request_timeout"
    info = engine.store.info(SessionKey("default", "t"))
    assert info.num_turns == 1 and info.num_transcript_tokens == len(prompt) + 2


async def test_cancel_stops_within_one_step(engine, tiny):
    req = GenerationRequest("c", ids(tiny, "Hello"), SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True))
    handle = engine.submit(req)
    await handle.__anext__()
    handle.cancel()
    await asyncio.sleep(0.2)
    settled = engine.counter.num_decode_tokens
    await asyncio.sleep(0.2)
    assert engine.counter.num_decode_tokens == settled < 3000
    assert engine.num_active == 0


async def test_concurrent_seeded_requests_do_not_disturb_each_other(engine, tiny):
    prompt = ids(tiny, "Emoji and CJK")
    params = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    alone_a = await run(engine, prompt, seed=1, **params)
    alone_b = await run(engine, prompt, seed=2, **params)
    both = await asyncio.gather(
        run(engine, prompt, seed=1, rid="a", **params), run(engine, prompt, seed=2, rid="b", **params)
    )
    assert [both[0].token_ids, both[1].token_ids] == [alone_a.token_ids, alone_b.token_ids]
    assert alone_a.token_ids != alone_b.token_ids


async def test_stop_string_across_tokens_is_not_emitted(engine, tiny):
    prompt = ids(tiny, "The quick brown fox jumps over")
    full = await run(engine, prompt, max_tokens=16, ignore_eos=True)
    stop = full.text[5:9]  # spans token boundaries in general
    assert len(stop) == 4
    cut = await run(engine, prompt, max_tokens=16, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]


async def test_stop_token_ids_and_logprobs(engine, tiny):
    prompt = ids(tiny, "Hello world")
    full = await run(engine, prompt, max_tokens=8, ignore_eos=True, num_logprobs=3)
    assert [lp.token_id for lp in full.logprobs] == full.token_ids
    assert all(len(lp.top) == 3 and lp.top[0][0] == lp.token_id for lp in full.logprobs)  # greedy = top-1
    cut = await run(engine, prompt, max_tokens=8, ignore_eos=True, stop_token_ids=[full.token_ids[3]])
    assert cut.finish_reason == "stop" and cut.usage.completion_tokens == 4


async def test_prefill_projects_only_the_last_position(engine, tiny):
    seen = []
    hook = tiny.model.get_output_embeddings().register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape))
    try:
        await run(engine, ids(tiny, "The quick brown fox jumps over the lazy dog."), max_tokens=2, ignore_eos=True)
    finally:
        hook.remove()
    assert [shape[1] for shape in seen] == [1, 1]  # prefill and one decode step: one position each


async def test_a_failing_request_fails_alone(engine, tiny, monkeypatch):
    real_sample = Sampler.sample

    def flaky(self, logits):
        if self.params.seed == 666:
            raise RuntimeError("boom")
        return real_sample(self, logits)

    monkeypatch.setattr(Sampler, "sample", flaky)
    prompt = ids(tiny, "Hello world")
    bad, good = await asyncio.gather(
        run(engine, prompt, session="f", rid="bad", seed=666, max_tokens=5),
        run(engine, prompt, rid="good", seed=1, max_tokens=5, ignore_eos=True),
    )
    assert bad.error.code == "internal_error" and good.usage.completion_tokens == 5
    info = engine.store.info(SessionKey("default", "f"))
    assert info.num_turns == 0 and info.num_cached_tokens == 0 and not info.is_in_use
    assert (await run(engine, prompt, session="f", max_tokens=2)).usage is not None  # the engine keeps serving


async def test_a_failure_while_finishing_does_not_stop_the_engine(engine, tiny, monkeypatch):
    import server.engine.kv_store as kv_store_module

    def broken(cache):
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(kv_store_module, "shrink_cache", broken)
    prompt = ids(tiny, "Hello world")
    first = await run(engine, prompt, session="oom", max_tokens=3, ignore_eos=True)
    assert first.usage.completion_tokens == 3  # the turn completed; its cache was dropped, not the engine
    info = engine.store.info(SessionKey("default", "oom"))
    assert info.num_turns == 1 and info.num_cached_tokens == 0 and not info.is_in_use
    assert (await run(engine, prompt, session="oom", max_tokens=2)).usage is not None

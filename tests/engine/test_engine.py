"""The engine on one sequence at a time: exactness against HF generate, continuation, the forward-token
counter, limits (timeout, cancel, stop strings and ids), logprobs, seeds, and failures that stay local."""

from __future__ import annotations

import asyncio
import threading

import pytest

from server.engine import loop as loop_module
from server.engine.sampler import Sampler
from server.engine.sequence import Sequence
from server.kv import attention
from server.sessions.record import SessionKey
from tests.helpers import (
    DEADLINE_S,
    collect,
    make_engine,
    reference_greedy,
    request,
    run,
    settled,
    wait_until_async,
)


@pytest.fixture
def engine(tiny):
    eng = make_engine(tiny, block_size=4)
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
    """Each turn continues from the session's K/V and yields the ids of a fresh run over the same prompt."""
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
    assert engine.store.info(SessionKey("default", "s")).num_turns == 3


async def test_edited_history_reuses_the_common_prefix(engine, tiny):
    base = ids(tiny, "Paris is the capital of France; Berlin is")
    first = await run(engine, base, session="e", max_tokens=4, ignore_eos=True)
    edited = base[:5] + ids(tiny, " quick brown fox")
    before = engine.counter.num_prefill_tokens
    result = await run(engine, edited, session="e", max_tokens=5, ignore_eos=True)
    assert first.usage.cached_tokens == 0
    assert result.usage.cached_tokens == 5  # mid-block: the matching slots were copied
    assert engine.counter.num_prefill_tokens - before == len(edited) - 5
    assert result.token_ids == reference_greedy(tiny.model, edited, 5)


async def test_identical_retry_recomputes_one_token(engine, tiny):
    prompt = ids(tiny, "Hello world, hello kvserve.")
    await run(engine, prompt, session="r", max_tokens=3, ignore_eos=True)
    first = await run(engine, prompt, session="r", max_tokens=3, ignore_eos=True)
    before = engine.counter.num_prefill_tokens
    again = await run(engine, prompt, session="r", max_tokens=3, ignore_eos=True)
    assert engine.counter.num_prefill_tokens - before == 1
    assert first.usage.cached_tokens == again.usage.cached_tokens == len(prompt) - 1
    assert first.token_ids == again.token_ids == reference_greedy(tiny.model, prompt, 3)


async def test_stateless_requests_keep_no_session(engine, tiny):
    prompt = ids(tiny, "Numbers and symbols")
    first = await run(engine, prompt, max_tokens=2)
    second = await run(engine, prompt, max_tokens=2)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == len(prompt) - 1  # the tenant's prefix
    assert engine.store.session_keys() == set()


async def test_timeout_ends_request_and_keeps_the_transcript(engine, tiny):
    prompt = ids(tiny, "The quick brown fox")
    await run(engine, prompt, session="t", max_tokens=2, ignore_eos=True)
    slow = request(prompt, "t", "slow", max_tokens=3000, ignore_eos=True, timeout_s=0.05)
    result = await collect(engine.submit(slow))
    assert result.error.code == "request_timeout"
    info = engine.store.info(SessionKey("default", "t"))
    assert info.num_turns == 1
    assert info.num_transcript_tokens == len(prompt) + 2
    assert not info.is_in_use


async def test_cancel_stops_within_one_step(engine, tiny):
    handle = engine.submit(request(ids(tiny, "Hello"), rid="c", max_tokens=3000, ignore_eos=True))
    await handle.__anext__()  # admitted
    handle.cancel()
    await wait_until_async(lambda: engine.num_active == 0, what="the cancelled request to leave")
    assert (await settled(engine)).num_blocks_used == 0
    num_decoded = engine.counter.num_decode_tokens
    assert num_decoded < 3000
    await settled(engine)  # another step's chance: nothing more was decoded
    assert engine.counter.num_decode_tokens == num_decoded


def hold_prefill_steps_at_layer_one(
    monkeypatch, first: int = 1
) -> tuple[threading.Event, threading.Event, list[list[int]]]:
    """Prefill steps from the `first` on wait before their layer 1 until released; per prefill step, the layers it
    attended whole."""
    real, entered, release, done = attention._paged, threading.Event(), threading.Event(), []

    def held(step, layer, *args):
        if step.is_abandoned is None:  # a decode-only step
            return real(step, layer, *args)
        if layer == 0:
            done.append([])
        elif len(done) >= first and not release.is_set():
            entered.set()
            assert release.wait(DEADLINE_S), "the test never released the step"
        out = real(step, layer, *args)
        done[-1].append(layer)
        return out

    monkeypatch.setattr(attention, "_paged", held)
    return entered, release, done


async def test_a_prefill_whose_request_ended_stops_between_layers(engine, tiny, monkeypatch):
    """A long prefill's client leaves: its step stops before the next layer, so its session is free within a layer,
    not once the step (a minute on a busy CPU) is over."""
    entered, release, done = hold_prefill_steps_at_layer_one(monkeypatch)
    before = engine.counter.num_prefill_tokens
    handle = engine.submit(request(ids(tiny, "word " * 200), session="left", rid="left", max_tokens=4))
    await handle.__anext__()  # admitted
    assert await asyncio.to_thread(entered.wait, DEADLINE_S), "the prefill step did not start"
    handle.cancel()
    release.set()
    assert (await collect(handle)).error.code == "cancelled"
    assert done == [[0]]  # layer 1 never ran: the step stopped before it
    assert engine.loop.num_abandoned_steps == 1
    assert engine.counter.num_prefill_tokens == before  # none of its tokens counts as fed
    assert engine.store.info(SessionKey("default", "left")) is None  # its first request made no turn: gone
    assert (await settled(engine)).num_blocks_used == 0
    again = await run(engine, ids(tiny, "word " * 200), session="left", max_tokens=2)  # the retry is not 409'd
    assert again.finish_reason in ("stop", "length")


async def test_a_retry_reuses_what_the_abandoned_first_request_computed(tiny, monkeypatch):
    """The first request of a session left in its second prefill chunk: the session it made is not kept, but the
    chunk it finished stays as cache, so the retry computes only the rest."""
    engine = make_engine(tiny, block_size=4, max_batch_tokens=32)  # alone, a chunk is 4 x 32 tokens
    try:
        entered, release, done = hold_prefill_steps_at_layer_one(monkeypatch, first=2)  # the first chunk runs whole
        prompt = ids(tiny, "word " * 150)
        handle = engine.submit(request(prompt, session="retried", rid="first", max_tokens=4))
        await handle.__anext__()
        assert await asyncio.to_thread(entered.wait, DEADLINE_S), "the second chunk did not start"
        assert done == [[0, 1], [0]]  # the second chunk is held before its layer 1
        computed = engine.counter.num_prefill_tokens
        handle.cancel()
        release.set()
        assert (await collect(handle)).error.code == "cancelled"
        assert engine.loop.num_abandoned_steps == 1
        assert engine.store.info(SessionKey("default", "retried")) is None
        again = await run(engine, prompt, session="retried", rid="again", max_tokens=2)
        assert again.usage.cached_tokens == computed == 128
    finally:
        engine.stop()


async def test_a_prefill_step_another_request_needs_runs_whole(engine, tiny, monkeypatch):
    """Only a step nothing wants stops: one that also decodes a live request runs every layer."""
    live = engine.submit(request(ids(tiny, "Hello"), rid="live", max_tokens=3000, ignore_eos=True))
    await live.__anext__()
    await wait_until_async(lambda: engine.counter.num_decode_tokens > 0, what="the live request to decode")
    entered, release, done = hold_prefill_steps_at_layer_one(monkeypatch)
    gone = engine.submit(request(ids(tiny, "word " * 200), rid="gone", max_tokens=4))
    await gone.__anext__()
    assert await asyncio.to_thread(entered.wait, DEADLINE_S), "the prefill step did not start"
    gone.cancel()
    release.set()
    assert (await collect(gone)).error.code == "cancelled"
    assert done[0] == [0, 1]
    assert engine.loop.num_abandoned_steps == 0
    live.cancel()
    await wait_until_async(lambda: engine.num_active == 0, what="the live request to leave")


async def test_concurrent_seeded_requests_do_not_disturb_each_other(engine, tiny):
    prompt = ids(tiny, "Emoji and CJK")
    params = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    alone_a = await run(engine, prompt, seed=1, **params)
    alone_b = await run(engine, prompt, seed=2, **params)
    engine.loop.max_batch_seen = 0
    both = await asyncio.gather(
        run(engine, prompt, seed=1, rid="a", **params), run(engine, prompt, seed=2, rid="b", **params)
    )
    assert [both[0].token_ids, both[1].token_ids] == [alone_a.token_ids, alone_b.token_ids]
    assert alone_a.token_ids != alone_b.token_ids
    assert engine.loop.max_batch_seen == 2  # they really shared forward passes


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
    assert cut.finish_reason == "stop"
    assert cut.usage.completion_tokens == 4


async def test_prefill_projects_only_the_last_position(engine, tiny):
    seen = []
    head = tiny.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape))
    try:
        await run(engine, ids(tiny, "The quick brown fox jumps over the lazy dog."), max_tokens=2, ignore_eos=True)
    finally:
        hook.remove()
    assert [shape[1] for shape in seen] == [1, 1]  # prefill and one decode step: one position each


async def test_greedy_rows_are_sampled_one_by_one_when_the_batched_argmax_fails(engine, tiny, monkeypatch):
    def broken(logits, rows):
        raise RuntimeError("boom")

    monkeypatch.setattr(loop_module, "batch_greedy", broken)
    prompts = [ids(tiny, "Hello world"), ids(tiny, "The quick brown fox")]
    got = await asyncio.gather(
        *(run(engine, p, rid=f"g{i}", max_tokens=4, ignore_eos=True) for i, p in enumerate(prompts))
    )
    for prompt, result in zip(prompts, got, strict=True):
        assert result.token_ids == reference_greedy(tiny.model, prompt, 4)


async def test_sampled_rows_draw_alike_in_a_batch_and_one_by_one(engine, tiny, monkeypatch):
    """Seeded sampled rows: the batched draw, and the row-by-row fallback when it fails, give the same tokens."""
    cases = [("Hello world", dict(temperature=0.9, seed=5)), ("The quick brown fox", dict(top_p=0.8, top_k=7, seed=6))]

    async def both():
        return await asyncio.gather(
            *(run(engine, ids(tiny, text), rid=f"s{i}", max_tokens=8, **kw) for i, (text, kw) in enumerate(cases))
        )

    batched = await both()
    calls = []
    monkeypatch.setattr(loop_module, "batch_sample", lambda samplers, logits: calls.append(1) or 1 / 0)
    fallback = await both()
    assert calls  # the batched draw was tried, and failed
    assert [r.token_ids for r in fallback] == [r.token_ids for r in batched]
    assert len(set(batched[0].token_ids)) > 1


async def test_a_failing_request_fails_alone(engine, tiny, monkeypatch):
    real_sample = Sampler.sample

    def flaky(self, logits):
        if self.params.seed == 666:
            raise RuntimeError("boom")
        return real_sample(self, logits)

    monkeypatch.setattr(Sampler, "sample", flaky)
    prompt = ids(tiny, "Hello world")
    bad, good = await asyncio.gather(
        # a penalty to apply: it is sampled on its own, not in the step's batched draw
        run(engine, prompt, session="f", rid="bad", seed=666, temperature=0.8, presence_penalty=0.1, max_tokens=5),
        run(engine, prompt, rid="good", seed=1, max_tokens=5, ignore_eos=True),
    )
    assert bad.error.code == "internal_error"
    assert good.usage.completion_tokens == 5
    assert engine.store.info(SessionKey("default", "f")) is None  # its first request failed: no session is left
    assert (await run(engine, prompt, session="f", max_tokens=2)).usage is not None  # the engine keeps serving
    info = engine.store.info(SessionKey("default", "f"))
    assert (info.num_turns, info.is_in_use) == (1, False)


async def test_a_failure_while_finishing_does_not_stop_the_engine(engine, tiny, monkeypatch):
    def broken(self, finish_reason):
        raise RuntimeError("injected")

    monkeypatch.setattr(Sequence, "completed_turn", broken)
    prompt = ids(tiny, "Hello world")
    first = await run(engine, prompt, session="fin", max_tokens=3, ignore_eos=True)
    assert first.error.code == "internal_error"  # the turn could not be recorded: the client hears so
    assert engine.store.info(SessionKey("default", "fin")) is None  # its first request failed: none is left
    assert (await settled(engine)).num_blocks_used == 0
    monkeypatch.undo()
    assert (await run(engine, prompt, session="fin", max_tokens=2)).usage is not None
    info = engine.store.info(SessionKey("default", "fin"))
    assert (info.num_turns, info.is_in_use) == (1, False)

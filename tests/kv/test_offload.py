"""Sessions leave the device pool for lower tiers before their blocks are reused, and come back exactly.

On CPU the pool stands in for the device: the host tier (with a budget) and the disk tier
run the same code as with CUDA, minus pinned memory and asynchronous copies. The engine
decides at admission, by itself, whether a snapshot is worth reading.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import pytest
import torch

from server.kv import offload
from server.kv.blocks import BlockManager
from server.kv.offload import Offloader
from server.kv.pool import KVLayout, KVPool
from server.kv.snapshot import Snapshot
from server.kv.tiers import TierStore
from server.sessions.journal import Journal
from server.sessions.record import CompletedTurn, SessionKey, Usage
from server.sessions.store import SessionStore
from tests.helpers import make_engine, paused, reference_greedy, run
from tests.kv.test_blocks import fill

BLOCK = 4
TOKEN_BYTES = 2 * 2 * 2 * 16 * 8  # K+V x layers x kv_heads x head_dim x float64


def engine_with_tiers(tiny, tmp_path, host_budget: int, num_blocks: int = 24):
    tiers = TierStore(host_budget, 1 << 30, tmp_path / "kv", block_size=BLOCK)
    return make_engine(tiny, tiers=tiers, budget_bytes=num_blocks * BLOCK * TOKEN_BYTES, block_size=BLOCK)


def words(tiny, text: str) -> list[int]:
    return tiny.tokenizer(text)["input_ids"]


async def cached_in_pool(engine, ids: list[int]) -> int:
    return await engine.query(lambda: engine.blocks.chain("default", ids)[1])


@pytest.mark.parametrize("tier", ["host", "disk"])
async def test_evicted_session_is_restored_from_a_lower_tier_exactly(tiny, tmp_path, tier):
    engine = engine_with_tiers(tiny, tmp_path, host_budget=(1 << 30) if tier == "host" else 0)
    tiers, key = engine.offloader.tiers, SessionKey("default", "a")
    try:
        prompt = words(tiny, "The quick brown fox jumps over the lazy dog. Sessions keep their cache.")
        first = await run(engine, prompt, session="a", max_tokens=6, ignore_eos=True)
        transcript = prompt + first.token_ids
        assert await cached_in_pool(engine, transcript) == len(transcript) - 1
        # Other sessions fill the pool: a's blocks are reused, but a's K/V went down a tier first.
        for i, text in enumerate(
            [
                "Paris is the capital of France;",
                "Berlin is the capital of Germany.",
                "Numbers 0123456789 and symbols !?.",
                "Hello world, hello kvserve.",
            ]
        ):
            await run(engine, words(tiny, text * 2), session=f"other{i}", max_tokens=4, ignore_eos=True)
        tiers.flush_pending()
        assert engine.offloader.num_spilled >= 1
        assert await cached_in_pool(engine, transcript) < len(transcript) - 1  # gone from the pool
        usage = tiers.usage(key)
        assert (usage.host_tokens if tier == "host" else usage.disk_tokens) == len(transcript) - 1
        # The next turn restores from that tier instead of recomputing, and computes the same tokens.
        turn2 = transcript + words(tiny, " Hello world")
        before = engine.counter.num_prefill_tokens
        second = await run(engine, turn2, session="a", max_tokens=5, ignore_eos=True)
        assert second.admitted.source == tier
        assert second.admitted.num_cached == len(transcript) - 1
        assert second.usage.cached_tokens == len(transcript) - 1
        assert engine.counter.num_prefill_tokens - before == len(turn2) - (len(transcript) - 1)
        assert second.token_ids == reference_greedy(tiny.model, turn2, 5)
        # The restored blocks were published each under its predecessor's hash, like computed ones: the pool now
        # gives the whole prompt to whoever asks next.
        assert await cached_in_pool(engine, turn2) == len(turn2)
    finally:
        engine.stop()
        tiers.close()


async def test_shutdown_saves_every_session_in_the_pool(tiny, tmp_path):
    engine = engine_with_tiers(tiny, tmp_path, host_budget=0, num_blocks=64)
    try:
        for name in ("s1", "s2"):
            await run(engine, words(tiny, f"Hello {name}, the quick brown fox."), session=name, max_tokens=3)
    finally:
        engine.stop()
    tiers = engine.offloader.tiers
    assert engine.save_sessions() == 2
    tiers.flush()
    assert sorted(p.name for p in (tmp_path / "kv").rglob("*.kv.json")) == ["session-s1.kv.json", "session-s2.kv.json"]
    assert all(tiers.usage(SessionKey("default", name)).disk_tokens > 0 for name in ("s1", "s2"))
    assert engine.save_sessions() == 0  # already covered: nothing is written twice
    tiers.close()


async def test_a_snapshot_is_read_only_when_it_holds_more_than_the_pool(tiny, tmp_path, monkeypatch):
    engine = engine_with_tiers(tiny, tmp_path, host_budget=1 << 30)
    tiers = engine.offloader.tiers
    try:
        prompt = words(tiny, "The quick brown fox jumps over the lazy dog.")
        first = await run(engine, prompt, session="a", max_tokens=4, ignore_eos=True)
        transcript = prompt + first.token_ids
        snapshot = await engine.query(lambda: engine.offloader.gather(SessionKey("default", "a"), transcript))
        tiers.put(snapshot)  # a copy down a tier, while the pool still holds everything
        turn2 = transcript + words(tiny, " Hello")
        assert await engine.query(lambda: engine.blocks.match("default", turn2, len(turn2) - 1).num_tokens) == (
            snapshot.num_tokens
        )  # the copy holds exactly what the pool does
        reads: list[SessionKey] = []
        fetch = engine.offloader.fetch
        monkeypatch.setattr(engine.offloader, "fetch", lambda key, ids: reads.append(key) or fetch(key, ids))
        second = await run(engine, turn2, session="a", max_tokens=2)
        assert second.admitted.source == "device"
        assert second.admitted.num_cached == snapshot.num_tokens
        assert reads == []  # the pool already had it all: the copy was not even read
    finally:
        engine.stop()
        tiers.close()


async def a_turns_snapshot(tiny, tmp_path) -> tuple[list[int], list[int], Snapshot]:
    """(prompt, transcript, the snapshot of session "a"'s K/V) after one 4-token turn on an engine now stopped."""
    source = engine_with_tiers(tiny, tmp_path, host_budget=1 << 30)
    try:
        prompt = words(tiny, "The quick brown fox jumps over the lazy dog. Sessions keep their cache.")
        first = await run(source, prompt, session="a", max_tokens=4, ignore_eos=True)
        transcript = prompt + first.token_ids
        snapshot = await source.query(lambda: source.offloader.gather(SessionKey("default", "a"), transcript))
    finally:
        source.stop()
    return prompt, transcript, snapshot


async def test_a_failed_restore_falls_back_to_computing(tiny, tmp_path, monkeypatch):
    _prompt, transcript, snapshot = await a_turns_snapshot(tiny, tmp_path)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(offload, "restore", out_of_memory)
    fresh = engine_with_tiers(tiny, tmp_path / "other", host_budget=1 << 30)  # an empty pool
    fresh.offloader.tiers.put(snapshot)
    try:
        turn2 = transcript + words(tiny, " Hello")
        second = await run(fresh, turn2, session="a", max_tokens=4, ignore_eos=True)
        assert second.error is None
        assert second.usage.cached_tokens == 0  # recomputed, not failed
        assert second.token_ids == reference_greedy(tiny.model, turn2, 4)
        assert await fresh.query(lambda: (fresh.blocks.num_used, fresh.blocks.num_reserved)) == (0, 0)  # no leak
    finally:
        fresh.stop()
        fresh.offloader.tiers.close()


async def test_a_snapshot_covering_the_whole_prompt_leaves_its_last_token_to_compute(tiny, tmp_path):
    """Regenerating a turn: the prompt is a prefix of what the session's snapshot holds. Its last token is computed
    all the same, for the logits the first new token is sampled from."""
    prompt, transcript, snapshot = await a_turns_snapshot(tiny, tmp_path)
    assert snapshot.num_tokens > len(prompt)
    fresh = engine_with_tiers(tiny, tmp_path / "other", host_budget=1 << 30)  # an empty pool
    fresh.offloader.tiers.put(snapshot)
    try:
        before = fresh.counter.num_prefill_tokens
        again = await run(fresh, prompt, session="a", max_tokens=4, ignore_eos=True)
        assert again.admitted.source == "host"
        assert again.admitted.num_cached == len(prompt) - 1
        assert fresh.counter.num_prefill_tokens - before == 1
        assert again.token_ids == transcript[len(prompt) :] == reference_greedy(tiny.model, prompt, 4)
    finally:
        fresh.stop()
        fresh.offloader.tiers.close()


async def test_spilling_counts_blocks_promised_to_admitted_requests_as_taken(tiny, tmp_path):
    """Two requests admitted in one step: the second's blocks fit in the free ones only if the first's reservation
    is forgotten. It is not: the idle session whose blocks they will take goes down a tier first, and its next turn
    is restored from there instead of computed."""
    engine = engine_with_tiers(tiny, tmp_path, host_budget=1 << 30, num_blocks=24)
    tiers, key = engine.offloader.tiers, SessionKey("default", "a")
    try:
        prompt = words(tiny, "The quick brown fox jumps over the lazy dog. Sessions keep their cache.")[:12]
        first = await run(engine, prompt, session="a", max_tokens=4, ignore_eos=True)
        transcript = prompt + first.token_ids
        assert await cached_in_pool(engine, transcript) == 15  # 4 idle blocks; 20 free
        other, last = words(tiny, "Numbers 0123456789"), words(tiny, "Paris is the capital")
        async with paused(engine):
            # R reserves 17 blocks: 3 free ones are left. P needs 5: admitted, but 2 of them will be a's.
            r = asyncio.ensure_future(run(engine, other, rid="R", max_tokens=17 * BLOCK - len(other), ignore_eos=True))
            p = asyncio.ensure_future(run(engine, last, rid="P", max_tokens=5 * BLOCK - len(last), ignore_eos=True))
            await asyncio.sleep(0)  # both are submitted, in this order
        await asyncio.gather(r, p)
        assert engine.offloader.num_spilled == 1, "a's K/V was not copied down before promised blocks took its place"
        assert tiers.usage(key).host_tokens == 15
        assert await cached_in_pool(engine, transcript) < 15  # R and P did take some of a's blocks
        turn2 = transcript + words(tiny, " Hello")
        second = await run(engine, turn2, session="a", max_tokens=3, ignore_eos=True)
        assert second.admitted.source == "host"
        assert second.usage.cached_tokens == 15
        assert second.token_ids == reference_greedy(tiny.model, turn2, 3)
    finally:
        engine.stop()
        tiers.close()


async def test_a_turn_that_cannot_be_journaled_fails_alone(tiny, tmp_path):
    class FullDisk(Journal):
        def save(self, key, record):
            if key.name == "full" and record["transcript_ids"]:  # the disk fills up after the session was made
                raise OSError(28, "No space left on device")
            super().save(key, record)

    store = SessionStore(ttl_s=3600, journal=FullDisk(tmp_path))
    engine = make_engine(tiny, store=store, budget_bytes=64 * BLOCK * TOKEN_BYTES, block_size=BLOCK)
    store.create(SessionKey("default", "full"), tiny.spec.id)  # it exists before: a refused turn leaves it as it was
    try:
        prompt = words(tiny, "Hello world")
        results = await asyncio.gather(
            run(engine, prompt, session="full", rid="a", max_tokens=3),
            run(engine, prompt, session="fine", rid="b", max_tokens=3),
        )
        assert results[0].error.code == "state_unavailable"  # 503: the turn did not happen
        assert results[1].error is None
        assert store.info(SessionKey("default", "full")).num_turns == 0  # as before the turn
        assert not store.info(SessionKey("default", "full")).is_in_use
        assert store.info(SessionKey("default", "fine")).num_turns == 1
    finally:
        engine.stop()


def test_forgetting_a_session_never_drops_a_block_of_another():
    manager, store = BlockManager(16, 4), SessionStore(ttl_s=3600)
    kept, gone = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 9]
    for name, ids in (("kept", kept), ("gone", gone)):
        store.release(
            store.acquire(SessionKey("default", name), "m"), CompletedTurn(ids, "", "stop", Usage(6, 0, 0), None)
        )
    manager.release(fill(manager, "default", kept))  # only `kept` has K/V in the pool, idle and cached
    assert store.delete(SessionKey("default", "gone"))
    Offloader(None, manager, store, TierStore(0, 0, None, block_size=4), "m", "fp").discard_forgotten()  # type: ignore[arg-type]
    # `gone`'s own second block was never there: the partially matching block is `kept`'s, and stays
    assert manager.match("default", kept, 6).num_tokens == 6


# (the deleted transcript, another of the tenant's, tokens of the deleted one's K/V left cached, blocks left cached)
FORGET_CASES = {
    "a prefix of another": ([1, 2, 3, 4, 5, 6], [*range(1, 11)], 5, 2),
    "another ends inside its block": ([*range(1, 11)], [1, 2, 3, 4, 5, 6], 6, 2),
    "shares whole blocks": ([*range(1, 14)], [*range(1, 9), 20, 21], 8, 2),
    "shares nothing": ([*range(1, 10)], [50, 51], 0, 0),
}


@pytest.mark.parametrize("case", sorted(FORGET_CASES))
def test_forgetting_a_session_drops_exactly_what_no_other_transcript_reaches(case):
    """The deleted session's K/V leaves the pool but for what another transcript of its tenant reaches: all of it
    when it is a prefix of the other, whole shared blocks, and the part of a block the other ends inside."""
    gone, other, num_left, blocks_left = FORGET_CASES[case]
    manager, store = BlockManager(16, BLOCK), SessionStore(ttl_s=3600)
    for name, ids in (("gone", gone), ("other", other)):
        session = store.acquire(SessionKey("default", name), "m")
        store.release(session, CompletedTurn(ids, "", "stop", Usage(len(ids), 0, 0), None))
    held = fill(manager, "default", gone[:-1])  # the deleted session's K/V, as its turn left it (the last token's
    manager.release(held)  # is computed by the next turn), idle and cached; the other's is not in the pool
    assert store.delete(SessionKey("default", "gone"))
    tiers = TierStore(0, 0, None, block_size=BLOCK)
    Offloader(None, manager, store, tiers, "m", "fp").discard_forgotten()  # type: ignore[arg-type]
    assert manager.match("default", gone, len(gone) - 1).num_tokens == num_left
    assert manager.num_free == manager.num_blocks - blocks_left
    reached = min(num_left, len(other) - 1)
    assert manager.match("default", other, len(other) - 1).num_tokens == reached  # the other finds all it reaches


@pytest.mark.parametrize("pool_kv_dtype", [None, torch.int8], ids=["compute", "int8"])
def test_a_snapshot_fits_the_pool_when_this_model_computed_it_as_the_pool_does_however_it_is_stored(pool_kv_dtype):
    """What the scheduler asks before it restores a snapshot: another model's K/V, or K/V computed in another dtype
    or shape, would be restored as garbage; a copy a tier keeps in 8 bits (or a pool that keeps 8 bits, a copy in
    the compute dtype) is converted on the way in."""
    computed = KVLayout(2, 2, 16, torch.float32)
    pool = KVPool(dataclasses.replace(computed, kv_dtype=pool_kv_dtype), 4, BLOCK, torch.device("cpu"))
    tiers = TierStore(0, 0, None, block_size=BLOCK)
    offloader = Offloader(pool, BlockManager(4, BLOCK), SessionStore(ttl_s=3600), tiers, "m", "fp")

    def snapshot(layout: KVLayout, digests: str = "fp") -> Snapshot:
        return Snapshot(SessionKey("default", "s"), "m", layout, digests, [1, 2, 3], [], [])  # tensors never read

    for stored in ("pool", "int8", "fp8"):
        assert offloader.fits(snapshot(computed.stored_as(stored)))
    assert not offloader.fits(snapshot(computed, digests="another model"))
    assert not offloader.fits(snapshot(dataclasses.replace(computed, dtype=torch.float64)))
    assert not offloader.fits(snapshot(dataclasses.replace(computed, dtype=torch.float64, kv_dtype=torch.int8)))
    assert not offloader.fits(snapshot(dataclasses.replace(computed, num_kv_heads=1)))


async def test_a_snapshot_of_another_dtype_is_recomputed_not_misread(tiny, tmp_path, caplog):
    tiers = TierStore(0, 1 << 30, tmp_path / "kv", block_size=BLOCK)
    store = SessionStore(ttl_s=3600, forgetters=(tiers,))
    engine = make_engine(tiny, store=store, tiers=tiers, budget_bytes=64 * BLOCK * TOKEN_BYTES, block_size=BLOCK)
    prompt = words(tiny, "The quick brown fox jumps over the lazy dog.")
    try:
        first = await run(engine, prompt, session="a", max_tokens=4, ignore_eos=True)
    finally:
        engine.stop()
    assert engine.save_sessions() == 1
    tiers.flush()
    tiers.close()
    # The same weights served in float32 (as `dtype: auto` may pick on another machine): the float64 K/V on disk
    # would be read as garbage, so the next turn computes its prompt.
    as_fp32 = dataclasses.replace(tiny, model=copy.deepcopy(tiny.model).float(), dtype=torch.float32)
    tiers = TierStore(0, 1 << 30, tmp_path / "kv", block_size=BLOCK)
    assert tiers.scan() == 1
    engine = make_engine(as_fp32, store=store, tiers=tiers, budget_bytes=64 * BLOCK * TOKEN_BYTES, block_size=BLOCK)
    try:
        turn2 = prompt + first.token_ids + words(tiny, " Hello")
        second = await run(engine, turn2, session="a", max_tokens=3, ignore_eos=True)
        assert second.admitted.source == "none"
        assert second.usage.cached_tokens == 0
        assert second.token_ids == reference_greedy(as_fp32.model, turn2, 3)
        assert "restoring K/V from a snapshot failed" not in caplog.text  # not even tried: its fingerprint differs
    finally:
        engine.stop()
        tiers.close()

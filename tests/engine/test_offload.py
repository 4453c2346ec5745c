"""Sessions leave the device pool for lower tiers before their blocks are reused, and come back exactly.

On CPU the pool stands in for the device: the host tier (with a budget) and the disk tier
run the same code as with CUDA, minus pinned memory and asynchronous copies.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from server.engine import offload
from server.engine.batch_engine import BatchEngine, PoolConfig
from server.engine.journal import Journal
from server.engine.kv_store import KVStore
from server.engine.tiers import TierStore
from server.engine.types import SessionKey
from server.engine.worker import Engine
from tests.helpers import reference_greedy, run

BLOCK = 4
TOKEN_BYTES = 2 * 2 * 2 * 16 * 8  # K+V x layers x kv_heads x head_dim x float64


def engine_with_tiers(tiny, tmp_path, host_budget: int, num_blocks: int = 24) -> BatchEngine:
    tiers = TierStore(host_budget, 1 << 30, tmp_path / "kv")
    store = KVStore(budget_bytes=1 << 30, ttl_s=3600, tiers=tiers)
    config = PoolConfig(budget_bytes=num_blocks * BLOCK * TOKEN_BYTES, block_size=BLOCK, max_batch_tokens=64)
    engine = BatchEngine(tiny, store, config)
    engine.start()
    return engine


def words(tiny, text: str) -> list[int]:
    return tiny.tokenizer(text)["input_ids"]


@pytest.mark.parametrize("tier", ["host", "disk"])
async def test_evicted_session_is_restored_from_a_lower_tier_exactly(tiny, tmp_path, tier):
    engine = engine_with_tiers(tiny, tmp_path, host_budget=(1 << 30) if tier == "host" else 0)
    tiers, key = engine.store.tiers, SessionKey("default", "a")
    try:
        prompt = words(tiny, "The quick brown fox jumps over the lazy dog. Sessions keep their cache.")
        first = await run(engine, prompt, session="a", max_tokens=6, ignore_eos=True)
        transcript = prompt + first.token_ids
        assert engine.cached_tokens("default", transcript) == len(transcript) - 1
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
        assert engine.cached_tokens("default", transcript) < len(transcript) - 1  # gone from the pool
        usage = tiers.usage(key)
        assert (usage.host_tokens if tier == "host" else usage.disk_tokens) == len(transcript) - 1
        # The next turn restores from that tier instead of recomputing, and computes the same tokens.
        turn2 = transcript + words(tiny, " Hello world")
        snapshot = tiers.fetch(key, engine.model_id, engine.fingerprint)
        before = engine.counter.num_prefill_tokens
        second = await run(engine, turn2, session="a", snapshot=snapshot, max_tokens=5, ignore_eos=True)
        assert second.admitted.source == tier and second.admitted.num_cached == len(transcript) - 1
        assert second.usage.cached_tokens == len(transcript) - 1
        assert engine.counter.num_prefill_tokens - before == len(turn2) - (len(transcript) - 1)
        assert second.token_ids == reference_greedy(tiny.model, turn2, 5)
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
    assert engine.save_sessions() == 2
    engine.store.tiers.flush()
    assert sorted(p.name for p in (tmp_path / "kv").rglob("*.safetensors")) == [
        "session-s1.safetensors",
        "session-s2.safetensors",
    ]
    assert engine.save_sessions() == 0  # already covered: nothing is written twice
    engine.store.tiers.close()


async def test_a_failed_restore_falls_back_to_computing(tiny, tmp_path, monkeypatch):
    engine = engine_with_tiers(tiny, tmp_path, host_budget=1 << 30)
    try:
        prompt = words(tiny, "The quick brown fox jumps over the lazy dog. Sessions keep their cache.")
        first = await run(engine, prompt, session="a", max_tokens=4, ignore_eos=True)
        transcript = prompt + first.token_ids
        snapshot = offload.gather(engine.pool, engine.blocks, SessionKey("default", "a"), transcript, "x", "y")
        snapshot.fingerprint = engine.fingerprint
        turn2 = transcript + words(tiny, " Hello")

        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("no room")

        monkeypatch.setattr(offload, "restore", out_of_memory)
        fresh = engine_with_tiers(tiny, tmp_path / "other", host_budget=1 << 30)  # an empty pool
        try:
            used_before = fresh.blocks.num_used
            second = await run(fresh, turn2, session="a", snapshot=snapshot, max_tokens=4, ignore_eos=True)
            assert second.error is None and second.usage.cached_tokens == 0  # recomputed, not failed
            assert second.token_ids == reference_greedy(tiny.model, turn2, 4)
            assert fresh.blocks.num_used == used_before and fresh.blocks.num_reserved == 0  # nothing leaked
        finally:
            fresh.stop()
    finally:
        engine.stop()


async def test_a_turn_that_cannot_be_journaled_fails_alone(tiny, tmp_path):
    class FullDisk(Journal):
        def save(self, key, record):
            if key.name == "full":
                raise OSError(28, "No space left on device")
            super().save(key, record)

    store = KVStore(budget_bytes=1 << 30, ttl_s=3600, journal=FullDisk(tmp_path))
    engine = BatchEngine(tiny, store, PoolConfig(budget_bytes=64 * BLOCK * TOKEN_BYTES, block_size=BLOCK))
    engine.start()
    try:
        prompt = words(tiny, "Hello world")
        results = await asyncio.gather(
            run(engine, prompt, session="full", rid="a", max_tokens=3),
            run(engine, prompt, session="fine", rid="b", max_tokens=3),
        )
        assert results[0].error.code == "internal_error" and results[1].error is None
        assert store.info(SessionKey("default", "full")).num_turns == 0  # as before the turn
        assert not store.info(SessionKey("default", "full")).is_in_use
        assert store.info(SessionKey("default", "fine")).num_turns == 1
    finally:
        engine.stop()


async def test_the_per_session_engine_restores_from_a_snapshot_too(tiny, tmp_path):
    batch = engine_with_tiers(tiny, tmp_path, host_budget=1 << 30)
    try:
        prompt = words(tiny, "The quick brown fox jumps over the lazy dog.")
        first = await run(batch, prompt, session="a", max_tokens=4, ignore_eos=True)
        transcript = prompt + first.token_ids
        key = SessionKey("default", "a")
        snapshot = offload.gather(batch.pool, batch.blocks, key, transcript, batch.model_id, batch.fingerprint)
    finally:
        batch.stop()
    solo = Engine(tiny, KVStore(budget_bytes=1 << 30, ttl_s=3600))
    solo.start()
    try:
        assert solo.fingerprint == snapshot.fingerprint
        turn2 = transcript + words(tiny, " Hello")
        second = await run(solo, turn2, session="a", snapshot=snapshot, max_tokens=4, ignore_eos=True)
        assert second.admitted.source == "host" and second.usage.cached_tokens == len(transcript) - 1
        assert second.token_ids == reference_greedy(tiny.model, turn2, 4)
    finally:
        solo.stop()

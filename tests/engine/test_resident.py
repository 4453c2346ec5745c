"""What an engine says its model holds: the parts add up, each is what the objects hold, and the load log says it."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from server.engine.resident import MIB, ResidentBytes
from server.hosting import ModelHost
from server.kv import backends, kernels
from server.kv.snapshot import Snapshot
from server.kv.tiers import TierStore
from server.models.weight_bytes import weight_bytes
from server.sessions.record import SessionKey
from server.settings import Settings
from tests.helpers import DEADLINE_S, make_engine, run, wait_until_async

PARTS = ("weights", "packed_weights", "gemv_weights", "kv_pool", "head_layouts", "host_tier")


def words(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


def test_the_parts_add_up_to_the_total():
    held = ResidentBytes(1, 20, 300, 4000, 50000, 600000, kv_pool_touched=7)
    assert ResidentBytes.PARTS == PARTS
    assert held.total == 654321  # the pool as allocated; what of it is touched is no part
    assert held.as_dict() == dict(zip(PARTS, (1, 20, 300, 4000, 50000, 600000), strict=True)) | {
        "kv_pool_touched": 7,
        "total": 654321,
    }


async def test_an_engine_holds_its_models_weights_its_pool_and_its_snapshots_in_host_ram(tiny):
    tiers = TierStore(1 << 20, 0, None)  # host RAM only
    engine = make_engine(tiny, tiers=tiers, budget_bytes=16 << 20)
    try:
        held = engine.resident()
        model = weight_bytes(tiny.model)
        every = [*tiny.model.parameters(), *tiny.model.buffers()]  # no two share a storage
        assert held.weights == model.dense == sum(t.numel() * t.element_size() for t in every)
        assert (held.packed_weights, held.gemv_weights) == (0, 0)  # float64: nothing packed
        assert held.kv_pool == engine.runner.pool.nbytes == 16 << 20
        assert held.total == sum(getattr(held, part) for part in PARTS)
        await run(engine, words(tiny, "Hello there, general kenobi"), max_tokens=8, ignore_eos=True)
        touched = engine.resident().kv_pool_touched
        assert touched is not None
        assert 0 < touched <= held.kv_pool  # the slots written are in RAM
        key = SessionKey("default", "spilled")
        k = [torch.zeros(2, 24, 16, dtype=torch.float64) for _ in range(2)]  # [kv_heads, tokens, head_dim]
        v = [torch.zeros(2, 24, 16, dtype=torch.float64) for _ in range(2)]
        layout = engine.runner.layout
        tiers.put(Snapshot(key, "another model", layout, "", list(range(24)), k, v))
        assert engine.resident().host_tier == 0  # another model's snapshot is not this one's
        tiers.put(Snapshot(SessionKey("default", "mine"), "tiny", layout, "", list(range(24)), k, v))
        assert engine.resident().host_tier == 4 * 24 * 2 * 16 * 8
    finally:
        engine.stop()


@pytest.mark.skipif(not kernels.paged_prefill_available(torch.bfloat16, 64), reason="no AVX512-BF16 build")
async def test_the_kept_head_layouts_are_published_as_the_backend_holds_them_and_gone_when_idle(
    wide_heads_bf16, monkeypatch
):
    """Three conversations behind one cached prompt decode with a cascade head, kept laid out across steps."""
    loaded = wide_heads_bf16[0]
    monkeypatch.setattr(backends, "TILED_HEAD_MIN_KEYS", 64)
    engine = make_engine(loaded, budget_bytes=8 << 20, block_size=4, deterministic=True)  # the tiled walk
    backend = engine.runner.backend
    assert backend.name == "tiled"
    published: list[tuple[int, int]] = []
    publish = engine.loop._publish_stats

    def spy() -> None:
        publish()
        published.append((engine.loop.stats.head_layout_bytes, backend.kept_bytes()))

    monkeypatch.setattr(engine.loop, "_publish_stats", spy)
    system = words(loaded, "You are a terse assistant who answers in one word. " * 16)
    try:
        await run(engine, system, rid="warm", max_tokens=1)
        prompts = [system + words(loaded, tail) for tail in ("Paris is", "Rome was", "The sea")]
        await asyncio.gather(*(run(engine, p, rid=f"r{i}", max_tokens=6) for i, p in enumerate(prompts)))
        await wait_until_async(lambda: backend.kept_bytes() == 0, what="the kept layouts dropped when idle")
        await wait_until_async(lambda: engine.resident().head_layouts == 0, what="none published once idle")
    finally:
        engine.stop()
    assert all(stat == kept for stat, kept in published)
    most = max(stat for stat, _ in published)
    assert most >= backend.head_layouts.nbytes(1)  # a head of at least one block was kept, every layer laid out


def test_the_load_log_says_what_each_model_holds(tiny_spec, caplog):
    caplog.set_level(logging.INFO, logger="kvserve")
    host = ModelHost(Settings(state_dir=None, kv_budget_bytes=8 << 20), [tiny_spec])
    host.start()
    host.wait_loaded(DEADLINE_S)
    try:
        engine = host.engines["tiny"]
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model tiny: holds ")]
        assert len(lines) == 1, lines
        held = engine.resident()
        line = lines[0]
        assert line.startswith(f"model tiny: holds weights {held.weights / MIB:.0f} MiB, packed for oneDNN 0 MiB, ")
        assert f"K/V pool {held.kv_pool / MIB:.0f} MiB (" in line
        assert f"; total {held.total / MIB:.0f} MiB; the process: " in line
        assert " MiB resident, after " in line
    finally:
        host.close()

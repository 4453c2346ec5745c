"""Deterministic mode, in bf16: a greedy turn's ids do not depend on the cache, the chunks or the batch.

The model is the tiny Llama in bf16 with head size 64 (so the kernel takes its bf16 dot-product path). The
prompts are seeded random token ids. Each test's seeds were found by running seeds through its case with the
mode off and keeping ones whose ids differed from the cold run, a bf16 rounding flipping a near-tie (on a
2-core AVX512 EPYC, seeds 0-79: a session's second turn in 11 of the first 40, a prefix shared at 23 tokens
in 1, chunks of 7 tokens in 1, a restore from Redis first at seed 6; 8 prompts behind a cached 300-token
system prompt: 12 of 12 seeds, 3 prompts 8 of 12). With the mode off, most of these tests fail there (which
attention path runs is then chosen by timing at start, so which ones varies from run to run); on other CPUs
the seeds may not be near-ties, and the tests still hold the mode to its promise.
"""

from __future__ import annotations

import asyncio
import gc
import random
import weakref

import pytest
import torch

from server.engine import model_runner
from server.kv import kernels
from server.kv.pool import KVLayout
from server.models.packed_linear import ROW_TILE, PackedLinear, pad_rows
from tests.helpers import make_engine, run, tiers_below

CHUNKS = [46, 1]  # differed with the prompt prefilled in chunks of 7
PREFIXES = [56, 9]  # differed after another request's prefix of 23 (56)
SESSIONS = [1, 3, 4]  # a session's second turn differed
BATCHES = [1, 4]  # differed behind a cached system prompt in batches of 3 and 8
TIERS = [1, 6]  # a second turn restored from host RAM or disk (1), or Redis (6), differed
NEW = 24  # tokens generated a turn
BUDGET = 64 << 20


@pytest.fixture(scope="module")
def bf16(wide_heads_bf16):
    """The model; skipped, with the reason, on a CPU where the mode cannot be had (no paged kernel built, or
    oneDNN's products not batch-invariant in any way the probe knows): there the server says so too."""
    loaded = wide_heads_bf16[0]
    probe = make_engine(loaded, budget_bytes=BUDGET, deterministic=True)
    probe.stop()
    if not probe.runner.deterministic:
        pytest.skip(f"deterministic mode here: {probe.runner.deterministic_detail}")
    return loaded


def prompt(loaded, seed: int) -> list[int]:
    gen = random.Random(seed)
    return [gen.randrange(3, loaded.vocab_size) for _ in range(gen.randint(20, 90))]


def engine(loaded, **config):
    config.setdefault("budget_bytes", BUDGET)
    return make_engine(loaded, deterministic=True, **config)


async def cold(loaded, ids: list[int]) -> list[int]:
    """The turn with every cache bypassed, alone, on an engine of its own."""
    fresh = engine(loaded)
    try:
        return (await run(fresh, ids, max_tokens=NEW, ignore_eos=True, use_cache=False)).token_ids
    finally:
        fresh.stop()


def laid_out(runner, monkeypatch) -> list[tuple[list[int], int, int, int]]:
    """Each step as the runner lays it out: (its rows' tokens, SDPA spans, decode kernel rows, prefill kernel spans)."""
    steps: list[tuple[list[int], int, int, int]] = []
    prepare = runner._prepare

    def spy(rows):
        meta, *rest = prepare(rows)
        decode = 0 if meta.decode is None else len(meta.decode.rows)
        prefill = 0 if meta.prefill is None else len(meta.prefill.q_lens)
        steps.append(([len(r.token_ids) for r in rows], len(meta.spans), decode, prefill))
        return (meta, *rest)

    monkeypatch.setattr(runner, "_prepare", spy)
    return steps


async def test_the_mode_is_on_and_every_row_takes_one_walk(bf16, monkeypatch):
    e = engine(bf16, max_batch_tokens=16)
    steps = laid_out(e.runner, monkeypatch)
    tiled = kernels.paged_prefill_available(torch.bfloat16, 64)
    try:
        assert e.runner.deterministic
        assert e.runner.backend.name == ("tiled" if tiled else "kernel")
        assert e.runner.deterministic_detail.startswith(f"on: attention by the {e.runner.backend.name} backend")
        # one prompt decodes while the other is prefilled in chunks: steps with a one-token row beside a chunk
        turns = [run(e, prompt(bf16, seed), rid=f"r{seed}", max_tokens=6, ignore_eos=True) for seed in (3, 4)]
        await asyncio.gather(*turns)
    finally:
        e.stop()
    assert any(1 in rows and max(rows) > 1 for rows, *_ in steps)
    for (
        rows,
        spans,
        decode,
        prefill,
    ) in steps:  # the tiled walk: chunks and decode rows; else kernel rows, token by token
        chunks = sum(n > 1 for n in rows)
        assert (spans, decode, prefill) == ((0, len(rows) - chunks, chunks) if tiled else (0, sum(rows), 0))


async def test_without_the_tiled_kernel_every_token_is_a_decode_kernel_row_and_the_ids_hold(bf16, monkeypatch):
    monkeypatch.setattr(kernels, "paged_prefill_available", lambda dtype, head_dim: False)
    ids = prompt(bf16, SESSIONS[0])
    e = engine(bf16, max_batch_tokens=16)
    steps = laid_out(e.runner, monkeypatch)
    try:
        assert e.runner.deterministic
        assert (e.runner.backend.name, e.runner.backend.every_token) == ("kernel", True)
        first = await run(e, ids[:30], session="s", max_tokens=5, ignore_eos=True)
        turn2 = ids[:30] + first.token_ids + ids[30:]
        second = await run(e, turn2, session="s", max_tokens=NEW, ignore_eos=True)
        assert second.admitted.num_cached == 34
        alone = engine(bf16)
        try:
            cold = await run(alone, turn2, max_tokens=NEW, ignore_eos=True, use_cache=False)
        finally:
            alone.stop()
        assert second.token_ids == cold.token_ids
    finally:
        e.stop()
    # the seed's near-tie may not show on this CPU: a prompt's chunk is decode kernel rows, token by token
    assert any(max(rows) > 1 for rows, *_ in steps)
    assert all((spans, decode, prefill) == (0, sum(rows), 0) for rows, spans, decode, prefill in steps)


def test_an_8_bit_pool_is_read_by_the_decode_kernel(bf16):
    # the tiled walk reads bf16 keys only: an 8-bit pool's rows go to the kernel that dequantizes them, token by token
    e = engine(bf16, kv_dtype="int8")
    try:
        assert e.runner.deterministic
        assert (e.runner.backend.name, e.runner.backend.every_token) == ("kernel", True)
        assert e.runner.deterministic_detail.startswith("on: attention by the kernel backend")
    finally:
        e.stop()


def test_compiling_is_left_off_in_the_mode(bf16, monkeypatch, tmp_path):
    # inductor's generated kernels vectorize by shape; compiling for real takes a minute: a stand-in records it
    asked: list[str] = []

    def stand_in(loaded, cache_dir, startup):
        asked.append(cache_dir)
        return None, "the stand-in's"

    monkeypatch.setattr(model_runner, "_compiled", stand_in)
    for on in (True, False):
        e = make_engine(bf16, budget_bytes=BUDGET, compile_dir=str(tmp_path), deterministic=on)
        try:
            assert e.runner.deterministic is on
            assert e.runner.compiled is None
            assert e.runner.compile_detail == (  # as GET /v1/models/{id} says it
                "asked, but runs eager: deterministic mode (inductor's kernels are not batch-invariant)"
                if on
                else "the stand-in's"
            )
        finally:
            e.stop()
    assert asked == [str(tmp_path)]  # the engine out of the mode only


@pytest.mark.parametrize(
    ("case", "detail"),
    [
        ("no paged kernel", "unavailable: needs the paged kernel on cpu in torch.bfloat16"),
        ("layers not invariant", "unavailable: its linear layers are not batch-invariant on cpu in torch.bfloat16"),
        ("mode off", "off"),
    ],
)
def test_an_engine_out_of_the_mode_says_why_and_leaves_the_layers_taking_rows_as_they_come(
    bf16, monkeypatch, case, detail
):
    if case == "no paged kernel":
        monkeypatch.setattr(kernels, "paged_decode_available", lambda: False)
    elif case == "layers not invariant":
        monkeypatch.setattr(model_runner, "batch_invariance", lambda model: None)
    pad_rows(bf16.model, -ROW_TILE)  # as an engine in the mode may have left this model object
    e = engine(bf16) if case != "mode off" else make_engine(bf16, budget_bytes=BUDGET, deterministic=False)
    try:
        assert not e.runner.deterministic
        assert e.runner.deterministic_detail == detail
        layers = [m for m in bf16.model.modules() if isinstance(m, PackedLinear)]
        assert layers
        assert all((m.row_multiple, m.per_tile) == (1, False) for m in layers)
    finally:
        e.stop()


@pytest.mark.parametrize("seed", CHUNKS)
async def test_chunks_cut_anywhere_give_the_cold_ids(bf16, seed):
    ids = prompt(bf16, seed)
    expected = await cold(bf16, ids)
    for max_batch_tokens in (7, 16, 37):  # the prompt prefilled in chunks cut at these sizes
        e = engine(bf16, max_batch_tokens=max_batch_tokens)
        try:
            got = await run(e, ids, max_tokens=NEW, ignore_eos=True, use_cache=False)
            assert got.token_ids == expected, f"chunks of {max_batch_tokens}"
        finally:
            e.stop()


@pytest.mark.parametrize("seed", BATCHES)
async def test_batches_of_1_3_and_8_behind_a_cached_system_prompt_give_each_prompt_s_cold_ids(bf16, seed):
    gen = random.Random(seed)
    system = [gen.randrange(3, bf16.vocab_size) for _ in range(300)]  # past the kernel-only context: heads
    prompts = [[*system, *prompt(bf16, 5000 + seed * 10 + i)[:20]] for i in range(8)]
    alone = [await cold(bf16, p) for p in prompts]
    for size in (1, 3, 8):
        e = engine(bf16)
        try:
            await run(e, [*system, 7], rid="system", max_tokens=1)  # the rows share its cached blocks
            head_rows = e.runner.backend.stats.num_head_rows
            turns = [run(e, p, rid=f"b{i}", max_tokens=NEW, ignore_eos=True) for i, p in enumerate(prompts[:size])]
            results = await asyncio.gather(*turns)
            assert all(r.admitted.num_cached >= 288 for r in results)
            assert [r.token_ids for r in results] == alone[:size], f"a batch of {size}"
            if size > 1 and e.runner.backend.name == "tiled":  # the mode keeps cascade heads: rows shared the prompt
                assert e.runner.backend.stats.num_head_rows > head_rows
        finally:
            e.stop()


@pytest.mark.parametrize("seed", PREFIXES)
async def test_a_prefix_another_request_computed_cut_anywhere_gives_the_cold_ids(bf16, seed):
    ids = prompt(bf16, seed)
    expected = await cold(bf16, ids)
    for cut in (1, 5, 16, 23, len(ids) * 2 // 3):  # another request computed the prompt's first `cut` tokens
        e = engine(bf16)
        try:
            await run(e, [*ids[:cut], 5, 6, 7], rid="other", max_tokens=2, ignore_eos=True)
            shared = await run(e, ids, rid="shared", max_tokens=NEW, ignore_eos=True)
            assert shared.admitted.num_cached >= cut // 16 * 16  # its full blocks at least came from the cache
            assert shared.token_ids == expected, f"a prefix of {cut} tokens"
        finally:
            e.stop()


@pytest.mark.parametrize("seed", SESSIONS)
async def test_a_session_s_second_turn_gives_the_cold_ids(bf16, seed):
    ids = prompt(bf16, seed)
    e = engine(bf16)
    try:
        half = len(ids) // 2
        first = await run(e, ids[:half], session="s", max_tokens=5, ignore_eos=True)
        turn2 = ids[:half] + first.token_ids + ids[half:]
        second = await run(e, turn2, session="s", max_tokens=NEW, ignore_eos=True)
        assert second.admitted.num_cached == half + 4  # the whole transcript but its last token
        assert second.token_ids == await cold(bf16, turn2)
    finally:
        e.stop()


@pytest.mark.parametrize("seed", TIERS)
@pytest.mark.parametrize("tier", ["host", "disk", "shared"])
async def test_a_session_restored_from_each_tier_gives_the_cold_ids(bf16, tmp_path, tier, seed):
    block = 16
    token_bytes = KVLayout.of(bf16.model.config, bf16.dtype).bytes_per_token
    with tiers_below(tier, tmp_path, block) as tiers:
        e = engine(bf16, tiers=tiers, budget_bytes=16 * block * token_bytes, block_size=block)
        try:
            ids = prompt(bf16, seed)
            half = len(ids) // 2
            first = await run(e, ids[:half], session="s", max_tokens=5, ignore_eos=True)
            if tiers.shared is not None:
                tiers.shared.flush()
            for i in range(3):  # other sessions fill the pool: this one's K/V goes down a tier (or is dropped)
                other = prompt(bf16, 2000 + seed * 10 + i) * 2
                await run(e, other[:120], session=f"other{i}", max_tokens=2, ignore_eos=True)
            tiers.flush_pending()
            turn2 = ids[:half] + first.token_ids + ids[half:]
            second = await run(e, turn2, session="s", max_tokens=NEW, ignore_eos=True)
            assert second.admitted.source == tier
            assert second.token_ids == await cold(bf16, turn2)
        finally:
            e.stop()


def test_the_setting_turns_the_mode_on_in_16_bits_by_default_and_the_model_object_says_how(wide_heads_bf16):
    import dataclasses

    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.models.loader import ModelSpec
    from server.settings import Settings
    from tests.http.conftest import wait_ready

    bf16 = ModelSpec(id="wide", source=str(wide_heads_bf16[1]), dtype="bfloat16", device="cpu", max_context=4096)
    fp32 = dataclasses.replace(bf16, id="wide32", dtype="float32")
    for setting, expected in (("auto", {"wide": True, "wide32": False}), (True, True), (False, False)):
        settings = Settings(deterministic=setting, kv_budget_bytes=4 << 20, state_dir=None)
        with TestClient(create_app(settings, specs=[bf16, fp32])) as client:
            wait_ready(client)
            for model in ("wide", "wide32"):
                on = expected[model] if isinstance(expected, dict) else expected  # auto: on in 16 bits
                detail = client.get(f"/v1/models/{model}").json()["deterministic"]
                assert detail.startswith("on: attention by the ") if on else detail == "off", (setting, model)
                assert client.app.state.host.engines[model].runner.deterministic is on


def test_the_flag_sets_the_mode_and_the_default_is_off(monkeypatch):
    from server.__main__ import parse

    monkeypatch.delenv("KVSERVE_DETERMINISTIC", raising=False)
    assert parse(["serve"])[1].deterministic is False  # opt-in: it gives up bf16_gemv (docs/benchmarks.md)
    assert parse(["serve", "--deterministic", "auto"])[1].deterministic == "auto"  # on in 16 bits (the test above)
    assert parse(["serve", "--deterministic", "false"])[1].deterministic is False
    assert parse(["serve", "--deterministic", "true"])[1].deterministic is True


@pytest.mark.parametrize("seed", SESSIONS)
async def test_a_seeded_sampled_turn_from_a_session_draws_the_cold_turn_s_tokens(bf16, seed):
    ids = prompt(bf16, seed)
    sampled = {"temperature": 1.5, "seed": 7, "max_tokens": NEW, "ignore_eos": True}
    e = engine(bf16)
    try:
        half = len(ids) // 2
        first = await run(e, ids[:half], session="s", max_tokens=5, ignore_eos=True)
        turn2 = ids[:half] + first.token_ids + ids[half:]
        second = await run(e, turn2, session="s", **sampled)
        assert second.admitted.num_cached == half + 4
        alone = engine(bf16)
        try:
            cold = await run(alone, turn2, use_cache=False, **sampled)
        finally:
            alone.stop()
        assert second.token_ids == cold.token_ids
    finally:
        e.stop()


def test_an_engine_out_of_the_mode_takes_decode_rows_by_bf16_gemv_and_one_in_it_after_it_does_not(bf16):
    gemv = torch.ops.kvserve.bf16_gemv_available()
    layers = [m for m in bf16.model.modules() if isinstance(m, PackedLinear)]
    fast = make_engine(bf16, budget_bytes=BUDGET, deterministic=False)
    try:
        assert fast.runner.decode_products == (len(layers) if gemv else 0)  # the tiny model's sizes all fit
        assert all((m.gemv is not None) is bool(gemv) for m in layers)
        held = fast.resident()
        assert held.gemv_weights == (held.packed_weights if gemv else 0)  # the linear weights a second time
        copies = [weakref.ref(m.gemv) for m in layers if m.gemv is not None]
    finally:
        fast.stop()
    exact = engine(bf16)  # on the same model object: the probe must measure oneDNN's products, not the kernel's
    try:
        assert exact.runner.deterministic, exact.runner.deterministic_detail
        assert exact.runner.decode_products == 0
        assert all(m.gemv is None for m in layers)
        gc.collect()
        assert [ref() for ref in copies if ref() is not None] == []  # freed, not only unused
        assert exact.resident().gemv_weights == 0
        assert exact.resident().packed_weights == held.packed_weights  # oneDNN's: what the mode computes with
    finally:
        exact.stop()

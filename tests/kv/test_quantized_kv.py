"""K/V stored in 8 bits (int8, fp8 e4m3) with a scale per token and kv head: the pool, the kernel, every tier.

The compute-dtype path keeps its own exactness tests (HF generate); here the quantized paths are held to
their own rules: the rounding stays within the format's step, each row carries its own scale, a block
stored in another K/V dtype is never read as this one, and a session's turn served from the pool or
restored from a tier equals the same prompt computed afresh in the same K/V dtype.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from server.kv import kernels
from server.kv.block_store import BlockStore, WriteJob, addresses
from server.kv.pool import KVLayout, KVPool, convert, dequantize, quantize, stored_dtype
from server.kv.snapshot import Snapshot, decode_block, encode_block
from server.kv.tiers import TierFormats, TierStore
from server.sessions.record import SessionKey
from tests.helpers import make_engine, run, tiers_below

FORMATS = [torch.int8, torch.float8_e4m3fn]
LARGEST = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def rows_of(kv_heads: int, tokens: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Vectors whose magnitudes differ by head and by token (so a scale shared by any two would show)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(kv_heads, tokens, dim, generator=gen, dtype=torch.float64)
    spread = torch.logspace(-3, 2, kv_heads * tokens, dtype=torch.float64).view(kv_heads, tokens, 1)
    return x * spread


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_each_row_keeps_its_own_scale_and_rounds_within_a_step(kv_dtype):
    x = rows_of(3, 40, 64)
    q = quantize(x, kv_dtype)
    assert q.dtype == kv_dtype
    assert q.shape == (3, 40, 64 + 4)
    scale = q.view(torch.uint8)[..., 64:].contiguous().view(torch.float32).squeeze(-1)
    expected = (x.abs().amax(-1) / LARGEST[kv_dtype]).float()
    assert torch.allclose(scale, expected, rtol=1e-6, atol=0)  # per token and per head
    assert scale.unique().numel() == 3 * 40
    err = (dequantize(q, torch.float64) - x).abs()
    scaled = (x / scale.double().unsqueeze(-1)).abs()
    if kv_dtype == torch.int8:
        bound = 0.5 * scale.double().unsqueeze(-1) * (1 + 1e-5)  # half a step of its own row's scale
    else:  # e4m3: 3 mantissa bits (half a step is 2^-4 relative); subnormals below 2^-6 step by 2^-9
        bound = scale.double().unsqueeze(-1) * torch.maximum(scaled * 2.0**-4, torch.full_like(scaled, 2.0**-10))
        bound = bound * (1 + 1e-5)
    assert bool((err <= bound).all()), float((err - bound).max())
    # A row of zeros stays zeros (scale 0, no division by it).
    zeros = dequantize(quantize(torch.zeros(1, 2, 8), kv_dtype), torch.float32)
    assert torch.equal(zeros, torch.zeros(1, 2, 8))


def test_the_setting_names_the_formats_and_the_layout_counts_their_bytes():
    cpu = torch.device("cpu")
    assert stored_dtype("auto", torch.bfloat16, cpu) is None
    assert stored_dtype("compute", torch.bfloat16, cpu) is None
    assert stored_dtype("int8", torch.bfloat16, cpu) == torch.int8
    assert stored_dtype("fp8", torch.bfloat16, cpu) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_dtype 'int4'"):
        stored_dtype("int4", torch.bfloat16, cpu)
    bf16 = KVLayout(30, 3, 64, torch.bfloat16)
    int8 = KVLayout(30, 3, 64, torch.bfloat16, torch.int8)
    assert bf16.bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert int8.bytes_per_token == 2 * 30 * 3 * (64 + 4)  # a float32 scale per row
    assert bf16.fingerprint("m") != int8.fingerprint("m")  # part of every block address
    assert int8.fingerprint("m") != KVLayout(30, 3, 64, torch.bfloat16, torch.float8_e4m3fn).fingerprint("m")


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_a_block_is_read_only_in_the_k_v_dtype_it_was_stored_in(kv_dtype, caplog):
    layout = KVLayout(2, 2, 8, torch.float32, kv_dtype)
    k = [quantize(rows_of(2, 4, 8, seed), kv_dtype) for seed in (1, 2)]
    v = [quantize(rows_of(2, 4, 8, seed), kv_dtype) for seed in (3, 4)]
    value = encode_block("a" * 40, k, v)
    kv = decode_block("a" * 40, value, layout)
    assert kv is not None
    assert kv.dtype == kv_dtype
    assert torch.equal(kv.view(torch.uint8), torch.stack([torch.stack(k), torch.stack(v)]).view(torch.uint8))
    other = torch.float8_e4m3fn if kv_dtype == torch.int8 else torch.int8  # the same shape, another format
    assert decode_block("a" * 40, value, KVLayout(2, 2, 8, torch.float32, other)) is None
    assert decode_block("a" * 40, value, KVLayout(2, 2, 8, torch.float32)) is None
    assert "K/V stored as" in caplog.text


def test_disk_and_redis_hold_the_quantized_rows_as_they_are(backend):
    layout = KVLayout(2, 2, 8, torch.float32, torch.int8)
    store = BlockStore(backend, "test")
    ids = list(range(8))
    names = addresses(layout.fingerprint(), 4, "t", ids)
    k = [quantize(rows_of(2, 8, 8, seed), torch.int8) for seed in (1, 2)]
    v = [quantize(rows_of(2, 8, 8, seed), torch.int8) for seed in (3, 4)]
    store.put(WriteJob(names, k, v, 4))
    store.flush()
    assert len(backend.read(names)[0]) < 2 * 2 * 2 * 4 * 8 * 4  # fewer bytes than the fp32 K/V alone
    blocks = store.read_run(names, layout)
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        for layer in (0, 1):
            assert torch.equal(block[0][layer], k[layer][:, i * 4 : (i + 1) * 4])
            assert torch.equal(block[1][layer], v[layer][:, i * 4 : (i + 1) * 4])
    store.close()


@pytest.mark.skipif(not kernels.paged_decode_available(), reason="the kernel cannot be built here")
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_the_kernel_reads_a_quantized_pool_as_its_dequantized_values(kv_dtype):
    """In fp32 the kernel over the quantized rows equals the kernel over the same values dequantized first, and
    the span path (pool.read, then SDPA) over them."""
    layout = KVLayout(1, 2, 64, torch.float32, kv_dtype)
    pool = KVPool(layout, num_blocks=12, block_size=16, device=torch.device("cpu"))
    slots = torch.arange(12 * 16)
    pool.write(0, slots, rows_of(2, 12 * 16, 64).float(), rows_of(2, 12 * 16, 64, seed=5).float())
    k_plain, v_plain = pool.read(0, 0, 12 * 16, None)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(9))
    rows = torch.tensor([0, 1], dtype=torch.int32)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)
    lens = torch.tensor([50, 37], dtype=torch.int32)
    none = (torch.empty(0, dtype=torch.int32), torch.empty(0), torch.empty(0))
    quantized, plain = torch.empty_like(q), torch.empty_like(q)
    torch.ops.kvserve.paged_decode(q, pool.k[0], pool.v[0], quantized, rows, tables, lens, *none, 16, 0, 0.125, 0.0)
    args = (q, k_plain.contiguous(), v_plain.contiguous(), plain, rows, tables, lens, *none, 16, 0, 0.125, 0.0)
    torch.ops.kvserve.paged_decode(*args)
    assert torch.equal(quantized, plain)
    for b in range(2):
        ctx = int(lens[b])
        ctx_slots = torch.tensor(pool.slot_ids(tables[b].tolist(), 0, ctx))
        k, v = pool.read(0, 0, 0, ctx_slots)
        scores = torch.einsum("hd,hkd->hk", q[b], k.repeat_interleave(3, 0)) * 0.125
        dense = torch.einsum("hk,hkd->hd", scores.softmax(-1), v.repeat_interleave(3, 0))
        assert torch.allclose(quantized[b], dense, atol=1e-5, rtol=1e-5)


def words(tiny, text: str) -> list[int]:
    return tiny.tokenizer(text)["input_ids"]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("tier", ["pool", "host", "disk", "shared"])
async def test_a_session_served_from_the_pool_or_a_tier_continues_as_computed_afresh(tiny, tmp_path, kv_dtype, tier):
    block, token_bytes = 4, 2 * 2 * 2 * (16 + 4)  # K+V x layers x kv_heads x (head_dim + the scale's 4 bytes)
    num_blocks = 24 if tier != "pool" else 256
    with tiers_below(tier, tmp_path, block) as tiers:
        engine = make_engine(
            tiny, tiers=tiers, budget_bytes=num_blocks * block * token_bytes, block_size=block, kv_dtype=kv_dtype
        )
        fresh = make_engine(tiny, budget_bytes=256 * block * token_bytes, block_size=block, kv_dtype=kv_dtype)
        try:
            assert engine.runner.pool.k[0].dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_dtype]
            assert engine.runner.pool.num_blocks == num_blocks
            prompt = words(tiny, "The quick brown fox jumps over the lazy dog. Sessions keep their cache.")
            first = await run(engine, prompt, session="a", max_tokens=6, ignore_eos=True)
            transcript = prompt + first.token_ids
            whole = (len(transcript) - 1) // block * block  # Redis keeps full blocks only
            if tiers.shared is not None:
                tiers.shared.flush()  # the turn's full blocks, in Redis
            if tier != "pool":  # other sessions fill the pool: a's K/V goes down a tier first (or is dropped)
                await fill_the_pool(engine, tiny)
                tiers.flush_pending()
                usage = tiers.usage(SessionKey("default", "a"))
                if tier == "shared":  # the quantized blocks, under the int8 / fp8 pool's own addresses
                    names = addresses(engine.fingerprint, block, "default", transcript[:whole])
                    assert all(tiers.shared.backend.held(names))
                else:
                    assert (usage.host_tokens if tier == "host" else usage.disk_tokens) == len(transcript) - 1
            turn2 = transcript + words(tiny, " Hello world")
            second = await run(engine, turn2, session="a", max_tokens=5, ignore_eos=True)
            assert second.admitted.source == ("device" if tier == "pool" else tier)
            assert second.admitted.num_cached == (whole if tier == "shared" else len(transcript) - 1)
            cold = await run(fresh, turn2, max_tokens=5, ignore_eos=True, use_cache=False)
            assert cold.admitted.num_cached == 0
            assert second.token_ids == cold.token_ids
        finally:
            engine.stop()
            fresh.stop()


async def fill_the_pool(engine, tiny) -> None:
    """Other sessions' turns take the pool: an idle session's K/V goes down a tier (or is dropped)."""
    for i, text in enumerate(["Paris is the capital of France;", "Numbers 0123456789 and symbols !?."] * 2):
        await run(engine, words(tiny, text * 2), session=f"other{i}", max_tokens=4, ignore_eos=True)


def test_models_toml_names_a_k_v_dtype_or_is_refused(tmp_path):
    from server.models.loader import read_specs

    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nid = "m"\nsource = "x"\nkv_dtype = "int8"\n')
    assert read_specs(path)[0].kv_dtype == "int8"
    path.write_text('[[models]]\nid = "m"\nsource = "x"\nkv_dtype = "int4"\n')
    with pytest.raises(ValueError, match="kv_dtype 'int4'"):
        read_specs(path)


def test_the_server_setting_applies_where_the_model_names_none(tiny_spec):
    import dataclasses

    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings
    from tests.http.conftest import wait_ready

    own = dataclasses.replace(tiny_spec, id="own", kv_dtype="fp8")
    plain = dataclasses.replace(tiny_spec, id="plain", kv_dtype="compute")
    settings = Settings(kv_dtype="int8", kv_budget_bytes=4 << 20, disk_kv_dtype="int8")
    with TestClient(create_app(settings, specs=[tiny_spec, own, plain])) as client:
        wait_ready(client)
        engines = client.app.state.host.engines
        assert engines["tiny"].runner.pool.k[0].dtype == torch.int8
        assert engines["own"].runner.pool.k[0].dtype == torch.float8_e4m3fn
        model = client.get("/v1/models/tiny").json()
        assert model["kv_dtype"] == "int8"
        assert model["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 4)  # K+V x layers x kv_heads x a row with its scale
        assert client.get("/v1/models/own").json()["kv_dtype"] == "float8_e4m3fn"
        assert model["tier_kv_dtypes"] == {"host": "int8", "disk": "int8", "shared": "int8"}  # 8 bits already
        plain_model = client.get("/v1/models/plain").json()
        computed = plain_model["dtype"]
        assert plain_model["kv_dtype"] == computed
        assert plain_model["tier_kv_dtypes"] == {"host": computed, "disk": "int8", "shared": computed}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        for sid in ("s", "s"):  # a session's second turn reads its quantized K/V from the pool
            reply = client.post("/v1/chat/completions", json=body, headers={"X-Session-ID": sid})
            assert reply.status_code == 200, reply.text
            body["messages"] += [reply.json()["choices"][0]["message"], {"role": "user", "content": "More"}]
        assert reply.headers["X-Cache"] in ("hit", "partial")


@pytest.mark.skipif(not kernels.paged_prefill_available(torch.bfloat16, 64), reason="no AVX512-BF16 prefill kernel")
async def test_prefill_chunks_over_a_quantized_pool_read_their_blocks_through_the_kernel(wide_heads_bf16, monkeypatch):
    """Two prompts prefilled side by side in 8-token chunks on an int8 pool: the kernel reads a dequantized copy of
    the blocks each chunk's table names (renumbered), and answers as SDPA over the same dequantized keys does, up
    to bf16 rounding; a chunk that read another's blocks would be off by units."""
    wide_bf16, _ = wide_heads_bf16
    prompts = [
        words(wide_bf16, "The quick brown fox jumps over the lazy dog. " * 6),
        words(wide_bf16, "Paris is the capital of France; Berlin is the capital of Germany. " * 3),
    ]
    results, seen = {}, {}
    for use_kernel in (True, False):
        engine = make_engine(wide_bf16, budget_bytes=4 << 20, block_size=4, max_batch_tokens=8, kv_dtype="int8")
        assert engine.runner.backend.chunks_by_kernel  # on a quantized pool too
        engine.runner.backend.chunks_by_kernel = use_kernel
        calls = seen.setdefault(use_kernel, [])
        prepare = engine.runner._prepare

        def spy(rows, prepare=prepare, calls=calls):
            meta, *rest = prepare(rows)
            if meta.prefill is not None:
                assert meta.prefill.slots is not None
                calls.append(meta.prefill.q_starts.numel())
            return (meta, *rest)

        monkeypatch.setattr(engine.runner, "_prepare", spy)
        try:
            results[use_kernel] = await asyncio.gather(
                *(run(engine, p, rid=f"r{i}", max_tokens=1, num_logprobs=5) for i, p in enumerate(prompts))
            )
        finally:
            engine.stop()
    assert max(seen[True]) == 2  # both prompts' chunks in one call
    assert seen[False] == []  # spans
    for with_kernel, with_sdpa in zip(results[True], results[False], strict=True):
        assert with_kernel.token_ids == with_sdpa.token_ids
        sdpa = dict(with_sdpa.logprobs[0].top)
        assert max(abs(lp - sdpa[t]) for t, lp in with_kernel.logprobs[0].top if t in sdpa) < 0.3


def test_a_tier_quantizes_only_what_comes_to_it_in_more_bits():
    bf16 = KVLayout(30, 3, 64, torch.bfloat16)
    int8 = bf16.stored_as("int8")
    assert (int8.kv_dtype, int8.computed) == (torch.int8, bf16)
    assert bf16.stored_as("pool") is bf16
    assert int8.stored_as("fp8") is int8  # 8 bits already: nothing smaller to be had
    # Host RAM's copies come from the pool, the disk's from host RAM, Redis's from the pool.
    layouts = TierFormats(host="int8", disk="fp8").layouts(bf16)
    assert [layouts[t].kv_dtype for t in ("host", "disk", "shared")] == [torch.int8, torch.int8, None]
    assert TierFormats(disk="fp8").layouts(int8) == {"host": int8, "disk": int8, "shared": int8}
    rows = rows_of(3, 5, 64).to(torch.bfloat16)
    assert convert(rows, bf16, bf16) is rows
    quantized = convert(rows, bf16, int8)
    assert torch.equal(quantized.view(torch.uint8), quantize(rows, torch.int8).view(torch.uint8))
    assert torch.equal(convert(quantized, int8, bf16), dequantize(quantized, torch.bfloat16))


def test_the_disk_keeps_a_compute_dtype_snapshot_in_8_bits_and_another_setting_finds_none_of_it(tmp_path):
    layout, key, ids = KVLayout(2, 2, 64, torch.float32), SessionKey("t", "a"), list(range(10))
    k = [rows_of(2, 10, 64, seed).float() for seed in (1, 2)]
    v = [rows_of(2, 10, 64, seed).float() for seed in (3, 4)]
    held = {}
    for setting in ("pool", "int8"):
        tiers = TierStore(0, 1 << 30, tmp_path / setting, 4, TierFormats(disk=setting))
        tiers.put(Snapshot(key, "m", layout, "", ids, k, v))  # no host RAM: straight on to the disk
        tiers.flush_pending()
        held[setting] = tiers.usage(key).disk_bytes
        got = tiers.read(key, [*ids, 99], "m", "", layout)
        assert got is not None
        assert got.token_ids == ids
        assert got.layout == layout.stored_as(setting)
        for stored, original in zip(got.k + got.v, k + v, strict=True):
            expected = original if setting == "pool" else quantize(original, torch.int8)
            assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
        tiers.close()
    assert held["int8"] < held["pool"] / 2  # 68 bytes a row (64 values and a float32 scale), not 256
    restarted = TierStore(0, 1 << 30, tmp_path / "int8", 4)  # the disk tier set back to the pool's format
    assert restarted.scan({key}) == 1
    assert restarted.read(key, [*ids, 99], "m", "", layout) is None  # int8 blocks are not this format's: recomputed
    restarted.close()


def pool_kv(engine, token_ids: list[int]) -> torch.Tensor:
    """The K/V the engine's pool holds for these tokens, in its format: [2, layers, kv_heads, tokens, row]."""
    blocks, num_tokens = engine.blocks.chain("default", token_ids)
    assert num_tokens >= len(token_ids)
    pool = engine.runner.pool
    k, v = pool.gather(pool.slots([b.block_id for b in blocks], len(token_ids)))
    return torch.stack([torch.stack(k), torch.stack(v)])


@pytest.mark.parametrize("tier", ["host", "disk", "shared"])
async def test_a_tier_set_to_int8_keeps_a_compute_dtype_pool_s_session_in_8_bits_and_restores_it(tiny, tmp_path, tier):
    block, token_bytes = 4, KVLayout(2, 2, 16, tiny.dtype).bytes_per_token  # computed in float64: exact tests
    with tiers_below(tier, tmp_path, block, TierFormats(**{tier: "int8"})) as tiers:
        engine = make_engine(tiny, tiers=tiers, budget_bytes=24 * block * token_bytes, block_size=block)
        fresh = make_engine(tiny, budget_bytes=256 * block * token_bytes, block_size=block)
        try:
            assert not engine.runner.layout.is_quantized
            prompt = words(tiny, "The quick brown fox jumps over the lazy dog. Sessions keep their cache.")
            first = await run(engine, prompt, session="a", max_tokens=6, ignore_eos=True)
            transcript = prompt + first.token_ids
            if tiers.shared is not None:
                tiers.shared.flush()
            await fill_the_pool(engine, tiny)
            tiers.flush_pending()
            turn2 = transcript + words(tiny, " Hello world")
            kept = engine.offloader.fetch(SessionKey("default", "a"), turn2)  # what the tier holds, as it holds it
            assert kept is not None
            assert kept.layout.kv_dtype == torch.int8
            assert kept.k[0].dtype == torch.int8
            second = await run(engine, turn2, session="a", max_tokens=5, ignore_eos=True)
            assert second.admitted.source == tier
            num_restored = second.admitted.num_cached
            assert num_restored >= (len(transcript) - 1) // block * block  # Redis keeps full blocks only
            computed = await run(fresh, turn2, session="ref", max_tokens=5, ignore_eos=True)
            assert computed.admitted.num_cached == 0
            restored, exact = pool_kv(engine, turn2[:num_restored]), pool_kv(fresh, turn2[:num_restored])
            # Restored into the pool's dtype: each row is its int8 rounding (within half a step of its own scale)
            step = exact.abs().amax(-1, keepdim=True) / 127
            assert ((restored - exact).abs() <= step / 2 + 1e-6).all()
            assert not torch.equal(restored, exact)
        finally:
            engine.stop()
            fresh.stop()


def test_a_read_from_a_disk_in_8_bits_going_on_from_redis_in_the_pool_s_format_converts_both_to_the_pool_s(
    tmp_path,
):
    from server.kv.redis_blocks import RedisBlocks
    from tests.e2e.redis_server import Redis

    server = Redis(tmp_path)
    layout, key, ids = KVLayout(2, 2, 8, torch.float32), SessionKey("t", "a"), list(range(16))
    k = [rows_of(2, 16, 8, seed).float() for seed in (1, 2)]
    v = [rows_of(2, 16, 8, seed).float() for seed in (3, 4)]
    tiers = TierStore(0, 1 << 30, tmp_path / "kv", 4, TierFormats(disk="int8"))
    tiers.shared = BlockStore(RedisBlocks(server.url), "shared")
    try:
        tiers.put(Snapshot(key, "m", layout, "", ids[:8], [t[:, :8] for t in k], [t[:, :8] for t in v]))
        tiers.flush_pending()
        tiers.shared.put(WriteJob(addresses(layout.fingerprint(), 4, "t", ids), k, v, 4))  # all 4, as computed
        tiers.shared.flush()
        got = tiers.read(key, [*ids, 99], "m", "", layout)
        assert got is not None
        assert (got.token_ids, got.origin, got.layout) == (ids, "shared", layout)
        for stored, original in zip(got.k + got.v, k + v, strict=True):
            rounded = dequantize(quantize(original[:, :8], torch.int8), torch.float32)
            assert torch.equal(stored[:, :8], rounded)  # the disk's two blocks, from int8
            assert torch.equal(stored[:, 8:], original[:, 8:])  # then Redis's, as they were
    finally:
        tiers.shared.close()
        tiers.close()
        server.stop()


def test_a_read_from_a_disk_in_the_pool_s_format_going_on_from_redis_in_8_bits_is_in_the_pool_s_format(tmp_path):
    """The other way round: the blocks Redis keeps in int8 are converted to the pool's format too, and the snapshot
    says so (restored as int8 rows, float32 values would be read as bytes)."""
    from server.kv.redis_blocks import RedisBlocks
    from tests.e2e.redis_server import Redis

    server = Redis(tmp_path)
    layout, key, ids = KVLayout(2, 2, 8, torch.float32), SessionKey("t", "a"), list(range(16))
    k = [rows_of(2, 16, 8, seed).float() for seed in (1, 2)]
    v = [rows_of(2, 16, 8, seed).float() for seed in (3, 4)]
    tiers = TierStore(0, 1 << 30, tmp_path / "kv", 4, TierFormats(shared="int8"))
    tiers.shared = BlockStore(RedisBlocks(server.url), "shared")
    try:
        tiers.put(Snapshot(key, "m", layout, "", ids[:8], [t[:, :8] for t in k], [t[:, :8] for t in v]))
        tiers.flush_pending()
        int8 = layout.stored_as("int8")
        quantized = [quantize(t, torch.int8) for t in k], [quantize(t, torch.int8) for t in v]
        tiers.shared.put(WriteJob(addresses(int8.fingerprint(), 4, "t", ids), *quantized, 4))  # as `share` stores them
        tiers.shared.flush()
        got = tiers.read(key, [*ids, 99], "m", "", layout)
        assert got is not None
        assert (got.token_ids, got.origin, got.layout) == (ids, "shared", layout)
        for stored, original in zip(got.k + got.v, k + v, strict=True):
            assert stored.dtype == torch.float32
            assert torch.equal(stored[:, :8], original[:, :8])  # the disk's two blocks, as they were
            rounded = dequantize(quantize(original[:, 8:], torch.int8), torch.float32)
            assert torch.equal(stored[:, 8:], rounded)  # then Redis's, from int8
    finally:
        tiers.shared.close()
        tiers.close()
        server.stop()


def test_a_snapshot_the_disk_already_keeps_in_8_bits_is_not_written_again(tmp_path):
    """The disk's manifest names the fingerprint of the form it stores (int8), not the snapshot's own (float32): the
    same snapshot coming down again is still recognised as held, and not encoded and written a second time."""
    layout, key, ids = KVLayout(2, 2, 8, torch.float32), SessionKey("t", "a"), list(range(10))
    k = [rows_of(2, 10, 8, seed).float() for seed in (1, 2)]
    v = [rows_of(2, 10, 8, seed).float() for seed in (3, 4)]
    snapshot = Snapshot(key, "m", layout, "", ids, k, v)
    tiers = TierStore(0, 1 << 30, tmp_path, 4, TierFormats(disk="int8"))
    try:
        tiers.put(snapshot)  # no host RAM: straight on to the disk
        tiers.flush_pending()
        assert tiers.disk is not None
        assert tiers.disk.holds(snapshot)
        assert not tiers.disk.holds(Snapshot(key, "m", layout, "other weights", ids, k, v))
        tiers.put(snapshot)
        tiers.flush_pending()
        assert tiers.totals().num_demoted["disk"] == 1
        assert tiers.disk.store.stats.num_queued == 3  # two full blocks and the tail, once
    finally:
        tiers.close()

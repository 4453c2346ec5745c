"""A full admission queue answers 429 with Retry-After; waiting requests run once blocks free up; /health
never waits for the engine."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server.settings import Settings
from tests.helpers import DEADLINE_S, paused, settled, wait_until_async
from tests.http.conftest import serve_live

LONG = {"model": "tiny", "prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
SHORTER = {**LONG, "max_tokens": 600}


async def test_full_queue_answers_429_with_retry_after(tiny_spec):
    # fp64 tiny model: 1 KiB per token; 200 blocks of 4 tokens: room for one 600-token request at a time
    settings = Settings(kv_budget_bytes=800 * 1024, block_size=4, max_queue=1)
    with serve_live([tiny_spec], settings) as (base, engine):
        async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as client:
            async with client.stream("POST", "/v1/completions", json=SHORTER) as first:
                lines = first.aiter_lines()
                await lines.__anext__()  # running, holding ~150 blocks
                waiting = asyncio.create_task(client.post("/v1/completions", json={**SHORTER, "stream": False}))
                await wait_until_async(lambda: engine.stats.num_waiting == 1, what="the second request to wait")
                third = await client.post("/v1/completions", json={**SHORTER, "stream": False})
                assert third.status_code == 429
                assert third.headers["Retry-After"] == "1"
                assert third.json()["error"]["type"] == "rate_limit_error"
                assert third.json()["error"]["code"] == "server_overloaded"
                assert (await client.get("/health")).status_code == 200
            second = await waiting  # the first stream closed: its blocks came back, the waiting one ran
            assert second.status_code == 200
            assert second.json()["usage"]["completion_tokens"] == 600
        assert (await settled(engine)).num_blocks_used == 0


async def test_a_client_that_disconnects_returns_every_block_it_held(tiny_spec):
    with serve_live([tiny_spec], Settings(kv_budget_bytes=4000 * 1024, block_size=4)) as (base, engine):
        async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as client:
            for _ in range(3):  # mid-prefill is too quick to catch here; mid-decode, every time
                async with client.stream("POST", "/v1/completions", json=LONG) as r:
                    lines = r.aiter_lines()
                    await lines.__anext__()
                    held = await engine.query(lambda: (engine.blocks.num_used, engine.blocks.num_reserved))
                    assert held[0] > 0
                    assert held[1] > 0
            await wait_until_async(lambda: engine.num_active == 0, what="the abandoned streams to end")
        # Accounting, not just "still answers": nothing in use, nothing promised, decode stopped early.
        assert await engine.query(lambda: (engine.blocks.num_used, engine.blocks.num_reserved)) == (0, 0)
        assert engine.counter.num_decode_tokens < 3 * 3000


async def test_health_answers_under_full_load_while_the_engine_is_held(tiny_spec):
    settings = Settings(kv_budget_bytes=800 * 1024, block_size=4, max_queue=2)  # one 600-token request at a time
    with serve_live([tiny_spec], settings) as (base, engine):
        async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as client:
            body = {**SHORTER, "stream": False}
            flood = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(8)]
            await wait_until_async(lambda: engine.num_active > 0, what="the flood to start")
            async with paused(engine):  # the engine thread is held between two steps of the flood
                for _ in range(20):  # so /health can only answer if it never waits for the engine
                    try:
                        assert (await client.get("/health", timeout=DEADLINE_S / 4)).status_code == 200
                    except httpx.TimeoutException:
                        pytest.fail("/health got no answer while the engine thread was held: it waits for the engine")
            statuses = sorted(r.status_code for r in await asyncio.gather(*flood))
            assert 429 in statuses
            assert 200 in statuses

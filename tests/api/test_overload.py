"""A full admission queue answers 429 with Retry-After; waiting requests run once blocks free up."""

from __future__ import annotations

import asyncio

import httpx

from server.settings import Settings
from tests.api.conftest import serve_live

LONG = {"model": "tiny", "prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}


async def test_full_queue_answers_429_with_retry_after(tiny_spec):
    # fp64 tiny model: 1 KiB per token; 1,000 blocks of 4 tokens: room for one 3,000-token request at a time
    settings = Settings(kv_budget_bytes=4000 * 1024, block_size=4, max_queue=1)
    with serve_live([tiny_spec], settings) as (base, engine):
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=LONG) as first:
                lines = first.aiter_lines()
                await lines.__anext__()  # running, holding ~750 blocks
                waiting = asyncio.create_task(client.post("/v1/completions", json={**LONG, "stream": False}))
                while len(engine._waiting) < 1:
                    await asyncio.sleep(0.01)
                third = await client.post("/v1/completions", json={**LONG, "stream": False})
                assert third.status_code == 429
                assert third.headers["Retry-After"] == "1"
                assert third.json()["error"]["type"] == "rate_limit_error"
                assert third.json()["error"]["code"] == "server_overloaded"
                assert (await client.get("/health")).status_code == 200
            second = await waiting  # the first stream closed: its blocks came back, the waiting one ran
            assert second.status_code == 200 and second.json()["usage"]["completion_tokens"] == 3000
        assert engine.blocks.num_used == 0

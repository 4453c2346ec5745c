"""Against a real server: disconnects stop generation (seen on the token counter); busy sessions; buckets."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import re
import time

import httpx

from server.settings import Settings
from tests.helpers import DEADLINE_S, wait_until, wait_until_async
from tests.http.conftest import serve_live

LONG = {"model": "tiny", "prompt": "Hello", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


def settled_counter(engine) -> int:
    """The decode counter once no request is left running (the disconnected one was ended)."""
    wait_until(lambda: engine.num_active == 0, what="generation to stop after the client went away")
    return engine.counter.num_decode_tokens


def test_streaming_disconnect_stops_generation(live):
    base, engine = live
    start = engine.counter.num_decode_tokens
    with (
        httpx.Client() as client,
        client.stream("POST", base + "/v1/completions", json={**LONG, "stream": True, "session_id": "sd"}) as r,
    ):
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
    stopped = settled_counter(engine)
    assert stopped - start < 4000 - 1  # it did not run to max_tokens
    # Only complete turns count: made by this first request, the session went with it (and its lock)
    assert httpx.get(base + "/v1/sessions/sd").status_code == 404
    again = httpx.post(base + "/v1/completions", json={**LONG, "max_tokens": 2, "session_id": "sd"}, timeout=120)
    assert again.status_code == 200, again.text


def test_a_stream_left_unread_is_stopped_by_its_disconnect_alone(tiny_spec):
    """Without a limit on unread events (which ends a stream nobody reads), only the disconnect ends this one."""
    with serve_live([tiny_spec], Settings(max_unread_events=100_000)) as (base, engine):
        start = engine.counter.num_decode_tokens
        body = {**LONG, "stream": True, "session_id": "unread"}
        with httpx.Client() as client, client.stream("POST", base + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(5):
                next(lines)
        stopped = settled_counter(engine)
        assert stopped - start < 4000 - 1  # it did not run to max_tokens
        assert httpx.get(base + "/v1/sessions/unread").status_code == 404  # nor made a turn


async def test_non_streaming_disconnect_stops_generation(live):
    base, engine = live
    start = engine.counter.num_decode_tokens
    async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as client:
        sent = asyncio.create_task(client.post("/v1/completions", json={**LONG, "session_id": "nd"}))
        await wait_until_async(lambda: engine.counter.num_decode_tokens > start, what="decoding to start")
        sent.cancel()  # the client goes away mid-generation (its connection is closed)
        with contextlib.suppress(asyncio.CancelledError):
            await sent
    stopped = await asyncio.to_thread(settled_counter, engine)
    assert 0 < stopped - start < 4000 - 1
    assert httpx.get(base + "/v1/sessions/nd").status_code == 404  # its first request made no turn: none kept


def test_busy_session_is_409_saying_since_when_and_when_to_retry(live, caplog):
    base, _ = live
    body = {**LONG, "stream": True, "session_id": "busy"}
    caplog.set_level(logging.INFO, logger="kvserve.access")
    asked = int(time.time())
    with httpx.Client() as client, client.stream("POST", base + "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # keep the iterator: dropping it closes the response
        next(lines)
        second = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "session_id": "busy"})
        assert second.status_code == 409
        error = second.json()["error"]
        assert {k: error[k] for k in ("type", "param", "code")} == {
            "type": "conflict_error",
            "param": None,
            "code": "session_busy",
        }
        since = re.fullmatch(
            r"session 'busy' already has a request in flight, since (\S+) \((\d+) s ago\)", error["message"]
        )
        assert since is not None, error["message"]
        started = datetime.datetime.fromisoformat(since.group(1))
        assert asked <= started.timestamp() <= time.time()  # when the stream above took the session
        assert started.utcoffset() == datetime.timedelta(0)
        assert second.headers["retry-after"] == "1"
        assert second.headers["x-session-id"] == "busy"
    refused = httpx.post(base + "/v1/completions", json={**LONG, "max_tokens": 10**6, "session_id": "other"})
    assert refused.status_code == 400  # refused before it reached the session: the log names it all the same
    for line in (" 409 .* session=busy$", " 400 .* session=other$"):
        wait_until(lambda line=line: any(re.search(line, m) for m in caplog.messages), what=f"a log line {line!r}")


def test_busy_bucket_never_locks(live):
    base, _ = live
    body = {**LONG, "stream": True, "prompt_cache_key": "b2"}
    with httpx.Client() as client, client.stream("POST", base + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        quick = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "prompt_cache_key": "b2"}
        second = httpx.post(base + "/v1/completions", json=quick)
        assert second.status_code == 200  # the bucket is taken: this request still runs, no 409

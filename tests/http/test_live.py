"""Against a real server: disconnects stop generation (seen on the token counter); busy sessions; buckets."""

from __future__ import annotations

import time

import httpx
import pytest

LONG = {"model": "tiny", "prompt": "Hello", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


def settled_counter(engine, quiet_s: float = 0.3, timeout_s: float = 10) -> int:
    """Wait until the decode counter stops moving; return its value."""
    deadline = time.monotonic() + timeout_s
    last = engine.counter.num_decode_tokens
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = engine.counter.num_decode_tokens
        if now == last and engine.num_active == 0:
            return now
        last = now
    raise AssertionError("generation did not stop after the client went away")


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
    info = httpx.get(base + "/v1/sessions/sd").json()
    assert info["turns"] == 0
    assert info["in_use"] is False  # only complete turns count; the lock is released


def test_non_streaming_disconnect_stops_generation(live):
    base, engine = live
    start = engine.counter.num_decode_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", json={**LONG, "session_id": "nd"}, timeout=0.5)
    stopped = settled_counter(engine)
    assert 0 < stopped - start < 4000 - 1
    assert httpx.get(base + "/v1/sessions/nd").json()["in_use"] is False


def test_busy_session_is_409(live):
    base, _ = live
    body = {**LONG, "stream": True, "session_id": "busy"}
    with httpx.Client() as client, client.stream("POST", base + "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # keep the iterator: dropping it closes the response
        next(lines)
        second = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "session_id": "busy"})
        assert second.status_code == 409
        assert second.json()["error"] == {
            "message": "session 'busy' already has a request in flight",
            "type": "conflict_error",
            "param": None,
            "code": "session_busy",
        }


def test_busy_bucket_never_locks(live):
    base, _ = live
    body = {**LONG, "stream": True, "prompt_cache_key": "b2"}
    with httpx.Client() as client, client.stream("POST", base + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        quick = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "prompt_cache_key": "b2"}
        second = httpx.post(base + "/v1/completions", json=quick)
        assert second.status_code == 200  # the bucket is taken: this request still runs, no 409

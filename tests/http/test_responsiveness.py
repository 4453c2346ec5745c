"""The event loop never does a tenant's heavy work (issue 15, point 2), proven by behaviour, not by a clock.

Tokenising, template rendering and listing run on worker threads: each test holds that work mid-way and
asks /health meanwhile, which can only answer if the loop is free. Listing and creating cost what the page
needs, not what the tenant holds: counted in Python calls among 1,000 and among 10,000 sessions. A prompt
beyond the context is refused by its byte size, never tokenised. (The latency /health keeps on this
machine while such work runs is measured by bench/crowded.py.)
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from server.serving import continuation, prompts
from server.sessions.record import SessionKey
from server.sessions.store import SessionStore
from server.settings import Settings
from tests.helpers import DEADLINE_S
from tests.http.conftest import serve_live

NUM_SESSIONS = 10_000


@pytest.fixture(scope="module")
def crowded(tiny_spec) -> Iterator[tuple[str, Any]]:
    """A server whose default tenant already holds 10,000 sessions."""
    with serve_live([tiny_spec], Settings(max_sessions_per_tenant=2 * NUM_SESSIONS)) as (base, engine):
        for i in range(NUM_SESSIONS):
            engine.store.create(SessionKey("default", f"s{i:05d}"), "tiny")
        yield base, engine


class Held:
    """Wraps a function so that its calls wait, inside it, until released."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        assert self.release.wait(DEADLINE_S), "the held call was never released"
        return self.fn(*args, **kwargs)


async def health_while_held(base: str, held: Held, work) -> Any:
    """Start `work` (a coroutine), wait until it is inside `held`, check /health answers, release; its result."""
    async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as client:
        task = asyncio.create_task(work)
        try:
            entered = await asyncio.to_thread(held.entered.wait, DEADLINE_S)
            assert entered, f"the work never reached {held.fn.__name__}"
            try:
                health = await client.get("/health")
            except httpx.TimeoutException:
                pytest.fail(f"/health got no answer while {held.fn.__name__} was held: it holds the event loop")
            assert health.status_code == 200
        finally:
            held.release.set()
        return await task


async def test_a_huge_prompt_is_refused_by_its_size_never_tokenised(crowded, monkeypatch):
    base, _ = crowded
    calls = []
    monkeypatch.setattr(continuation, "prompt_ids", lambda *args: calls.append(args))
    content = "word " * (7 * 2**20 // 5)  # 7 MiB of text, far beyond the 4,096-token context
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "bytes of text" in r.json()["error"]["message"]
    assert calls == []


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
async def test_tokenising_leaves_the_event_loop(crowded, monkeypatch, endpoint):
    base, _ = crowded
    if endpoint == "chat":
        held = Held(continuation.prompt_ids)
        monkeypatch.setattr(continuation, "prompt_ids", held)
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}
    else:
        held = Held(prompts.completion_ids)
        monkeypatch.setattr("server.serving.pipeline.completion_ids", held)
        path, body = "/v1/completions", {"prompt": "Hi"}

    async def send() -> httpx.Response:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            return await client.post(path, json={"model": "tiny", "max_tokens": 2, **body})

    r = await health_while_held(base, held, send())
    assert r.status_code == 200, r.text


async def test_listing_leaves_the_event_loop(crowded, monkeypatch):
    base, engine = crowded
    held = Held(engine.store.page)
    monkeypatch.setattr(engine.store, "page", held)

    async def list_page() -> httpx.Response:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            return await client.get("/v1/sessions", params={"limit": 1000, "after": "s04000"})

    r = await health_while_held(base, held, list_page())
    body = r.json()
    assert len(body["data"]) == 1000
    assert body["data"][0]["id"] == "s04001"  # oldest first, right after the anchor
    assert body["has_more"] is True


def count_calls(fn: Callable[[], Any]) -> int:
    """Python and C function calls made by fn() on this thread: a measure of work that no load changes."""
    calls = 0

    def profile(frame, event, arg) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_listing_and_creating_cost_the_page_not_the_tenant():
    def work_among(n: int) -> tuple[int, int]:
        store = SessionStore(ttl_s=3600)
        for i in range(n):
            store.create(SessionKey("t", f"s{i:05d}"), "m")
        anchor = f"s{n // 2:05d}"
        page = count_calls(lambda: store.page("t", "session", 100, anchor))
        create = count_calls(lambda: store.create(SessionKey("t", "new"), "m"))
        assert [info.key.name for info in store.page("t", "session", 2, anchor)[0]] == [
            f"s{n // 2 + 1:05d}",
            f"s{n // 2 + 2:05d}",
        ]
        return page, create

    small_page, small_create = work_among(1_000)
    page, create = work_among(2 * NUM_SESSIONS)
    # A walk over every session would cost about 20x more; a sorted index costs a few more bisection steps.
    assert page < 1.5 * small_page, (page, small_page)
    assert create < 1.5 * small_create, (create, small_create)


async def test_a_session_is_described_and_listed_while_a_forward_pass_holds_the_engine(tiny_spec, monkeypatch):
    with serve_live([tiny_spec], Settings()) as (base, engine):
        async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as client:
            chat = {"model": "tiny", "max_tokens": 4, "temperature": 0}
            first = {**chat, "messages": [{"role": "user", "content": "Hello there"}], "session_id": "idle"}
            assert (await client.post("/v1/chat/completions", json=first)).status_code == 200
            before = (await client.get("/v1/sessions/idle")).json()
            assert before["cache"]["device"]["tokens"] > 0
            held = Held(engine.runner.run)  # the next forward pass waits inside, as a long prefill chunk would
            monkeypatch.setattr(engine.runner, "run", held)
            other = {**chat, "messages": [{"role": "user", "content": "Another"}], "session_id": "busy"}
            busy = asyncio.create_task(client.post("/v1/chat/completions", json=other))
            try:
                assert await asyncio.to_thread(held.entered.wait, DEADLINE_S), "no forward pass started"
                try:
                    described = await client.get("/v1/sessions/idle", timeout=DEADLINE_S / 4)
                    listed = await client.get("/v1/sessions", timeout=DEADLINE_S / 4)
                except httpx.TimeoutException:
                    pytest.fail("a session's description waited for the forward pass in progress")
            finally:
                held.release.set()
            assert (await busy).status_code == 200
        assert described.status_code == 200
        assert described.json()["cache"] == before["cache"]  # the books as they were: the idle session's K/V
        assert {s["id"]: s["cache"]["device"]["tokens"] for s in listed.json()["data"]}["idle"] == (
            before["cache"]["device"]["tokens"]
        )


def big_schema(num_bytes: int) -> dict:
    """A function's parameters of about `num_bytes` bytes of JSON (descriptions are capped; schemas are not)."""
    properties = {f"p{i}": {"type": "string", "description": "w " * 450} for i in range(num_bytes // 1000)}
    return {"type": "object", "properties": properties}


def big_tool(num_bytes: int) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": big_schema(num_bytes)}}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [big_tool(200_000)]}),
        ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "tools": [big_tool(200_000)]}),
        (
            "/v1/responses",
            {"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": big_schema(200_000)}]},
        ),
        (
            "/v1/messages",
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2,
                "tools": [{"name": "f", "input_schema": big_schema(200_000)}],
            },
        ),
    ],
)
async def test_tool_definitions_count_toward_the_size_rule_before_any_rendering(crowded, monkeypatch, path, body):
    base, _ = crowded
    renders = []
    monkeypatch.setattr(continuation.control_text, "mark", lambda tokenizer, value: renders.append(1) or value)
    async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as client:
        r = await client.post(path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error.get("code") or error.get("type")) in ("context_length_exceeded", "invalid_request_error")
    assert "context" in error["message"]
    assert renders == []  # refused by its size: no template was rendered


async def test_tokenizing_messages_with_tools_leaves_the_event_loop(crowded, monkeypatch):
    base, _ = crowded
    held = Held(continuation.render)
    monkeypatch.setattr(continuation, "render", held)
    tools = [big_tool(20_000)]  # fits the context: it is rendered, on a worker thread

    async def send() -> httpx.Response:
        async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as client:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": tools}
            return await client.post("/tokenize", json=body)

    r = await health_while_held(base, held, send())
    assert r.status_code == 200, r.text

"""What a request may not do to a session: a prefill-only request (Messages' max_tokens 0) makes no turn, a prompt
past the context is refused whatever max_tokens says, and a session is made only once every check passed (a refused
request leaves none behind), never past the tenant's quota, requests at once included."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.sessions.record import SessionKey
from server.settings import Settings
from tests.helpers import DEADLINE_S, paused, wait_until_async
from tests.http.conftest import serve_live, wait_ready

MESSAGES = "/v1/messages"
LONG = "Hello world " * 1500  # about 6,000 tokens: past the tiny model's 4,096, short of the size pre-check


@pytest.fixture(scope="module")
def guarded(tiny_spec):
    # A pool of 800 tokens (1 KiB a token): a 1,000-token prompt fits the context, not the pool (refused at submit).
    settings = Settings(max_sessions_per_tenant=3, kv_budget_bytes=800 * 1024, block_size=4)
    with TestClient(create_app(settings, specs=[tiny_spec])) as c:
        wait_ready(c)
        yield c


@pytest.fixture(autouse=True)
def no_sessions_left(guarded):
    yield
    for key in guarded.app.state.host.store.session_keys():
        guarded.app.state.host.store.delete(key)


def store(client):
    return client.app.state.host.store


def send(client, sid: str | None, messages, max_tokens: int, **extra) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": max_tokens, "messages": messages, "temperature": 0, **extra}
    if sid is not None:
        body["session_id"] = sid
    return client.post(MESSAGES, json=body)


def reply_of(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return {"role": "assistant", "content": r.json()["content"][0]["text"]}


def snapshot(client, sid: str) -> tuple:
    view = store(client).view(SessionKey("default", sid))
    return view.transcript_ids, view.turns, view.messages


def test_a_prefill_only_request_on_a_session_loses_no_turn(guarded):
    messages = [{"role": "user", "content": "Hello world"}]
    messages.append(reply_of(send(guarded, "warm", messages, 3)))
    messages += [{"role": "user", "content": "Paris is"}]
    messages.append(reply_of(send(guarded, "warm", messages, 3)))
    before = snapshot(guarded, "warm")
    messages += [{"role": "user", "content": "The quick brown fox"}]
    warm = send(guarded, "warm", messages, 0)
    assert warm.status_code == 200, warm.text
    assert warm.json()["content"] == []
    assert warm.headers["X-Session-ID"] == "warm"
    assert snapshot(guarded, "warm") == before  # no turn: transcript, turns and messages as they were
    assert guarded.get("/v1/sessions/warm").json()["turns"] == 2
    for turn in (1, 2):
        forked = guarded.post("/v1/sessions/warm/fork", json={"turn": turn})
        assert forked.status_code == 201, forked.text
        assert forked.json()["turns"] == turn
        guarded.delete(f"/v1/sessions/{forked.json()['id']}")
    assert guarded.post("/v1/sessions/warm/rewind", json={"turn": 2}).status_code == 200
    # The warmed prompt's K/V is kept: the turn after it computes only its last token, and continues the session.
    hot = send(guarded, "warm", messages, 2)
    usage = hot.json()["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    assert usage["cache_read_input_tokens"] == prompt - 1
    transcript = store(guarded).view(SessionKey("default", "warm")).transcript_ids
    assert transcript[: len(before[0])] == before[0]
    assert guarded.get("/v1/sessions/warm").json()["turns"] == 3


def test_a_prefill_only_request_on_a_new_session_sets_no_base(guarded, tiny):
    system, first = "Be brief.", [{"role": "user", "content": "Hello"}]
    assert send(guarded, "fresh", first, 0, system=system).status_code == 200
    view = store(guarded).view(SessionKey("default", "fresh"))  # made on first use, and left empty
    assert (view.transcript_ids, view.num_turns, view.turns[0].end, view.messages) == ([], 0, 0, [])
    # Its prompt (with the assistant's opening) is not the start of the next turn's: that one is rendered whole.
    messages = [*first, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Paris is"}]
    r = send(guarded, "fresh", messages, 2, system=system)
    assert r.status_code == 200, r.text
    rendered = tiny.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, *messages], add_generation_prompt=True, tokenize=False
    )
    expected = tiny.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert store(guarded).view(SessionKey("default", "fresh")).transcript_ids[: len(expected)] == expected


def test_post_sessions_system_prompt_is_still_turn_zero(guarded):
    made = guarded.post("/v1/sessions", json={"system": "You are terse."})
    assert made.status_code == 201, made.text
    body = made.json()
    assert body["turns"] == 0
    assert body["system_tokens"] == body["transcript_tokens"] > 0
    assert body["cache"]["device"]["tokens"] == body["system_tokens"]  # prefilled, not only recorded


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_a_prompt_past_the_context_is_refused_whatever_max_tokens(client, max_tokens):
    # `client` (conftest): a pool that holds the long prompt, so the context rule alone refuses it.
    messages = [{"role": "user", "content": "Hello world"}]
    messages.append(reply_of(send(client, "full", messages, 2)))
    before = snapshot(client, "full")
    long = [*messages, {"role": "user", "content": LONG}]
    for sid in ("full", None):
        r = send(client, sid, long, max_tokens)
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert r.json()["error"]["code"] == "context_length_exceeded"
    assert snapshot(client, "full") == before


def test_a_refused_request_leaves_no_session_behind(guarded):
    mark = {"cache_control": {"type": "ephemeral", "ttl": "1h"}}
    short = [{"role": "user", "content": "Hello"}]
    refusals = {
        "context": ([{"role": "user", "content": LONG}], 0, 400),
        "max_tokens": (short, 10**6, 400),
        "schema": (short, 4, 400),  # a format the grammar cannot hold
        "pool": ([{"role": "user", "content": "Hello world " * 250}], 1, 400),  # refused by the engine at submit
    }
    unique = {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}
    for sid, (messages, max_tokens, status) in refusals.items():
        extra = {"output_config": {"format": unique}} if sid == "schema" else {}
        r = send(guarded, sid, messages, max_tokens, **mark, **extra)
        assert r.status_code == status, (sid, r.text)
        assert store(guarded).info(SessionKey("default", sid)) is None, sid
    assert store(guarded).counts().get("session", 0) == 0
    made = send(guarded, "kept", short, 1, **mark)
    assert made.status_code == 200, made.text
    info = guarded.get("/v1/sessions/kept").json()
    assert info["expires_at"] - info["last_used_at"] == pytest.approx(3600, abs=2)  # the breakpoint's ttl


def test_a_new_session_made_by_a_breakpoint_takes_its_ttl(guarded):
    # The store's own TTL is an hour (so a 1h breakpoint would look the same): 5m shows the breakpoint made it
    mark = {"cache_control": {"type": "ephemeral", "ttl": "5m"}}
    made = send(guarded, "five", [{"role": "user", "content": "Hello"}], 1, **mark)
    assert made.status_code == 200, made.text
    info = guarded.get("/v1/sessions/five").json()
    assert info["expires_at"] - info["last_used_at"] == pytest.approx(300, abs=2)


def test_a_response_the_engine_refuses_leaves_no_stored_response(guarded):
    # The record of a stored response is made before the engine sees the turn; refused at submit (a prompt the
    # pool cannot hold), it is taken away again: nothing to fetch, nothing to continue from.
    body = {"model": "tiny", "input": "Hello world " * 250, "max_output_tokens": 1, "store": True}
    r = guarded.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert store(guarded).counts().get("response", 0) == 0
    kept = guarded.post("/v1/responses", json={**body, "input": "Hello"})
    assert kept.status_code == 200, kept.text
    assert store(guarded).counts().get("response", 0) == 1


def test_a_stored_response_past_the_tenants_kv_quota_is_429_and_not_kept(tiny_spec):
    # Its record holds its K/V like a session's: checked before it is made. Not stored, nothing is held: it runs.
    with TestClient(create_app(Settings(max_tenant_kv_bytes=1), specs=[tiny_spec])) as c:
        wait_ready(c)
        body = {"model": "tiny", "input": "Hello", "max_output_tokens": 2, "temperature": 0}
        r = c.post("/v1/responses", json={**body, "store": True})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "quota_exceeded"
        assert store(c).counts().get("response", 0) == 0
        assert c.post("/v1/responses", json={**body, "store": False}).status_code == 200


def test_the_session_quota_counts_sessions_made_by_messages(guarded):
    mark = {"cache_control": {"type": "ephemeral"}}
    short = [{"role": "user", "content": "Hello"}]
    for i in range(3):
        assert send(guarded, f"q{i}", short, 0 if i % 2 else 1, **mark).status_code == 200
    for max_tokens in (1, 0):
        r = send(guarded, "q3", short, max_tokens, **mark)
        assert r.status_code == 429, r.text
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert r.json()["error"]["code"] == "quota_exceeded"
    assert store(guarded).info(SessionKey("default", "q3")) is None
    assert store(guarded).counts()["session"] == 3
    assert send(guarded, "q0", short, 1).status_code == 200  # a session the tenant holds goes on


def test_requests_at_once_never_take_a_tenant_past_its_session_quota(tiny_spec):
    with serve_live([tiny_spec], Settings(max_sessions_per_tenant=3)) as (base, engine):
        start = threading.Barrier(12)
        statuses: list[int] = []

        def first_use(i: int) -> None:
            body = {
                "model": "tiny",
                "max_tokens": 2,
                "session_id": f"at-once-{i}",
                "messages": [{"role": "user", "content": "Hello"}],
            }
            start.wait()
            if i % 3 == 0:  # chat makes its session on first use, Messages with a breakpoint right before it runs
                r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            else:
                r = httpx.post(base + MESSAGES, json={**body, "cache_control": {"type": "ephemeral"}}, timeout=120)
            statuses.append(r.status_code)

        threads = [threading.Thread(target=first_use, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(statuses) == [200] * 3 + [429] * 9
        assert engine.store.counts()["session"] == 3


async def test_a_new_session_whose_first_request_is_cancelled_before_admission_is_not_kept(tiny_spec):
    with serve_live([tiny_spec], Settings()) as (base, engine):
        async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as client:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            async with paused(engine):  # queued behind the held engine thread, never admitted
                sent = asyncio.create_task(client.post("/v1/chat/completions", json={**body, "session_id": "gone"}))
                await wait_until_async(lambda: engine.store.info(SessionKey("default", "gone")) is not None)
                sent.cancel()  # the client goes away before its request is admitted
                with contextlib.suppress(asyncio.CancelledError):
                    await sent
            await wait_until_async(lambda: engine.num_active == 0, what="the cancelled request to leave")
            assert (await client.get("/v1/sessions/gone")).status_code == 404  # its first request made no turn
            kept = await client.post("/v1/chat/completions", json={**body, "session_id": "kept"})
            assert kept.status_code == 200
            assert (await client.get("/v1/sessions/kept")).json()["turns"] == 1

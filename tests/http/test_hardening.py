"""Auth and tenant isolation, limits and quotas, metrics and logs."""

from __future__ import annotations

import json
import logging
import resource

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.http.auth import load_keys
from server.http.connections import default_max_connections
from server.sessions.record import SessionKey
from server.settings import Settings
from tests.http.conftest import wait_ready

ALICE, BOB = "sk-alice-0001", "sk-bob-000002"
CHAT = "/v1/chat/completions"


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def guarded(tiny_spec):
    settings = Settings(
        api_keys=f"{ALICE}:alice,{BOB}:bob", default_max_tokens=4, max_request_bytes=4000, max_tokens_limit=64
    )
    with TestClient(create_app(settings, specs=[tiny_spec])) as c:
        wait_ready(c)
        yield c


def chat(client, key, sid, content="Hello world", **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}
    if sid:
        body["session_id"] = sid
    return client.post(CHAT, json=body, headers=auth(key))


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/v1/models"),
        ("get", "/metrics"),
        ("get", "/v1/sessions"),
        ("post", CHAT),
        ("post", "/v1/responses"),
        ("get", "/v1/sessions/x"),
    ],
)
def test_every_route_but_health_ready_and_the_docs_needs_a_key(guarded, method, path):
    not_bearer = ({"Authorization": f"Basic {ALICE}"}, {"Authorization": f"Token {ALICE}"}, {"Authorization": ALICE})
    for headers in ({}, auth("sk-wrong-key-00"), *not_bearer):  # none, unknown, a valid key in another scheme
        r = getattr(guarded, method)(path, headers=headers)
        assert r.status_code == 401, (path, headers)
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    assert guarded.get("/health").status_code == 200
    assert guarded.get("/ready").status_code == 200
    assert getattr(guarded, method)(path, headers={"x-api-key": ALICE}).status_code != 401  # Anthropic's header


def test_the_api_docs_need_no_key(guarded):
    """A browser opening /docs sends no key; the document describes the API, no tenant's data."""
    page = guarded.get("/docs")
    assert page.status_code == 200
    assert guarded.get("/openapi.json").status_code == 200
    assert guarded.get("/docs/static/swagger-ui-bundle.js").status_code == 200


def test_a_bad_body_without_a_key_is_401_not_400(guarded):
    r = guarded.post(CHAT, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 401


def test_keys_are_compared_whole_and_name_their_tenant(tmp_path):
    keys = load_keys("sk-abcdefgh:one, sk-ijklmnop", None)
    assert keys.tenant_for("sk-abcdefgh") == "one"
    assert keys.tenant_for("sk-abcdefg") is None
    assert keys.tenant_for("sk-ijklmnop").startswith("key-")  # a digest's name: the key itself is never logged
    assert "ijklmnop" not in keys.tenant_for("sk-ijklmnop")
    for bad, why in (("short:x", "8-512"), ("sk-abcdefgh:a,sk-abcdefgh:b", "twice"), ("sk-abc def gh:x", "8-512")):
        with pytest.raises(ValueError, match=why):
            load_keys(bad, None)
    (empty := tmp_path / "keys").write_text("# nothing here yet\n")
    # configured but empty: refuse to start rather than serve without auth
    with pytest.raises(ValueError, match="none was found"):
        load_keys(None, empty)
    (empty).write_text("sk-from-file-1:filed  # a comment\n")
    assert load_keys(None, empty).tenant_for("sk-from-file-1") == "filed"


def test_an_unnamed_key_can_never_join_a_named_tenant():
    with pytest.raises(ValueError, match="which another key names"):
        load_keys("sk-carol-0001:key-ecccb7690635,sk-dave-00002", None)  # the second key's own name, taken
    with pytest.raises(ValueError, match="tenant names"):
        load_keys("sk-carol-0001:no spaces please", None)
    keys = load_keys("sk-carol-0001:carol,sk-dave-00002", None)
    assert keys.tenant_for("sk-carol-0001") == "carol"
    assert keys.tenant_for("sk-dave-00002") == "key-ecccb7690635"
    # its name does not depend on the keys around it: removing or reordering keys never moves its sessions
    assert load_keys("sk-dave-00002", None).tenant_for("sk-dave-00002") == "key-ecccb7690635"
    assert load_keys("sk-erin-00003, sk-dave-00002", None).tenant_for("sk-dave-00002") == "key-ecccb7690635"


def test_tenants_cannot_see_or_reach_each_others_sessions_and_responses(guarded):
    sid = guarded.post("/v1/sessions", json={"system": "Secret system prompt."}, headers=auth(ALICE)).json()["id"]
    foreign = guarded.get(f"/v1/sessions/{sid}", headers=auth(BOB))
    unknown = guarded.get("/v1/sessions/sess_00000000000000000000000000000000", headers=auth(BOB))
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.json()["error"]["code"] == unknown.json()["error"]["code"] == "session_not_found"
    assert sid not in {s["id"] for s in guarded.get("/v1/sessions", headers=auth(BOB)).json()["data"]}
    assert guarded.delete(f"/v1/sessions/{sid}", headers=auth(BOB)).status_code == 404
    assert guarded.post(f"/v1/sessions/{sid}/fork", json={}, headers=auth(BOB)).status_code == 404
    resp = guarded.post("/v1/responses", json={"model": "tiny", "input": "Hi"}, headers=auth(ALICE)).json()
    assert guarded.get(f"/v1/responses/{resp['id']}", headers=auth(BOB)).status_code == 404
    cont = {"model": "tiny", "input": "Hi", "previous_response_id": resp["id"]}
    assert guarded.post("/v1/responses", json=cont, headers=auth(BOB)).status_code == 404


def test_client_chosen_ids_and_the_prefix_cache_are_per_tenant(guarded):
    prompt = "Paris is the capital of France; Berlin is the capital of Germany. " * 3
    first = chat(guarded, ALICE, "same-name", prompt)
    again = chat(guarded, ALICE, None, prompt)  # alice reuses her own prefix
    bob = chat(guarded, BOB, "same-name", prompt)  # same id, same prompt: nothing of alice's
    assert first.status_code == again.status_code == bob.status_code == 200
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert bob.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert bob.headers["X-Cache"] == "miss"
    assert guarded.get("/v1/sessions/same-name", headers=auth(BOB)).json()["turns"] == 1


def test_another_tenants_identical_transcript_is_never_counted_as_shared(guarded):
    for key, sid in ((ALICE, "twin-a"), (BOB, "twin-b")):
        assert chat(guarded, key, sid, "Identical conversations, two tenants").status_code == 200
    alice = guarded.get("/v1/sessions/twin-a", headers=auth(ALICE)).json()["cache"]["device"]
    bob = guarded.get("/v1/sessions/twin-b", headers=auth(BOB)).json()["cache"]["device"]
    assert alice["tokens"] == bob["tokens"] > 0
    assert alice["shared_bytes"] == bob["shared_bytes"] == 0  # same tokens, but never the same blocks
    assert alice["exclusive_bytes"] == bob["exclusive_bytes"] > 0


def test_body_size_and_max_tokens_limits(guarded):
    big = "x" * 5000
    r = chat(guarded, ALICE, None, big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    chunks = (part for part in [b'{"model": "tiny", "messages": [{"role": "user", "content": "', b"y" * 5000, b'"}]}'])
    r = guarded.post(CHAT, content=chunks, headers=auth(ALICE) | {"content-type": "application/json"})
    assert r.status_code == 413  # no Content-Length: counted while read
    r = chat(guarded, ALICE, None, max_tokens=65)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    schema = guarded.get("/openapi.json").json()["components"]["schemas"]
    assert {"type": "integer", "minimum": 1, "maximum": 64} in schema["ChatCompletionRequest"]["properties"][
        "max_tokens"
    ]["anyOf"]


def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_is_refused(guarded):
    request = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    limit = 4000  # the fixture's max_request_bytes

    def padded(size: int) -> bytes:  # the same request, with JSON whitespace up to `size` bytes
        body = (request[:-1] + " " * (size - len(request)) + "}").encode()
        assert len(body) == size
        return body

    headers = auth(ALICE) | {"content-type": "application/json"}
    exact, over = padded(limit), padded(limit + 1)
    assert guarded.post(CHAT, content=exact, headers=headers).status_code == 200  # Content-Length: the limit
    r = guarded.post(CHAT, content=over, headers=headers)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    for body, status in ((exact, 200), (over, 413)):  # no Content-Length: counted while read, in two pieces
        r = guarded.post(CHAT, content=iter([body[:1500], body[1500:]]), headers=headers)
        assert r.status_code == status, r.text


def test_quotas_answer_429_quota_exceeded(tiny_spec):
    settings = Settings(max_sessions_per_tenant=2, max_tenant_kv_bytes=200 * 1024, default_max_tokens=4)
    with TestClient(create_app(settings, specs=[tiny_spec])) as c:
        wait_ready(c)
        assert c.post("/v1/sessions", json={}).status_code == 201
        assert c.post("/v1/sessions", json={}).status_code == 201
        r = c.post("/v1/sessions", json={})
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "quota_exceeded"
        assert "Retry-After" not in r.headers
        assert chat(c, "", "third").json()["error"]["code"] == "quota_exceeded"
        assert chat(c, "", None).status_code == 200  # stateless requests keep nothing: no quota
        sid = c.get("/v1/sessions").json()["data"][0]["id"]
        body = {"model": "tiny", "prompt": [5] * 250, "max_tokens": 2, "session_id": sid}  # 1 KiB/token: > 200 KiB
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 429
        assert "bytes of K/V" in r.json()["error"]["message"]
        r = c.post("/v1/responses", json={"model": "tiny", "input": "Hi"})  # stored responses count too
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "quota_exceeded"
        assert c.post("/v1/responses", json={"model": "tiny", "input": "Hi", "store": False}).status_code == 200
        store = c.app.state.host.store
        for i in range(4):  # cache buckets are hints: past the limit a request runs without one, never a 429
            assert chat(c, "", None, prompt_cache_key=f"bucket-{i}").status_code == 200
        buckets = store.session_keys("bucket")
        assert len(buckets) == 2
        assert all(store.view(k).messages == [] for k in buckets)  # and keep no prompt text


def test_a_sessions_own_transcript_counts_once_toward_the_kv_quota(tiny_spec):
    """A session's next prompt holds its whole transcript: the quota counts those tokens once, as the K/V it
    will hold, never once as the session's and again as the prompt's."""
    settings = Settings(max_tenant_kv_bytes=200 * 1024, default_max_tokens=2)  # 200 tokens of the tiny model
    with TestClient(create_app(settings, specs=[tiny_spec])) as c:
        wait_ready(c)
        assert c.app.state.host.engines["tiny"].token_bytes == 1024
        store = c.app.state.host.store

        def complete(sid: str, prompt: list[int]):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "session_id": sid, "temperature": 0}
            return c.post("/v1/completions", json=body)

        assert complete("grow", [5] * 120).status_code == 200
        transcript = store.transcript(SessionKey("default", "grow"))
        assert 120 < len(transcript) <= 122
        r = complete("grow", [*transcript, *[6] * 10])  # ~134 tokens with its reply: twice the transcript is not
        assert r.status_code == 200, r.text
        used = len(store.transcript(SessionKey("default", "grow")))
        # Another session: exactly up to the limit is allowed, one token more is not (the first one's tokens count).
        assert complete("other", [7] * (200 - used - 2 + 1)).status_code == 429
        assert complete("other", [7] * (200 - used - 2)).status_code == 200


def test_metrics_are_exposed_with_kvserve_names(guarded):
    chat(guarded, ALICE, "metered")
    chat(guarded, ALICE, "metered")
    text = guarded.get("/metrics", headers=auth(ALICE)).text
    for needle in (
        'kvserve:http_requests_total{route="/v1/chat/completions",status="200"}',
        "kvserve:time_to_first_token_seconds_bucket",
        "kvserve:inter_token_latency_seconds_bucket",
        'kvserve:prompt_tokens_cached_total{model="tiny"}',
        'kvserve:prompt_tokens_computed_total{model="tiny"}',
        'kvserve:kv_cache_bytes{tier="device"}',
        'kvserve:kv_cache_bytes{tier="disk"}',
        'kvserve:sessions{kind="session"}',
        'kvserve:num_requests_waiting{model="tiny"}',
        'kvserve:kv_evictions_total{tier="device"}',
    ):
        assert needle in text, needle
    cached = next(line for line in text.splitlines() if line.startswith("kvserve:prompt_tokens_cached_total"))
    assert float(cached.split()[-1]) > 0


def test_logs_carry_ids_never_prompt_text(guarded, caplog):
    with caplog.at_level(logging.DEBUG):
        r = chat(guarded, ALICE, "logged", "SECRET-PROMPT-TEXT-12345")
    assert r.status_code == 200
    text = "\n".join(record.getMessage() for record in caplog.records)
    assert "SECRET-PROMPT-TEXT" not in text
    assert r.headers["x-request-id"] in text
    assert "session=logged" in text
    assert "tenant=alice" in text


def test_the_connection_bound_stays_below_the_descriptor_limit():
    assert default_max_connections(1024) == 1024 - 128
    assert default_max_connections(20_000) == 20_000 - 2_000
    assert default_max_connections(100) == 16  # a tiny limit still serves someone
    assert default_max_connections(resource.RLIM_INFINITY) == 65_536

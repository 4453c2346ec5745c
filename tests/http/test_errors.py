"""Every row of the error table this server can produce so far, in the OpenAI envelope."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from tests.helpers import DEADLINE_S, ask
from tests.http.conftest import wait_ready
from tests.http.test_responses import sse

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hello"}]


def assert_error(r, status: int, code: str, param: str | None = "__any__") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code
    assert len(err["message"]) <= 512
    if param != "__any__":
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"model": "tiny", "messages": MSG, "temperature": -1}, "invalid_parameter", "temperature"),
        ({"model": "tiny", "messages": MSG, "top_p": 0}, "invalid_parameter", "top_p"),
        ({"model": "tiny", "messages": MSG, "max_tokens": 0}, "invalid_parameter", "max_tokens"),
        ({"model": "tiny", "messages": MSG, "max_tokens": "many"}, "invalid_parameter", "max_tokens"),
        ({"model": "tiny", "messages": []}, "invalid_parameter", "messages"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "invalid_parameter", "messages.0.role"),
        ({"model": "tiny"}, "invalid_parameter", "messages"),
        ({"model": "tiny", "messages": MSG, "tools": [{"type": "function"}]}, "invalid_parameter", "tools.0.function"),
        (
            {"model": "tiny", "messages": MSG, "response_format": {"type": "json_schema"}},
            "invalid_parameter",
            "response_format",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "unsupported_parameter",
            "messages.0.content",
        ),
        ({"model": "tiny", "messages": MSG, "n": 2}, "unsupported_parameter", "n"),
        ({"model": "tiny", "messages": MSG, "frobnicate": 1}, "unsupported_parameter", "frobnicate"),
        ({"model": "tiny", "messages": MSG, "session_id": "bad id!"}, "invalid_parameter", "session_id"),
        ({"model": "tiny", "messages": MSG, "stop": ["x"] * 17}, "invalid_parameter", "stop"),
        ({"model": "tiny", "messages": MSG, "logit_bias": {"99999": 1}}, "invalid_parameter", "logit_bias"),
        ({"model": "tiny", "messages": MSG, "top_logprobs": 2}, "invalid_parameter", None),
        ({"model": "tiny", "messages": MSG, "seed": 2**64}, "invalid_parameter", "seed"),
        ({"model": "tiny", "messages": MSG, "logit_bias": {"--5": 1}}, "invalid_parameter", "logit_bias"),
        ({"model": "tiny", "messages": MSG, "logit_bias": {"\u00b2": 1}}, "invalid_parameter", "logit_bias"),
    ],
)
def test_invalid_chat_requests_are_400_never_422(client, body, code, param):
    assert_error(client.post(CHAT, json=body), 400, code, param)


STOP_RULES = [
    (["x"] * 10_000, "at most 16 stop sequences are allowed, not 10000"),
    ([""], "stop sequence 0 is empty (each is 1-256 characters)"),
    ("", "the stop sequence is empty (each is 1-256 characters)"),
    ("x" * (1 << 20), "the stop sequence is 1048576 characters long; at most 256 are allowed"),
    (["ok", "x" * 257], "stop sequence 1 is 257 characters long; at most 256 are allowed"),
    ([None], "stop sequence 0 is not a string (each is a string of 1-256 characters)"),
    (7, "stop sequences must be a string or a list of strings"),
    (["x"] * 17, "at most 16 stop sequences are allowed, not 17"),  # one past the documented limits
    ("x" * 257, "the stop sequence is 257 characters long; at most 256 are allowed"),
]


@pytest.mark.parametrize(
    ("stop", "rule"),
    STOP_RULES,
    ids=["many", "empty-item", "empty", "1MB", "long-item", "null", "int", "17", "257"],
)
@pytest.mark.parametrize("route", [CHAT, "/v1/completions"])
def test_a_malformed_stop_names_the_rule_it_breaks(client, route, stop, rule):
    body = {"model": "tiny", "stop": stop, **({"messages": MSG} if route == CHAT else {"prompt": "Hello"})}
    err = assert_error(client.post(route, json=body), 400, "invalid_parameter", "stop")
    assert err["message"] == f"'stop': {rule}"


def test_a_malformed_stop_sequences_names_the_same_rule(client):
    """The Messages API's field shares the rule and its words (a list only: Anthropic takes no bare string)."""
    body = {"model": "tiny", "max_tokens": 4, "messages": MSG}
    for stop, rule in [
        *STOP_RULES[:2],
        STOP_RULES[4],
        STOP_RULES[5],
        STOP_RULES[7],
        ("x", "stop sequences must be a list of strings"),
    ]:
        r = client.post("/v1/messages", json={**body, "stop_sequences": stop})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == f"'stop_sequences': {rule}"


@pytest.mark.parametrize("route", [CHAT, "/v1/completions", "/v1/messages"])
def test_the_documented_stop_limits_are_accepted(client, route):
    """16 stop sequences of 256 characters each (docs/api.md's limits, inclusive) are served, and so is a bare
    string of 256 (chat and completions)."""
    most = [f"{i:02d}" + "y" * 254 for i in range(16)]
    assert {len(s) for s in most} == {256}
    field = "stop_sequences" if route == "/v1/messages" else "stop"
    shape = {"prompt": "Hello"} if route == "/v1/completions" else {"messages": MSG}
    for stop in [most] if route == "/v1/messages" else [most, most[0]]:
        r = client.post(route, json={"model": "tiny", "max_tokens": 2, field: stop, **shape})
        assert r.status_code == 200, r.text


def test_completion_unsupported_fields(client):
    for field, value in (("echo", True), ("suffix", "x"), ("best_of", 3), ("prompt", ["a", "b"])):
        body = {"model": "tiny", "prompt": "hi", field: value}
        assert_error(client.post("/v1/completions", json=body), 400, "unsupported_parameter", field)


def test_malformed_json(client):
    r = client.post(CHAT, content=b'{"model": "tiny", "messages": [', headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_json")


def test_unknown_model_is_404(client):
    assert_error(client.post(CHAT, json={"model": "nope", "messages": MSG}), 404, "model_not_found", "model")


def test_context_length_exceeded(client, tiny):
    long_prompt = "Hello world " * 3000  # > 4096 tokens
    assert_error(
        client.post("/v1/completions", json={"model": "tiny", "prompt": long_prompt}), 400, "context_length_exceeded"
    )
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5000}
    assert_error(client.post("/v1/completions", json=body), 400, "context_length_exceeded", "max_tokens")


def test_session_header_mismatch_and_bad_header_are_400(client):
    r = client.post(CHAT, json={"model": "tiny", "messages": MSG, "session_id": "a"}, headers={"X-Session-ID": "b"})
    assert_error(r, 400, "invalid_parameter", "session_id")
    r = client.post(CHAT, json={"model": "tiny", "messages": MSG}, headers={"X-Session-ID": "x" * 129})
    assert_error(r, 400, "invalid_parameter", "session_id")


def test_session_model_mismatch(client):
    client.post(CHAT, json={"model": "tiny", "messages": MSG, "max_tokens": 1, "session_id": "mm"})
    r = client.post(CHAT, json={"model": "tiny-twin", "messages": MSG, "max_tokens": 1, "session_id": "mm"})
    assert_error(r, 400, "session_model_mismatch")


def test_unknown_session_routes_are_404(client):
    assert_error(client.get("/v1/sessions/never"), 404, "session_not_found")
    assert_error(client.delete("/v1/sessions/never"), 404, "session_not_found")
    assert_error(client.get("/v1/sessions/bad%20id"), 400, "invalid_parameter")


def test_unknown_route_is_enveloped(client):
    assert_error(client.get("/v1/nothing"), 404, "not_found")


@pytest.fixture(scope="module")
def timing_out(tiny_spec):
    """An app whose requests all run past their time limit (a long reply takes the tiny model about a second)."""
    with TestClient(create_app(Settings(request_timeout_s=0.05), specs=[tiny_spec])) as c:
        wait_ready(c)
        yield c


LONG_REPLY = {"model": "tiny", "temperature": 0}  # with "Paris is", the tiny model runs on for hundreds of tokens


def test_request_timeout_is_504(timing_out):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "session_id": "slow"}
    assert_error(timing_out.post("/v1/completions", json=body), 504, "request_timeout")
    # The session keeps only complete turns: made by this first request, it goes with it
    assert_error(timing_out.get("/v1/sessions/slow"), 404, "session_not_found")


def test_a_stored_response_that_times_out_is_504_and_leaves_no_record(timing_out):
    body = {**LONG_REPLY, "input": "Paris is", "max_output_tokens": 3000, "store": True}
    assert_error(timing_out.post("/v1/responses", json=body), 504, "request_timeout")
    # Its record was made before the engine ran it; a failed response has nothing to continue from: gone
    assert timing_out.app.state.host.store.counts().get("response", 0) == 0


def test_a_streamed_response_that_times_out_ends_in_response_failed(timing_out):
    body = {**LONG_REPLY, "input": "Paris is", "max_output_tokens": 3000, "stream": True}
    with timing_out.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200  # admitted: the stream opened, and the time limit ended it later
        kind, data = sse(r)[-1]
    assert kind == data["type"] == "response.failed"
    assert data["response"]["status"] == "failed"
    assert data["response"]["error"]["code"] == "request_timeout"
    assert timing_out.get(f"/v1/responses/{data['response']['id']}").status_code == 404


def test_a_message_that_times_out_is_504_in_anthropics_envelope(timing_out):
    body = {**LONG_REPLY, "max_tokens": 3000, "messages": [{"role": "user", "content": "Paris is"}]}
    r = timing_out.post("/v1/messages", json=body)
    assert r.status_code == 504, r.text
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "timeout_error"
    assert r.json()["error"]["code"] == "request_timeout"


def test_failed_model_makes_ready_say_why_and_generation_503(tiny_spec, tmp_path):
    broken = dataclasses.replace(tiny_spec, id="broken", source=str(tmp_path / "missing"))
    app = create_app(Settings(), specs=[broken])
    with TestClient(app) as c:
        c.app.state.host.wait_loaded(30)
        err = assert_error(c.get("/ready"), 503, "not_ready")
        assert err["message"].startswith("not ready: model 'broken' (source ")  # the model's reason, as it is
        assert "missing" in err["message"]
        assert c.get("/ready").json()["models"]["broken"]["status"] == "failed"
        # not "not ready yet": it failed to load, and says why
        err = assert_error(c.post(CHAT, json={"model": "broken", "messages": MSG}), 503, "model_failed")
        assert err["message"].startswith("model 'broken' (source ")
        assert "missing" in err["message"]
        assert c.app.state.host.has_failed  # what `kvserve serve` exits on (tests/e2e/test_startup.py)


def test_a_model_whose_engine_fails_to_start_is_failed_with_the_reason_and_the_next_one_loads(tiny_spec, monkeypatch):
    """Not only a ModelLoadError: any exception while one model starts (here its engine's construction) marks it
    failed, and the models after it still load and serve."""
    import server.hosting

    real_engine = server.hosting.Engine

    def engine(loaded, *args):
        if loaded.spec.id == "first":
            raise RuntimeError("no memory for the K/V pool")
        return real_engine(loaded, *args)

    monkeypatch.setattr(server.hosting, "Engine", engine)
    first = dataclasses.replace(tiny_spec, id="first")
    with TestClient(create_app(Settings(), specs=[first, tiny_spec])) as c:
        c.app.state.host.wait_loaded(DEADLINE_S)
        model = c.get("/v1/models/first").json()
        assert model["status"] == "failed"
        assert model["detail"] == (
            f"model 'first' (source {tiny_spec.source}) failed to start: RuntimeError: no memory for the K/V pool"
        )
        assert c.get("/v1/models/tiny").json()["status"] == "ready"
        assert c.get("/v1/models/tiny").json()["detail"] is None
        ready = c.get("/ready")
        assert ready.status_code == 200, ready.text
        assert ready.json()["status"] == "degraded"
        assert ready.json()["models"]["first"] == {"status": "failed", "detail": model["detail"]}
        assert ready.json()["message"] == f"serving 1 of 2 models; {model['detail']}"
        err = assert_error(c.post(CHAT, json={"model": "first", "messages": MSG}), 503, "model_failed")
        assert err["message"] == model["detail"]
        assert c.post(CHAT, json={"model": "tiny", "messages": MSG, "max_tokens": 2}).status_code == 200
        assert not c.app.state.host.has_failed


def test_ready_is_503_while_a_model_loads(tiny_spec, monkeypatch):
    import threading

    import server.hosting

    release = threading.Event()
    real_load = server.hosting.load_model

    def slow_load(spec, cache_dir, startup):
        release.wait(30)
        return real_load(spec, cache_dir, startup)

    monkeypatch.setattr(server.hosting, "load_model", slow_load)
    with TestClient(create_app(Settings(), specs=[tiny_spec])) as c:
        err = assert_error(c.get("/ready"), 503, "not_ready")
        assert "tiny is loading" in err["message"]
        assert_error(c.post(CHAT, json={"model": "tiny", "messages": MSG}), 503, "not_ready")
        assert c.get("/health").status_code == 200
        release.set()
        wait_ready(c)


def test_an_engine_whose_books_never_come_to_rest_is_503_not_a_hang(client, engine, monkeypatch):
    chat = {"model": "tiny", "messages": MSG, "max_tokens": 2, "session_id": "asked"}
    assert client.post(CHAT, json=chat).status_code == 200
    entered, gate = threading.Event(), threading.Event()

    def hold() -> None:  # the engine thread, held in the middle of its bookkeeping
        entered.set()
        assert gate.wait(DEADLINE_S), "the held engine thread was never released"

    holder = threading.Thread(target=ask, args=(engine, hold))
    holder.start()
    try:
        assert entered.wait(DEADLINE_S), "the engine thread never ran the hold"
        monkeypatch.setattr(engine, "query_timeout_s", 0.0)  # no wait at all for the books to rest
        r = client.get("/v1/sessions/asked")
        assert_error(r, 503, "not_ready")
    finally:
        gate.set()
        holder.join(DEADLINE_S)
    monkeypatch.setattr(engine, "query_timeout_s", DEADLINE_S)
    assert client.get("/v1/sessions/asked").status_code == 200  # at rest again: answered

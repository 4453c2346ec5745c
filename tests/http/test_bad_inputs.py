"""A table of bad inputs: each must answer its documented status in the OpenAI error envelope."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from server.settings import Settings
from tests.helpers import wait_until
from tests.http.conftest import serve_live

ALICE, BOB = "sk-alice-0001", "sk-bob-000002"
MSG = [{"role": "user", "content": "Hello"}]
CHAT, COMPLETIONS, RESPONSES, SESSIONS = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/sessions"


TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": MSG, **fields}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


# (name, method, path, body: dict | bytes | None, status, code)
CASES = [
    ("malformed JSON", "post", CHAT, b'{"model": "tiny", "messages": [', 400, "invalid_json"),
    ("not an object", "post", CHAT, b"[1, 2, 3]", 400, "invalid_parameter"),
    (
        "invalid UTF-8",
        "post",
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        400,
        "invalid_json",
    ),
    ("empty body", "post", CHAT, b"", 400, "invalid_json"),
    ("model missing", "post", CHAT, {"messages": MSG}, 400, "invalid_parameter"),
    ("model of wrong type", "post", CHAT, chat(model=7), 400, "invalid_parameter"),
    ("unknown model", "post", CHAT, chat(model="gpt-9"), 404, "model_not_found"),
    ("messages of wrong type", "post", CHAT, chat(messages="hi"), 400, "invalid_parameter"),
    ("empty messages", "post", CHAT, chat(messages=[]), 400, "invalid_parameter"),
    ("unknown role", "post", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "invalid_parameter"),
    ("too many messages", "post", CHAT, chat(messages=MSG * 4097), 400, "invalid_parameter"),
    ("negative max_tokens", "post", CHAT, chat(max_tokens=-1), 400, "invalid_parameter"),
    ("zero max_tokens", "post", CHAT, chat(max_tokens=0), 400, "invalid_parameter"),
    ("huge max_tokens", "post", CHAT, chat(max_tokens=10**12), 400, "invalid_parameter"),
    ("max_tokens as text", "post", CHAT, chat(max_tokens="many"), 400, "invalid_parameter"),
    ("temperature < 0", "post", CHAT, chat(temperature=-0.5), 400, "invalid_parameter"),
    (
        "temperature NaN",
        "post",
        CHAT,
        b'{"model": "tiny", "messages": [], "temperature": NaN}',
        400,
        "invalid_parameter",
    ),
    ("top_p = 0", "post", CHAT, chat(top_p=0), 400, "invalid_parameter"),
    ("top_p > 1", "post", CHAT, chat(top_p=1.5), 400, "invalid_parameter"),
    ("huge n", "post", CHAT, chat(n=1000000), 400, "unsupported_parameter"),
    ("a tool of no known type", "post", CHAT, chat(tools=[{"type": "web_search"}]), 400, "unsupported_parameter"),
    ("oversized stop list", "post", CHAT, chat(stop=["x"] * 17), 400, "invalid_parameter"),
    ("oversized stop string", "post", CHAT, chat(stop="x" * 257), 400, "invalid_parameter"),
    ("oversized logit_bias", "post", CHAT, chat(logit_bias={str(i): 1 for i in range(1025)}), 400, "invalid_parameter"),
    ("logit_bias out of range", "post", CHAT, chat(logit_bias={"1": 101}), 400, "invalid_parameter"),
    ("seed too large", "post", CHAT, chat(seed=2**64), 400, "invalid_parameter"),
    ("bad session id characters", "post", CHAT, chat(session_id="../etc/passwd"), 400, "invalid_parameter"),
    ("session id too long", "post", CHAT, chat(session_id="a" * 129), 400, "invalid_parameter"),
    ("a tool without a function", "post", CHAT, chat(tools=[{"type": "function"}]), 400, "invalid_parameter"),
    (
        "tools on completions",
        "post",
        COMPLETIONS,
        {"model": "tiny", "prompt": "x", "tools": []},
        400,
        "unsupported_parameter",
    ),
    (
        "choice of an unknown tool",
        "post",
        CHAT,
        chat(tools=[TOOL], tool_choice=named("other")),
        400,
        "invalid_parameter",
    ),
    (
        "an image part",
        "post",
        CHAT,
        chat(messages=[{"role": "user", "content": [IMAGE]}]),
        400,
        "unsupported_parameter",
    ),
    (
        "a schema the grammar cannot hold",
        "post",
        CHAT,
        chat(response_format=schema_format({"uniqueItems": True})),
        400,
        "invalid_parameter",
    ),
    (
        "a tool message without its call id",
        "post",
        CHAT,
        chat(messages=[{"role": "tool", "content": "4"}]),
        400,
        "invalid_parameter",
    ),
    ("unknown field", "post", CHAT, chat(frobnicate=True), 400, "unsupported_parameter"),
    ("prompt too long", "post", COMPLETIONS, {"model": "tiny", "prompt": [5] * 4097}, 400, "context_length_exceeded"),
    ("token id out of vocabulary", "post", COMPLETIONS, {"model": "tiny", "prompt": [10**6]}, 400, "invalid_parameter"),
    ("batched prompts", "post", COMPLETIONS, {"model": "tiny", "prompt": ["a", "b"]}, 400, "unsupported_parameter"),
    ("responses: empty input", "post", RESPONSES, {"model": "tiny", "input": []}, 400, "invalid_parameter"),
    (
        "responses: an item type it does not know",
        "post",
        RESPONSES,
        {"model": "tiny", "input": [{"type": "reasoning", "summary": []}]},
        400,
        "unsupported_parameter",
    ),
    (
        "responses: an image part",
        "post",
        RESPONSES,
        {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        400,
        "unsupported_parameter",
    ),
    (
        "responses: bad previous id",
        "post",
        RESPONSES,
        {"model": "tiny", "input": "x", "previous_response_id": "r1"},
        404,  # not one of ours, so not stored: OpenAI's answer to any unknown id
        "response_not_found",
    ),
    (
        "responses: unknown previous id",
        "post",
        RESPONSES,
        {"model": "tiny", "input": "x", "previous_response_id": "resp_" + "0" * 32},
        404,
        "response_not_found",
    ),
    ("sessions: negative ttl", "post", SESSIONS, {"ttl_s": -1}, 400, "invalid_parameter"),
    *[
        (f"lone surrogate in {where}", "post", path, body, 400, "invalid_parameter")
        for where, path, body in (
            ("chat content", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
            ("a completion prompt", COMPLETIONS, b'{"model": "tiny", "prompt": "\\ud800"}'),
            ("responses input", RESPONSES, b'{"model": "tiny", "input": "x\\udfff"}'),
            ("responses metadata", RESPONSES, b'{"model": "tiny", "input": "x", "metadata": {"k": "\\ud800"}}'),
            ("a session's system prompt", SESSIONS, b'{"system": "\\ud800"}'),
        )
    ],
    ("sessions: rewind of unknown", "post", SESSIONS + "/nope/rewind", {"turn": 0}, 404, "session_not_found"),
    ("sessions: bad id in path", "get", SESSIONS + "/bad%20id", None, 400, "invalid_parameter"),
    ("unknown route", "get", "/v1/nothing", None, 404, "not_found"),
    ("wrong method", "delete", CHAT, None, 405, "method_not_allowed"),
    (
        "body over the size limit",
        "post",
        CHAT,
        chat(messages=[{"role": "user", "content": "x" * 300_000}]),
        413,
        "request_too_large",
    ),
]


@pytest.fixture(scope="module")
def server(tiny_spec):
    settings = Settings(api_keys=f"{ALICE}:alice,{BOB}:bob", default_max_tokens=4, max_request_bytes=256 * 1024)
    with serve_live([tiny_spec], settings) as served:
        yield served


def send(base: str, method: str, path: str, body, key: str = ALICE) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    content = body if isinstance(body, bytes) else (None if body is None else json.dumps(body).encode())
    return httpx.request(method, base + path, content=content, headers=headers, timeout=30)


def check_envelope(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == code, err
    assert len(err["message"]) <= 512  # never an echo of a huge input


@pytest.mark.parametrize(("name", "method", "path", "body", "status", "code"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(server, name, method, path, body, status, code):
    check_envelope(send(server[0], method, path, body), status, code)


def test_bad_input_no_or_wrong_key(server):
    check_envelope(send(server[0], "post", CHAT, chat(), key="sk-nobody-000"), 401, "invalid_api_key")


def test_bad_input_foreign_session(server):
    base = server[0]
    sid = send(base, "post", SESSIONS, {}).json()["id"]
    check_envelope(send(base, "get", f"{SESSIONS}/{sid}", None, key=BOB), 404, "session_not_found")
    check_envelope(send(base, "delete", f"{SESSIONS}/{sid}", None, key=BOB), 404, "session_not_found")
    check_envelope(send(base, "post", f"{SESSIONS}/{sid}/rewind", {"turn": 0}, key=BOB), 404, "session_not_found")
    # On a generation endpoint the id names a session in the caller's own namespace: Bob gets one of his own.
    assert send(base, "post", CHAT, chat(session_id=sid), key=BOB).status_code == 200
    assert send(base, "get", f"{SESSIONS}/{sid}", None, key=BOB).json()["turns"] == 1
    assert send(base, "get", f"{SESSIONS}/{sid}", None).json()["turns"] == 0  # Alice's is untouched


def test_bad_input_same_session_twice_at_once(server):
    base, engine = server
    long = {"model": "tiny", "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "session_id": "twice"}
    first = threading.Thread(target=send, args=(base, "post", COMPLETIONS, long))
    first.start()
    wait_until(lambda: engine.num_active > 0, what="the first request to start")
    check_envelope(send(base, "post", COMPLETIONS, {**long, "max_tokens": 2}), 409, "session_busy")
    first.join(60)


def test_a_lone_surrogate_names_where_it_is_and_stores_nothing(server):
    base = server[0]
    before = send(base, "get", SESSIONS, None).json()["data"]
    body = b'{"model": "tiny", "input": "x", "metadata": {"k": "\\ud800"}}'
    r = send(base, "post", RESPONSES, body)
    check_envelope(r, 400, "invalid_parameter")
    assert r.json()["error"]["param"] == "metadata.k"
    assert send(base, "get", SESSIONS, None).json()["data"] == before


def test_an_unexpected_500_keeps_the_connection(server, monkeypatch):
    async def broken(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr("server.http.routes.generation.run_turn", broken)
    host, port = server[0].removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 1}).encode()
    request = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        first = exchange(sock, request)
        assert first.startswith(b"HTTP/1.1 500")
        assert b'"internal_error"' in first
        assert b"connection: close" not in first.lower()
        second = exchange(sock, health)  # the same connection serves the next request
        assert second.startswith(b"HTTP/1.1 200")


def exchange(sock: socket.socket, request: bytes) -> bytes:
    """Send one request and read one whole response (Content-Length framed) off a kept-alive socket."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        rest += chunk
    return head + b"\r\n\r\n" + rest

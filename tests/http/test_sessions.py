"""/v1/sessions: create with a prefilled system prompt, list, describe per tier, fork, rewind, delete, TTL."""

from __future__ import annotations

import re
import time

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.sessions.record import SessionKey
from server.settings import Settings
from tests.helpers import ask, pool_tokens, reference_greedy, wait_until
from tests.http.conftest import wait_ready

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def app_client(tiny_spec, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    app = create_app(Settings(default_max_tokens=6, state_dir=state), specs=[tiny_spec])
    with TestClient(app) as c:
        wait_ready(c)
        c.state_dir = state
        yield c


def chat(client, sid, messages, **extra):
    body = {"model": "tiny", "session_id": sid, "messages": messages, "temperature": 0, "max_tokens": 6, **extra}
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    return r


def store(client):
    return client.app.state.host.store


def test_create_prefills_the_system_prompt_so_the_first_turn_is_warm(app_client, tiny):
    r = app_client.post("/v1/sessions", json={"system": "You are terse and kind.", "ttl_s": 600})
    assert r.status_code == 201, r.text
    body = r.json()
    assert re.fullmatch(r"sess_[0-9a-f]{32}", body["id"])  # 128 random bits, made by the server
    assert body["turns"] == 0
    assert body["system_tokens"] == body["transcript_tokens"] > 0
    assert body["cache"]["device"]["tokens"] == body["system_tokens"]
    assert body["expires_at"] - body["last_used_at"] == pytest.approx(600, abs=1)
    first = chat(app_client, body["id"], [{"role": "user", "content": "Hello"}])
    usage = first.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == body["system_tokens"]
    assert first.headers["X-Cache"] == "partial"
    assert first.headers["X-Cache-Source"] == "device"
    # The session's system prompt applied without the client repeating it: the prompt is the prefilled ids + the turn.
    system_ids = store(app_client).view(SessionKey("default", body["id"])).transcript_ids[: body["system_tokens"]]
    turn = tiny.tokenizer("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    assert usage["prompt_tokens"] == len(system_ids) + len(turn)
    expected = tiny.tokenizer.decode(reference_greedy(tiny.model, system_ids + turn, 6), skip_special_tokens=True)
    assert first.json()["choices"][0]["message"]["content"] == expected


def test_list_describe_and_delete(app_client):
    ids = [app_client.post("/v1/sessions", json={}).json()["id"] for _ in range(3)]
    listed = app_client.get("/v1/sessions", params={"limit": 2}).json()
    all_ids = [s["id"] for s in app_client.get("/v1/sessions", params={"limit": 1000}).json()["data"]]
    assert listed["object"] == "list"
    assert len(listed["data"]) == 2
    assert listed["has_more"]
    assert all_ids[-3:] == ids  # oldest first
    after = app_client.get("/v1/sessions", params={"after": ids[0], "limit": 1000}).json()
    assert [s["id"] for s in after["data"]][-2:] == ids[1:]
    assert app_client.delete(f"/v1/sessions/{ids[0]}").json()["deleted"] is True
    assert app_client.get(f"/v1/sessions/{ids[0]}").status_code == 404
    assert app_client.delete(f"/v1/sessions/{ids[0]}").json()["error"]["code"] == "session_not_found"


def files_of(client, name: str) -> list[str]:
    return sorted(p.name for p in client.state_dir.rglob(f"*{name}*"))


def block_files(client) -> list[str]:
    return sorted(p.name for p in (client.state_dir / "kv" / "blocks").rglob("*.safetensors"))


def test_delete_and_expiry_remove_transcript_and_snapshots_from_every_tier(app_client, monkeypatch):
    sid = app_client.post("/v1/sessions", json={"system": "Be brief."}).json()["id"]
    chat(app_client, sid, [{"role": "user", "content": "Hello"}])
    host = app_client.app.state.host
    key, engine = SessionKey("default", sid), host.engines["tiny"]
    assert ask(engine, lambda: engine.offloader.save(key, host.store.transcript(key)))  # as at shutdown
    host.tiers.flush()
    assert files_of(app_client, sid) == [f"session-{sid}.json", f"session-{sid}.kv.json"]  # record, K/V manifest
    assert block_files(app_client)  # its K/V, a file per block
    app_client.delete(f"/v1/sessions/{sid}")
    assert files_of(app_client, sid) == []
    assert block_files(app_client) == []  # no other session named those blocks
    short = app_client.post("/v1/sessions", json={"ttl_s": 60}).json()["id"]
    chat(app_client, short, [{"role": "user", "content": "Hi"}])
    short_key = SessionKey("default", short)
    assert ask(engine, lambda: engine.offloader.save(short_key, host.store.transcript(short_key)))  # below the pool
    host.tiers.flush()
    assert files_of(app_client, short) == [f"session-{short}.json", f"session-{short}.kv.json"]
    assert block_files(app_client)
    assert app_client.get(f"/v1/sessions/{short}").status_code == 200
    later = time.monotonic() + 61  # the store's clock moved past its TTL (the wall clock plays no part)
    monkeypatch.setattr(host.store, "_clock", lambda: later)
    assert app_client.get(f"/v1/sessions/{short}").status_code == 404  # expired: record and K/V everywhere go
    assert files_of(app_client, short) == []
    assert block_files(app_client) == []
    assert host.tiers.peek_tokens(short_key) == 0


def three_turns(client, sid) -> list[dict]:
    messages = []
    for user in ("Hello world", "Paris is", "The quick"):
        messages.append({"role": "user", "content": user})
        reply = chat(client, sid, messages).json()["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": reply})
    return messages


def test_fork_shares_blocks_with_the_parent_and_continues_exactly(app_client, tiny):
    parent = app_client.post("/v1/sessions", json={"system": "Answer briefly."}).json()["id"]
    messages = three_turns(app_client, parent)
    r = app_client.post(f"/v1/sessions/{parent}/fork", json={"turn": 2})
    assert r.status_code == 201, r.text
    fork = r.json()
    assert fork["parent"] == parent
    assert fork["turns"] == 2
    assert fork["id"] != parent
    assert fork["cache"]["device"]["shared_bytes"] > 0
    assert fork["cache"]["device"]["exclusive_bytes"] == 0
    assert app_client.get(f"/v1/sessions/{parent}").json()["cache"]["device"]["shared_bytes"] > 0
    view = store(app_client).view(SessionKey("default", fork["id"]))
    new = [*messages[:4], {"role": "user", "content": "Berlin"}]
    r = chat(app_client, fork["id"], new)
    usage = r.json()["usage"]
    # All of the fork's transcript (and the parent's next turn header, which is the same) from the parent's blocks.
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(view.transcript_ids) - 1
    prompt = store(app_client).view(SessionKey("default", fork["id"])).transcript_ids[: usage["prompt_tokens"]]
    expected = tiny.tokenizer.decode(reference_greedy(tiny.model, prompt, 6), skip_special_tokens=True)
    assert r.json()["choices"][0]["message"]["content"] == expected
    assert app_client.get(f"/v1/sessions/{parent}").json()["turns"] == 3  # the parent is untouched


def test_rewind_drops_later_turns(app_client):
    sid = app_client.post("/v1/sessions", json={}).json()["id"]
    messages = three_turns(app_client, sid)
    before = app_client.get(f"/v1/sessions/{sid}").json()
    r = app_client.post(f"/v1/sessions/{sid}/rewind", json={"turn": 1})
    assert r.status_code == 200
    assert r.json()["turns"] == 1
    assert r.json()["transcript_tokens"] < before["transcript_tokens"]
    r = chat(app_client, sid, [*messages[:2], {"role": "user", "content": "Again"}])
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert app_client.get(f"/v1/sessions/{sid}").json()["turns"] == 2


def test_fork_and_rewind_by_turn_after_an_edited_history_give_that_turns_conversation(app_client, tiny):
    sid = app_client.post("/v1/sessions", json={"system": "Answer briefly."}).json()["id"]
    forced = {"max_tokens": 1, "logit_bias": {str(tiny.tokenizer.convert_tokens_to_ids("The")): 100}}
    system = [{"role": "system", "content": "Answer briefly."}]

    def turn(messages):  # the reply is one forced token: it renders back to the ids the model made
        reply = chat(app_client, sid, messages, **forced).json()["choices"][0]["message"]
        assert reply["content"] == "The"
        return [*messages, {"role": "assistant", "content": reply["content"]}]

    def at(session_id):
        view = store(app_client).view(SessionKey("default", session_id))
        return view.messages, view.transcript_ids

    first = turn([{"role": "user", "content": "Hello world"}])
    after_first = at(sid)
    turn([*first, {"role": "user", "content": "Paris is"}])
    # The history edited with the count of messages unchanged: turn 2's question is another one.
    edited = turn([*first, {"role": "user", "content": "Berlin"}])
    now = at(sid)
    assert now[0] == [*system, *edited]
    described = app_client.get(f"/v1/sessions/{sid}").json()
    assert described["turns"] == 2  # turn 1, and the edited turn 2
    base = (system, now[1][: described["system_tokens"]])
    for number, expected in ((0, base), (1, after_first), (2, now)):
        fork = app_client.post(f"/v1/sessions/{sid}/fork", json={"turn": number})
        assert fork.status_code == 201, fork.text
        assert at(fork.json()["id"]) == expected, number
    assert app_client.post(f"/v1/sessions/{sid}/rewind", json={"turn": 3}).status_code == 400
    assert app_client.post(f"/v1/sessions/{sid}/rewind", json={"turn": 1}).status_code == 200
    assert at(sid) == after_first
    # An edit of the first message holds no turn but the base: the session is at turn 1 again.
    turn([{"role": "user", "content": "Paris is"}])
    assert app_client.get(f"/v1/sessions/{sid}").json()["turns"] == 1


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/sessions/{sid}/rewind", {"turn": 9}, 400, "invalid_parameter"),
        ("/v1/sessions/{sid}/fork", {"turn": 9}, 400, "invalid_parameter"),
        ("/v1/sessions/{sid}/rewind", {"turn": -1}, 400, "invalid_parameter"),
        ("/v1/sessions/nope/fork", {}, 404, "session_not_found"),
        ("/v1/sessions/nope/rewind", {"turn": 0}, 404, "session_not_found"),
        ("/v1/sessions", {"model": "missing"}, 404, "model_not_found"),
        ("/v1/sessions", {"ttl_s": 0}, 400, "invalid_parameter"),
        ("/v1/sessions", {"bogus": 1}, 400, "unsupported_parameter"),
    ],
)
def test_session_route_errors(app_client, path, body, status, code):
    sid = app_client.post("/v1/sessions", json={}).json()["id"]
    r = app_client.post(path.format(sid=sid), json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text


def test_openapi_documents_the_session_routes_with_examples(app_client):
    schema = app_client.get("/openapi.json").json()
    for path in (
        "/v1/sessions",
        "/v1/sessions/{session_id}",
        "/v1/sessions/{session_id}/fork",
        "/v1/sessions/{session_id}/rewind",
        "/v1/responses",
        "/v1/responses/{response_id}",
    ):
        assert path in schema["paths"], path
    get = schema["paths"]["/v1/sessions/{session_id}"]["get"]["responses"]["200"]["content"]["application/json"]
    assert get["example"]["object"] == "session"
    components = schema["components"]["schemas"]
    for name in ("SessionCreate", "SessionFork", "SessionRewind", "ResponseRequest"):
        assert components[name].get("examples"), name


def parent_and_fork(client, system: str):
    """A session with three turns and a fork of it at turn 1: their ids and transcripts."""
    parent = client.post("/v1/sessions", json={"system": system}).json()["id"]
    three_turns(client, parent)
    fork = client.post(f"/v1/sessions/{parent}/fork", json={"turn": 1}).json()["id"]
    transcripts = [store(client).transcript(SessionKey("default", sid)) for sid in (parent, fork)]
    return parent, fork, *transcripts


def test_delete_frees_the_sessions_own_device_blocks_but_not_shared_ones(app_client):
    engine = app_client.app.state.host.engines["tiny"]
    parent, _, parent_ids, fork_ids = parent_and_fork(app_client, "Numbers 0123456789 and symbols.")
    assert pool_tokens(engine, parent_ids) == len(parent_ids) - 1
    app_client.delete(f"/v1/sessions/{parent}")
    # the engine drops them on its next loop (idle: within a second)
    wait_until(lambda: pool_tokens(engine, parent_ids) < len(parent_ids) - 1, what="the deleted session's K/V to go")
    assert pool_tokens(engine, parent_ids) < len(fork_ids) + engine.config.block_size
    assert pool_tokens(engine, fork_ids) == len(fork_ids)  # the fork still reaches its blocks


def test_deleting_a_fork_leaves_every_block_of_its_parent(app_client):
    engine = app_client.app.state.host.engines["tiny"]
    _, fork, parent_ids, fork_ids = parent_and_fork(app_client, "Paris is the capital of France.")
    assert len(fork_ids) % engine.config.block_size  # the fork ends inside one of the parent's blocks
    before = pool_tokens(engine, parent_ids)
    assert app_client.delete(f"/v1/sessions/{fork}").status_code == 200
    ask(engine, lambda: None)  # the engine's next loop has dropped what only the fork reached: nothing
    ask(engine, lambda: None)
    assert pool_tokens(engine, parent_ids) == before

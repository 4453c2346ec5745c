"""A session's data belongs to that session alone: no endpoint silently replaces another's transcript, and after
a delete nothing of the session is served, whenever the delete came."""

from __future__ import annotations

import httpx

from tests.helpers import wait_until

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def test_a_completion_never_replaces_a_chat_transcript(client):
    messages = [{"role": "user", "content": "Hello there, chat"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 3, "session_id": "chatty"}
    assert client.post(CHAT, json=body).status_code == 200
    before = client.get("/v1/sessions/chatty").json()
    r = client.post(COMPLETIONS, json={"model": "tiny", "prompt": "abc", "max_tokens": 2, "session_id": "chatty"})
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "session_mode_mismatch"
    assert "/v1/chat/completions" in r.json()["error"]["message"]
    after = client.get("/v1/sessions/chatty").json()
    assert (after["turns"], after["transcript_tokens"]) == (before["turns"], before["transcript_tokens"])


def test_a_chat_turn_never_replaces_a_completion_transcript(client):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3, "session_id": "storyteller"}
    assert client.post(COMPLETIONS, json=body).status_code == 200
    messages = [{"role": "user", "content": "Hi"}]
    r = client.post(CHAT, json={"model": "tiny", "messages": messages, "max_tokens": 2, "session_id": "storyteller"})
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "session_mode_mismatch"
    assert client.post(COMPLETIONS, json=body | {"prompt": "Once upon a time, again"}).status_code == 200


def test_nothing_of_a_session_deleted_while_it_streams_is_served_afterwards(live):
    base, engine = live
    messages = [{"role": "user", "content": "Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9: deleted mid-stream."}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", base + CHAT, json=body | {"stream": True, "session_id": "doomed"}, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # prefilled, decoding
        assert httpx.delete(base + "/v1/sessions/doomed").status_code == 200
        rest = list(lines)  # the request is detached and finishes; its state is then dropped
    assert [line for line in rest if line][-1] == "data: [DONE]"
    wait_until(lambda: engine.num_active == 0, what="the stream to end")
    again = httpx.post(base + CHAT, json=body | {"max_tokens": 2}, timeout=60)
    assert again.status_code == 200
    assert again.headers["X-Cache"] == "miss"  # none of the deleted session's K/V
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

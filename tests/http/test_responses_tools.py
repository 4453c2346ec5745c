"""The Responses API's structured output, function calls, item references, input items and sessions."""

from __future__ import annotations

import json

import jsonschema

from server.sessions.record import SessionKey
from tests.http.test_responses import RESPONSES, sse
from tests.http.test_tools import MANY_OPTIONAL, PERSON, WEATHER, assert_refused, cut_inside_arguments

FUNCTION = {"type": "function", **WEATHER["function"]}


def create(client, **body) -> dict:
    r = client.post(RESPONSES, json={"model": "tiny", "temperature": 1.0, "max_output_tokens": 80, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_text_format_json_schema_is_held_to_the_schema(client):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    for seed in range(5):
        body = create(client, input="Who?", seed=seed, text=fmt)
        assert body["status"] == "completed"
        jsonschema.validate(json.loads(body["output"][0]["content"][0]["text"]), PERSON)
        assert body["text"]["format"]["name"] == "person"


def test_function_calls_are_output_items_and_their_outputs_continue_exactly(client):
    first = create(client, input="Weather in Paris?", seed=5, tools=[FUNCTION], tool_choice="required")
    assert first["tools"][0]["name"] == "get_weather"
    calls = [item for item in first["output"] if item["type"] == "function_call"]
    assert calls
    assert all(item["type"] == "function_call" for item in first["output"])  # no text: no message item
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])
    store = client.app.state.host.store
    transcript = store.transcript(SessionKey("default", first["id"], "response"))
    results = [{"type": "function_call_output", "call_id": c["call_id"], "output": '{"sky": "clear"}'} for c in calls]
    second = create(client, input=results, previous_response_id=first["id"], tools=[FUNCTION], max_output_tokens=5)
    assert second["usage"]["input_tokens_details"]["cached_tokens"] == len(transcript) - 1
    continued = store.transcript(SessionKey("default", second["id"], "response"))
    assert continued[: len(transcript)] == transcript  # the parent's exact ids, then the outputs' tokens


def test_streamed_function_calls_send_their_item_events(client):
    body = {"model": "tiny", "input": "Weather?", "stream": True, "seed": 5, "temperature": 1.0}
    body |= {"max_output_tokens": 80, "tools": [FUNCTION], "tool_choice": "required", "parallel_tool_calls": False}
    with client.stream("POST", RESPONSES, json=body) as r:
        events = sse(r)
    kinds = [kind for kind, _ in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1][1]["response"]
    (item,) = final["output"]
    assert events[2][1]["item"]["arguments"] == ""
    assert events[4][1]["arguments"] == item["arguments"] == events[5][1]["item"]["arguments"]
    assert client.get(f"{RESPONSES}/{final['id']}").json()["output"] == final["output"]


def test_an_item_reference_names_a_stored_output_and_input_items_are_listed(client):
    first = create(client, input="Hello world", temperature=0, max_output_tokens=5)
    message_id = first["output"][0]["id"]
    # The Vercel AI SDK's second turn: the whole conversation, the earlier reply as a reference to its item.
    turn2 = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello world"}]},
        {"type": "item_reference", "id": message_id},
        {"role": "user", "content": [{"type": "input_text", "text": "And then?"}]},
    ]
    second = create(client, input=turn2, temperature=0, max_output_tokens=5)
    messages = client.app.state.host.store.view(SessionKey("default", second["id"], "response")).messages
    assert messages[1] == {"role": "assistant", "content": first["output"][0]["content"][0]["text"]}
    listed = client.get(f"{RESPONSES}/{second['id']}/input_items", params={"order": "asc"}).json()
    assert [item["type"] for item in listed["data"]] == ["message", "item_reference", "message"]
    assert listed["data"][1]["id"] == message_id
    assert not listed["has_more"]
    newest = client.get(f"{RESPONSES}/{second['id']}/input_items", params={"limit": 1}).json()
    assert newest["data"][0]["content"][0]["text"] == "And then?"
    assert newest["has_more"]
    bad = client.post(RESPONSES, json={"model": "tiny", "input": [{"type": "item_reference", "id": "msg_" + "0" * 32}]})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "input"


def test_a_session_on_responses_means_what_it_means_on_chat(client):
    headers = {"X-Session-ID": "resp-session"}
    first = client.post(
        RESPONSES, json={"model": "tiny", "input": "Hello", "max_output_tokens": 4, "temperature": 0}, headers=headers
    )
    assert first.status_code == 200, first.text
    assert first.headers["X-Session-ID"] == "resp-session"
    reply = first.json()["output"][0]["content"][0]["text"]
    conversation = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "More"},
    ]
    body = {
        "model": "tiny",
        "input": conversation,
        "max_output_tokens": 4,
        "temperature": 0,
        "session_id": "resp-session",
    }
    second = client.post(RESPONSES, json=body)
    assert second.status_code == 200, second.text
    session = client.app.state.host.store.view(SessionKey("default", "resp-session"))
    assert session.num_turns == 2
    assert second.json()["usage"]["input_tokens_details"]["cached_tokens"] == session.turns[1].end - 1
    stored = client.get(f"{RESPONSES}/{second.json()['id']}").json()  # the stored response: the session's state
    assert stored["output"] == second.json()["output"]
    bucket = client.post(
        RESPONSES, json={"model": "tiny", "input": "Hi", "max_output_tokens": 2, "prompt_cache_key": "b1"}
    )
    assert bucket.status_code == 200, bucket.text
    assert "X-Session-ID" not in bucket.headers  # a bucket is a cache key, not a session
    stored = client.get(f"{RESPONSES}/{bucket.json()['id']}")  # ...so the response is stored as without one
    assert stored.status_code == 200
    body = {"model": "tiny", "input": "More", "max_output_tokens": 2, "previous_response_id": bucket.json()["id"]}
    assert client.post(RESPONSES, json=body | {"prompt_cache_key": "b1"}).status_code == 200


def test_other_tool_types_are_400s_naming_them(client):
    r = client.post(RESPONSES, json={"model": "tiny", "input": "x", "tools": [{"type": "web_search"}]})
    assert r.status_code == 400
    assert "web_search" in r.json()["error"]["message"]


def test_a_forced_call_cut_by_max_output_tokens_is_an_incomplete_function_call(client):
    body = {"input": "Weather?", "seed": 5, "tools": [FUNCTION], "tool_choice": "required"}
    body["parallel_tool_calls"] = False
    whole = create(client, **body)
    (call,) = whole["output"]
    store, tokenizer = client.app.state.host.store, client.app.state.host.engines["tiny"].loaded.tokenizer
    ids = store.transcript(SessionKey("default", whole["id"], "response"))[-whole["usage"]["output_tokens"] :]
    num_cut = cut_inside_arguments(tokenizer, ids)
    cut = create(client, **body, max_output_tokens=num_cut)
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = cut["output"]  # no message item: nothing of the call's markup is text
    assert (item["type"], item["status"], item["name"]) == ("function_call", "incomplete", "get_weather")
    assert call["arguments"].startswith(item["arguments"])
    assert item["arguments"] != call["arguments"]
    with client.stream(
        "POST",
        RESPONSES,
        json={"model": "tiny", "temperature": 1.0, "stream": True, **body, "max_output_tokens": num_cut},
    ) as r:
        events = sse(r)
    kinds = [kind for kind, _ in events]
    assert "response.output_text.delta" not in kinds
    assert kinds[-1] == "response.incomplete"
    done = [data["item"] for kind, data in events if kind == "response.output_item.done"]
    assert [(d["type"], d["status"], d["name"], d["arguments"]) for d in done] == [
        ("function_call", "incomplete", "get_weather", item["arguments"])
    ]
    (final,) = events[-1][1]["response"]["output"]
    assert (final["status"], final["arguments"]) == ("incomplete", item["arguments"])


def test_a_text_format_the_grammar_cannot_hold_is_a_400_and_nothing_is_stored(client):
    store = client.app.state.host.store
    before = list(store.session_keys("response"))
    for schema, said in ((MANY_OPTIONAL, "too many alternatives"), ({"$ref": "#"}, "no finite document")):
        fmt = {"format": {"type": "json_schema", "name": "doc", "schema": schema}}
        r = client.post(RESPONSES, json={"model": "tiny", "input": "Hi", "text": fmt, "session_id": "refused-text"})
        assert_refused(r, "text.format", said)
        tool = {"type": "function", "name": "big", "parameters": schema}
        r = client.post(RESPONSES, json={"model": "tiny", "input": "Hi", "tools": [tool], "tool_choice": "required"})
        assert_refused(r, "tools", said)
    assert list(store.session_keys("response")) == before
    assert store.view(SessionKey("default", "refused-text")) is None

"""A forced tool choice (required, a named function, Anthropic's any/tool) wins over an output format asked beside it:
the reply is calls, held by the call grammar, never a document of the format's schema."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.http.test_tools import ADD, PERSON, WEATHER, user

PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
TOOLS = {"get_weather": WEATHER, "add": ADD}


@pytest.mark.parametrize(
    ("tool_choice", "response_format"),
    [
        ("required", PERSON_FORMAT),
        ({"type": "function", "function": {"name": "add"}}, {"type": "json_object"}),
    ],
)
def test_a_forced_tool_choice_wins_over_a_response_format(client, tool_choice, response_format):
    for seed in range(3):
        body = {
            "model": "tiny", "temperature": 1.0, "max_tokens": 80, "seed": seed, "messages": user("Weather?"),
            "tools": [WEATHER, ADD], "tool_choice": tool_choice, "response_format": response_format,
        }  # fmt: skip
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert calls
        for call in calls:
            if isinstance(tool_choice, dict):
                assert call["function"]["name"] == "add"
            schema = TOOLS[call["function"]["name"]]["function"]["parameters"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_anthropic_tool_choice_any_wins_over_an_output_format(client):
    tool = {"name": "add", "input_schema": ADD["function"]["parameters"]}
    one = {"disable_parallel_tool_use": True}  # one call: greedy, the tiny model would call on and on
    for choice in ({"type": "any", **one}, {"type": "tool", "name": "add", **one}):
        body = {
            "model": "tiny", "max_tokens": 80, "temperature": 0, "messages": user("Sum?"), "tools": [tool],
            "tool_choice": choice, "output_config": {"format": {"type": "json_schema", "schema": PERSON}},
        }  # fmt: skip
        r = client.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["stop_reason"] == "tool_use", reply
        assert reply["content"]
        assert all(b["type"] == "tool_use" for b in reply["content"])  # calls only: no document beside them
        for call in reply["content"]:
            jsonschema.validate(call["input"], ADD["function"]["parameters"])


@pytest.mark.e2e
def test_a_forced_tool_choice_wins_over_a_response_format_on_the_default_model(default_model):
    base, model = default_model
    body = {
        "model": model, "temperature": 0, "max_tokens": 120, "parallel_tool_calls": False,
        "messages": user("What is the weather in Paris for the next 3 days?"), "tools": [WEATHER],
        "tool_choice": "required", "response_format": PERSON_FORMAT,
    }  # fmt: skip
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.e2e
def test_a_forced_call_on_an_open_schema_tool_ends_before_max_tokens_on_the_default_model(default_model):
    """`{"type": "object"}` says nothing of its keys: the call may pass any object, and with parallel calls allowed
    the reply ends by itself or at the first repeated call, never by max_tokens (it once repeated `{}` until then)."""
    base, model = default_model
    search = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    body = {
        "model": model, "temperature": 0, "max_tokens": 300, "messages": user("Look up python tutorials"),
        "tools": [search], "tool_choice": "required",
    }  # fmt: skip
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    answer = r.json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert answer["usage"]["completion_tokens"] < 300
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert len(set(calls)) == len(calls)  # no call twice
    assert all(name == "search" and isinstance(json.loads(arguments), dict) for name, arguments in calls)

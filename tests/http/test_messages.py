"""The Anthropic Messages API, driven by the official `anthropic` SDK against a live server on the tiny model."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from server.sessions.record import SessionKey
from tests.http.test_tools import WEATHER

GREEDY = {"temperature": 0}  # the SDK no longer types sampling fields; the API still takes them
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER["function"]["parameters"],
}


@pytest.fixture(scope="module")
def claude(live):
    base, engine = live
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0), engine


def test_a_message_and_its_usage(claude):
    client, _ = claude
    reply = client.messages.create(
        model="tiny",
        max_tokens=6,
        system="Be brief.",
        messages=[{"role": "user", "content": "Hello"}],
        extra_body=GREEDY,
    )
    assert reply.type == "message"
    assert reply.role == "assistant"
    assert reply.content[0].type == "text"
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.usage.input_tokens > 0
    assert reply.usage.output_tokens <= 6
    counted = client.messages.count_tokens(
        model="tiny", system="Be brief.", messages=[{"role": "user", "content": "Hello"}]
    )
    total = reply.usage.input_tokens + reply.usage.cache_read_input_tokens + reply.usage.cache_creation_input_tokens
    assert counted.input_tokens == total


def test_stream_events_follow_anthropics_sequence(claude):
    client, _ = claude
    kinds, text = [], ""
    with client.messages.stream(
        model="tiny", max_tokens=8, messages=[{"role": "user", "content": "Hi"}], extra_body=GREEDY
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                text += event.delta.text
        final = stream.get_final_message()
    raw = [
        k
        for k in kinds
        if k in ("message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop")
    ]
    assert raw == ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == text
    assert final.usage.output_tokens > 0


def test_stop_sequences_say_which_ended_the_reply(live):
    base, _ = live
    body = {
        "model": "tiny",
        "max_tokens": 40,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Hello world"}],
    }
    plain = httpx.post(base + "/v1/messages", json=body).json()["content"][0]["text"]
    stop = plain[3:5]
    cut = httpx.post(base + "/v1/messages", json={**body, "stop_sequences": ["zzz-never", stop]}).json()
    assert cut["stop_reason"] == "stop_sequence"
    assert cut["stop_sequence"] == stop
    assert cut["content"][0]["text"] == plain[: plain.index(stop)]


def test_cache_control_reports_cache_creation_then_reads(claude):
    client, _ = claude
    system = [
        {"type": "text", "text": "You are a careful weather assistant. " * 6, "cache_control": {"type": "ephemeral"}}
    ]
    first = client.messages.create(
        model="tiny", max_tokens=2, system=system, messages=[{"role": "user", "content": "Rome?"}]
    )
    assert first.usage.cache_creation_input_tokens > 20  # the system prompt, computed now and kept for reuse
    again = client.messages.create(
        model="tiny", max_tokens=2, system=system, messages=[{"role": "user", "content": "Oslo?"}]
    )
    assert again.usage.cache_creation_input_tokens == 0
    assert again.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens - 16  # read, not made again
    for usage in (first.usage, again.usage):
        assert usage.input_tokens >= 1


def test_max_tokens_zero_warms_the_cache(claude):
    client, _ = claude
    system = "You answer in French, briefly and politely, always. " * 4
    messages = [{"role": "user", "content": "Bonjour"}]
    warm = client.messages.create(model="tiny", max_tokens=0, system=system, messages=messages)
    assert warm.content == []
    assert warm.stop_reason == "max_tokens"
    assert warm.usage.output_tokens == 0
    hot = client.messages.create(model="tiny", max_tokens=2, system=system, messages=messages)
    prompt = warm.usage.input_tokens + warm.usage.cache_read_input_tokens + warm.usage.cache_creation_input_tokens
    assert hot.usage.cache_read_input_tokens == prompt - 1  # all of it but the last token, computed by the warming


def test_structured_output_holds_to_its_schema(claude):
    client, _ = claude
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    reply = client.messages.create(
        model="tiny", max_tokens=30, messages=[{"role": "user", "content": "Ok?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(reply.content[0].text), schema)


def test_tools_in_anthropics_shape_round_trip_on_a_session(claude):
    client, engine = claude
    session = {"X-Session-ID": "claude-tools"}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(
        model="tiny", max_tokens=150, tools=[TOOL], tool_choice={"type": "any"}, messages=messages,
        extra_headers=session, extra_body={"temperature": 1.0},
    )  # fmt: skip
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert calls
    jsonschema.validate(calls[0].input, TOOL["input_schema"])
    transcript = engine.store.view(SessionKey("default", "claude-tools")).transcript_ids
    results = [{"type": "tool_result", "tool_use_id": c.id, "content": "sunny"} for c in calls]
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": results},
    ]
    second = client.messages.create(model="tiny", max_tokens=4, tools=[TOOL], messages=messages, extra_headers=session)
    assert second.usage.cache_read_input_tokens >= len(transcript) - 1
    assert engine.store.view(SessionKey("default", "claude-tools")).transcript_ids[: len(transcript)] == transcript


def test_errors_come_in_anthropics_envelope(claude, live):
    client, _ = claude
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="tiny", max_tokens=-1, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    base, _ = live
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    r = httpx.post(
        base + "/v1/messages",
        json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [image]}]},
    )
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    assert "image" in r.json()["error"]["message"]

"""The Anthropic Messages API, driven by the official `anthropic` SDK against a live server on the tiny model."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.sessions.record import SessionKey
from server.settings import Settings
from tests.http.conftest import wait_ready
from tests.http.test_tools import ADD, WEATHER, cut_inside_arguments

GREEDY = {"temperature": 0}  # the SDK no longer types sampling fields; the API still takes them
TIMEOUT = 300.0  # seconds, for raw httpx calls that wait on a generation (httpx's default is 5 s; CI is slow)
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
    client, engine = claude
    conversation = dict(system="Be brief.", messages=[{"role": "user", "content": "Hello"}])
    counted = client.messages.count_tokens(model="tiny", **conversation).input_tokens
    reads = []
    for _ in range(2):  # the same request again: then most of its prompt is read from the cache
        before = engine.counter.num_prefill_tokens
        reply = client.messages.create(model="tiny", max_tokens=6, extra_body=GREEDY, **conversation)
        computed = engine.counter.num_prefill_tokens - before  # prompt tokens fed to the model for this reply
        assert reply.type == "message"
        assert reply.role == "assistant"
        assert reply.content[0].type == "text"
        assert reply.stop_reason in ("end_turn", "max_tokens")
        assert reply.usage.output_tokens <= 6
        # No breakpoint: nothing is a cache write; what was not computed was read; the rest is plain input.
        assert reply.usage.cache_creation_input_tokens == 0
        assert reply.usage.cache_read_input_tokens == counted - computed
        assert reply.usage.input_tokens == computed > 0
        reads.append(reply.usage.cache_read_input_tokens)
    assert reads[1] == counted - 1  # all but the last token, which is computed again for its logits


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


def sse_events(r) -> list[dict]:
    return [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line.startswith("data: ")]


def test_a_streams_last_message_delta_carries_the_whole_usage(tiny_spec):
    """LangChain's ChatAnthropic.stream() reads usage only from the final message_delta, as Anthropic's stream
    carries it all there: it equals the JSON answer's usage for the same request, cache reads and writes included.
    Two tenants (their prefix caches apart) run the same conversation: one answered in JSON, one streamed."""
    keys = {"alice": "sk-alice-0123", "bob": "sk-bob-45678"}
    settings = Settings(api_keys=",".join(f"{k}:{t}" for t, k in keys.items()), default_max_tokens=4)
    hello = [{"role": "user", "content": "Hello there"}]
    with TestClient(create_app(settings, specs=[tiny_spec])) as client:
        wait_ready(client)
        answers = {}
        for tenant, key in keys.items():
            headers = {"x-api-key": key, "X-Session-ID": "s"}
            body = {"model": "tiny", "max_tokens": 6, "temperature": 0}
            first = client.post("/v1/messages", json={**body, "messages": hello}, headers=headers).json()
            second = [
                *hello,
                {"role": "assistant", "content": first["content"]},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "And then?", "cache_control": {"type": "ephemeral"}}],
                },
            ]
            if tenant == "alice":
                answers[tenant] = client.post("/v1/messages", json={**body, "messages": second}, headers=headers).json()
                continue
            with client.stream(
                "POST", "/v1/messages", json={**body, "messages": second, "stream": True}, headers=headers
            ) as r:
                events = sse_events(r)
            assert events[-1]["type"] == "message_stop"
            assert events[-2]["type"] == "message_delta"
            answers[tenant] = {"usage": events[-2]["usage"]}
    usage = answers["alice"]["usage"]
    assert answers["bob"]["usage"] == usage
    assert usage["cache_read_input_tokens"] > 0  # the session's transcript
    assert usage["cache_creation_input_tokens"] > 0  # the new turn, up to its breakpoint


def test_stop_sequences_say_which_ended_the_reply(live):
    base, _ = live
    body = {
        "model": "tiny",
        "max_tokens": 40,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Hello world"}],
    }
    plain = httpx.post(base + "/v1/messages", json=body, timeout=TIMEOUT).json()["content"][0]["text"]
    stop = plain[3:5]
    cut = httpx.post(
        base + "/v1/messages", json={**body, "stop_sequences": ["zzz-never", stop]}, timeout=TIMEOUT
    ).json()
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


def test_cache_writes_end_at_the_last_breakpoint_and_carry_its_ttl(claude, live):
    """The three input counts, exactly: read = the prompt tokens not computed (the engine's counter), written
    = the computed ones up to the LAST breakpoint (the prefix as the template renders it), input = the rest;
    the writes sit under the breakpoint's ttl in `cache_creation`."""
    client, engine = claude
    base, _ = live

    def turn(text: str, mark: dict | None) -> dict:
        block = {"type": "text", "text": text} | ({"cache_control": mark} if mark else {})
        return {"role": "user", "content": [block]}

    for ttl in ("1h", "5m"):
        mark = {"type": "ephemeral", "ttl": ttl}
        messages = [  # two breakpoints, then a tail: the first one's prefix is far shorter than the last one's
            turn(f"Remember the {ttl} codeword: lighthouse.", mark),
            {"role": "assistant", "content": "Noted."},
            turn(f"A long note to keep ({ttl}): " + "the tide comes in and the tide goes out. " * 8, mark),
            {"role": "assistant", "content": "Kept."},
            turn("What was the codeword?", None),
        ]
        chat = [
            {"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
            for m in messages
        ]
        marked = httpx.post(
            base + "/tokenize",
            json={"model": "tiny", "messages": chat[:3], "add_generation_prompt": False},
            timeout=TIMEOUT,
        ).json()["count"]
        prompt = client.messages.count_tokens(model="tiny", messages=messages).input_tokens
        before = engine.counter.num_prefill_tokens
        reply = client.messages.create(model="tiny", max_tokens=2, messages=messages, extra_body=GREEDY)
        computed = engine.counter.num_prefill_tokens - before
        read = prompt - computed
        written = marked - read
        assert written > 20, (marked, read)  # the last breakpoint's prefix was mostly computed now
        usage = reply.usage
        assert usage.cache_read_input_tokens == read
        assert usage.cache_creation_input_tokens == written
        assert usage.input_tokens == prompt - marked > 0  # the tail after the last breakpoint
        created = usage.cache_creation
        assert (created.ephemeral_1h_input_tokens, created.ephemeral_5m_input_tokens) == (
            (written, 0) if ttl == "1h" else (0, written)
        )


def test_a_breakpoint_whose_prefix_renders_longer_than_the_prompt_claims_no_more_than_the_prompt(live):
    """A session's turn continues its transcript token-exactly; its breakpoint's prefix is rendered afresh, where the
    tiny model's reply (bytes cut mid-character, read back as U+FFFD) takes more tokens than it did. Every prompt
    token is still counted once, and none is counted twice."""
    base, engine = live
    messages = [{"role": "user", "content": "Hello"}]
    body = {"model": "tiny", "temperature": 0, "session_id": "claude-long-prefix"}
    first = httpx.post(base + "/v1/messages", json={**body, "max_tokens": 40, "messages": messages}, timeout=TIMEOUT)
    assert first.status_code == 200, first.text
    reply = first.json()["content"][0]["text"]
    mark = {"type": "ephemeral"}
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": [{"type": "text", "text": "Paris is", "cache_control": mark}]},
    ]
    second = httpx.post(base + "/v1/messages", json={**body, "max_tokens": 2, "messages": messages}, timeout=TIMEOUT)
    assert second.status_code == 200, second.text
    usage = second.json()["usage"]
    transcript = engine.store.view(SessionKey("default", "claude-long-prefix")).transcript_ids
    num_prompt = len(transcript) - usage["output_tokens"]
    chat = [*messages[:2], {"role": "user", "content": "Paris is"}]
    marked = httpx.post(
        base + "/tokenize", json={"model": "tiny", "messages": chat, "add_generation_prompt": False}, timeout=TIMEOUT
    ).json()["count"]
    assert marked > num_prompt  # the case itself: the prefix up to the breakpoint, rendered, is the longer
    assert usage["cache_read_input_tokens"] > 0  # the first turn's K/V
    assert usage["input_tokens"] >= 0
    assert usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"] + usage["input_tokens"] == num_prompt


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
        extra_headers=session, extra_body=GREEDY,
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
        timeout=TIMEOUT,  # were the image let through, a generation would answer, not a timeout
    )
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    assert "image" in r.json()["error"]["message"]


def test_a_forced_call_cut_by_max_tokens_is_a_tool_use_block_cut_short(claude):
    """Its input is what of the arguments is whole (as the SDK reads a streamed input cut short), stop_reason is
    max_tokens (not tool_use: the call is unfinished), and no text block carries the call's markup."""
    client, engine = claude
    kwargs = {
        "model": "tiny", "tools": [TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "Weather in Paris?"}], "extra_body": GREEDY,
    }  # fmt: skip
    whole = client.messages.create(max_tokens=150, extra_headers={"X-Session-ID": "claude-cut"}, **kwargs)
    (call,) = whole.content
    ids = engine.store.view(SessionKey("default", "claude-cut")).transcript_ids[-whole.usage.output_tokens :]
    num_cut = cut_inside_arguments(engine.loaded.tokenizer, ids)
    cut = client.messages.create(max_tokens=num_cut, **kwargs)
    assert cut.stop_reason == "max_tokens"
    (block,) = cut.content
    assert (block.type, block.name) == ("tool_use", "get_weather")
    assert block.input
    assert block.input.items() < call.input.items()  # some of its members, whole ones only
    with client.messages.stream(max_tokens=num_cut, **kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", block.input)]


def test_disable_parallel_tool_use_makes_one_call(claude):
    client, _ = claude
    tools = [TOOL, {"name": "add", "input_schema": ADD["function"]["parameters"]}]
    kwargs = {"model": "tiny", "max_tokens": 300, "tools": tools, "extra_body": GREEDY}
    messages = [{"role": "user", "content": "Paris two?"}]  # greedy, the tiny model calls twice given the choice
    many = client.messages.create(messages=messages, tool_choice={"type": "any"}, **kwargs)
    assert len([b for b in many.content if b.type == "tool_use"]) > 1
    one = client.messages.create(
        messages=messages, tool_choice={"type": "any", "disable_parallel_tool_use": True}, **kwargs
    )
    assert [b.type for b in one.content] == ["tool_use"]
    assert one.stop_reason == "tool_use"


def test_tool_results_come_before_the_users_text_in_the_prompt(claude):
    """However the user message orders its blocks, its tool_result blocks are rendered first (tool messages that
    answer the calls), then its text."""
    client, engine = claude
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 1}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [call]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "And in Rome tomorrow?"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny and mild"},
            ],
        },
    ]
    client.messages.create(
        model="tiny", max_tokens=1, tools=[TOOL], messages=messages, extra_headers={"X-Session-ID": "claude-order"}
    )
    prompt = engine.loaded.tokenizer.decode(engine.store.view(SessionKey("default", "claude-order")).transcript_ids)
    assert prompt.index("<tool_response>\nsunny and mild\n</tool_response>") < prompt.index("And in Rome tomorrow?")


def test_blocks_in_the_wrong_role_and_duplicate_tool_names_are_400s(live):
    base, engine = live
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
    cases = [
        ([{"role": "user", "content": [{"type": "text", "text": "Hi"}, call]}], [TOOL], "messages.0.content.1"),
        (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [result]}],
            [TOOL],
            "messages.1.content.0",
        ),
        ([{"role": "user", "content": "Hi"}], [TOOL, TOOL], "tool names must be unique"),
    ]
    for messages, tools, said in cases:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            body = {"model": "tiny", "messages": messages, "tools": tools}
            body |= {"max_tokens": 2} if path == "/v1/messages" else {}
            r = httpx.post(base + path, json=body, headers={"X-Session-ID": "claude-refused"}, timeout=TIMEOUT)
            assert r.status_code == 400, (path, r.text)
            assert r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert said in r.json()["error"]["message"]
    assert engine.store.view(SessionKey("default", "claude-refused")) is None


def test_an_output_format_or_tool_with_no_finite_document_is_a_400_naming_it(live):
    base, engine = live
    body = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    cases = [
        ({"output_config": {"format": {"type": "json_schema", "schema": {"$ref": "#"}}}}, "'output_config.format'"),
        ({"tools": [{"name": "loop", "input_schema": {"$ref": "#"}}], "tool_choice": {"type": "any"}}, "'tools'"),
    ]
    for extra, said in cases:
        r = httpx.post(
            base + "/v1/messages", json=body | extra, headers={"X-Session-ID": "claude-loop"}, timeout=TIMEOUT
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert said in r.json()["error"]["message"]
        assert "no finite document" in r.json()["error"]["message"]
    assert engine.store.view(SessionKey("default", "claude-loop")) is None  # nothing made, nothing recorded

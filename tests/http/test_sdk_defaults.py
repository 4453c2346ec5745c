"""What each SDK's default calls send is answered, and what kvserve refuses is a 400 naming the field.

The Node SDKs' bodies were recorded once (tests/http/sdk_bodies.json, by bench/conformance/record_bodies.mjs, each
with the SDK, its version and the call that sent it); the Python SDKs are driven for real, against a live server on
the tiny model. docs/api.md's field tables say, field by field, what is honoured, accepted as a hint with no effect,
or refused; the hints and refusals below are rows of those tables.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from anthropic import beta_tool

from server.serving import tools
from server.settings import Settings
from tests.http.conftest import serve_live

MAX_TOKENS = 8  # a random model runs to max_tokens: every answer here ends after a few tokens
TIMEOUT = 300.0  # seconds, for raw httpx calls that wait on a generation (CI is slow)
RECORDED = json.loads(Path(__file__).with_name("sdk_bodies.json").read_text())["bodies"]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
ANY_ONE = {"type": "any", "disable_parallel_tool_use": True}  # one call: a random model given more makes more
GREEDY = {"temperature": 0}  # the Anthropic SDKs no longer type sampling fields; the API still takes them


@pytest.fixture(scope="module")
def served(tiny_spec):
    with serve_live([tiny_spec], Settings(default_max_tokens=MAX_TOKENS)) as (base, engine):
        yield base, engine


def sse_data(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def post(base: str, path: str, body: dict, headers: dict | None = None) -> tuple[httpx.Response, list[str]]:
    """The answer and, streamed, its `data:` payloads."""
    with httpx.stream("POST", base + path, json=body, headers=headers or {}, timeout=TIMEOUT) as r:
        r.read()
        lines = r.text.splitlines() if body.get("stream") else []
    return r, sse_data(lines)


def assert_answered(path: str, r: httpx.Response, data: list[str], is_stream: bool) -> None:
    """A whole answer in the API's own shape: its JSON object, or its stream to the end, with no error event."""
    assert r.status_code == 200, r.text
    if not is_stream:
        kind = {"/v1/messages": "message", "/v1/chat/completions": "chat.completion", "/v1/responses": "response"}
        answer = r.json()
        if path == "/v1/messages/count_tokens":
            assert answer["input_tokens"] > 0
        else:
            assert answer.get("type", answer.get("object")) == kind[path], answer
        return
    if path == "/v1/chat/completions":
        assert data[-1] == "[DONE]"
        assert not any("error" in json.loads(d) for d in data[:-1]), data
        return
    types = [json.loads(d)["type"] for d in data]
    assert "error" not in types, data
    assert "response.failed" not in types, data
    ends = {"/v1/messages": ("message_stop",), "/v1/responses": ("response.completed", "response.incomplete")}
    assert types[-1] in ends[path], types


def recorded_id(recorded: dict) -> str:
    return f"{recorded['sdk'].split(' + ')[-1].rsplit(' ', 1)[0]}: {recorded['call']}"


@pytest.mark.parametrize("recorded", RECORDED, ids=[recorded_id(r) for r in RECORDED])
def test_a_node_sdks_default_body_is_answered(served, recorded):
    """The body as the SDK sent it, with its headers; only a `max_tokens` over MAX_TOKENS is lowered to it (the Vercel
    AI SDK's Anthropic provider asks 4,096 for a model it does not know, more than the tiny model's context leaves)."""
    base, _ = served
    body = copy.deepcopy(recorded["body"])
    if body.get("max_tokens", 0) > MAX_TOKENS:
        body["max_tokens"] = MAX_TOKENS
    r, data = post(base, recorded["path"], body, recorded["headers"])
    assert_answered(recorded["path"], r, data, bool(body.get("stream")))


def test_the_recorded_ai_sdk_anthropic_stream_sets_eager_input_streaming():
    """The case the Vercel AI SDK's Anthropic provider made a 400 of: streamText with a tool sets the flag."""
    (stream,) = [r for r in RECORDED if "@ai-sdk/anthropic" in r["sdk"] and r["call"].startswith("streamText") and
                 "tools" in r["body"]]  # fmt: skip
    assert stream["body"]["stream"] is True
    assert [tool["eager_input_streaming"] for tool in stream["body"]["tools"]] == [True]


def normalized(data: list[str]) -> list[dict]:
    """Stream events with what differs between two runs of one request left out: its ids (the message's, and the
    call ids derived from it) and its usage (the later runs read the first one's prompt from the cache)."""
    events = [json.loads(text) for text in re.sub(r'"(msg|call)_[0-9A-Za-z_]+"', '"ID"', "\n".join(data)).splitlines()]
    for event in events:
        event.pop("usage", None)
        event.get("message", {}).pop("usage", None)
    return events


def test_eager_input_streaming_changes_nothing(served):
    """With the flag, without it, or false: the same events, a forced call's input as input_json_delta included."""
    base, _ = served
    (recorded,) = [r for r in RECORDED if "@ai-sdk/anthropic" in r["sdk"] and r["call"].startswith("streamText") and
                   "tools" in r["body"]]  # fmt: skip
    body = copy.deepcopy(recorded["body"]) | {"max_tokens": 60, "temperature": 0, "tool_choice": {"type": "any"}}
    streams = []
    for flag in (True, False, None, "absent"):
        tool = body["tools"][0] | {"eager_input_streaming": flag}
        if flag == "absent":
            del tool["eager_input_streaming"]
        r, data = post(base, "/v1/messages", body | {"tools": [tool]}, recorded["headers"])
        assert_answered("/v1/messages", r, data, is_stream=True)
        streams.append(normalized(data))
    assert all(events == streams[0] for events in streams)
    deltas = [e["delta"] for e in streams[0] if e["type"] == "content_block_delta"]
    assert deltas
    assert all(d["type"] == "input_json_delta" for d in deltas)
    json.loads("".join(d["partial_json"] for d in deltas))  # the call's input, whole


def test_the_python_anthropic_sdks_default_calls_are_answered(served, monkeypatch):
    """anthropic (Python): messages.create, messages.stream, count_tokens, and the beta namespace with a @beta_tool
    that sets the hints an Anthropic tool definition may carry (strict, eager input streaming, its callers), through
    a forced call and its result, echoed back as the SDK returned it, and through the SDK's tool runner (which
    threads: a call, then its result continuing the thread)."""
    monkeypatch.setattr(tools, "MAX_FORCED_STRING", 12)  # a random model never ends a string by itself
    base, _ = served
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    kwargs = {"model": "tiny", "max_tokens": MAX_TOKENS, "messages": MESSAGES}
    assert client.messages.create(**kwargs).type == "message"
    with client.messages.stream(**kwargs) as stream:
        assert stream.get_final_message().usage.output_tokens > 0
    assert client.messages.count_tokens(model="tiny", messages=MESSAGES).input_tokens > 0
    assert client.beta.messages.create(**kwargs).type == "message"

    @beta_tool(eager_input_streaming=True, strict=True, allowed_callers=["direct"], defer_loading=False)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    forced = {"model": "tiny", "max_tokens": 80, "tools": [get_weather.to_dict()], "tool_choice": ANY_ONE}
    first = client.beta.messages.create(messages=MESSAGES, extra_body=GREEDY, **forced)
    assert first.stop_reason == "tool_use"
    calls = [block for block in first.content if block.type == "tool_use"]
    results = [{"type": "tool_result", "tool_use_id": c.id, "content": get_weather(**c.input)} for c in calls]
    echoed = [*MESSAGES, {"role": "assistant", "content": first.content}, {"role": "user", "content": results}]
    assert client.beta.messages.create(messages=echoed, **forced).stop_reason in ("tool_use", "max_tokens")
    runner = client.beta.messages.tool_runner(
        messages=MESSAGES, max_iterations=2, extra_body=GREEDY, **forced | {"tools": [get_weather]}
    )
    replies = list(runner)
    assert [reply.stop_reason for reply in replies] == ["tool_use", "tool_use"]  # a call; its result, a call again


def test_the_python_openai_sdks_default_calls_are_answered(served):
    """openai (Python): chat.completions.create and its stream, responses.create and its stream."""
    base, _ = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    assert client.chat.completions.create(model="tiny", messages=MESSAGES).object == "chat.completion"
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
    assert chunks[-1].choices[0].finish_reason is not None
    assert client.responses.create(model="tiny", input=MESSAGES[0]["content"]).object == "response"
    events = [e.type for e in client.responses.create(model="tiny", input=MESSAGES[0]["content"], stream=True)]
    assert events[-1] in ("response.completed", "response.incomplete")


CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"
MESSAGES_API, COUNT = "/v1/messages", "/v1/messages/count_tokens"
TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
FUNCTION = {"type": "function", "name": "get_weather", "parameters": TOOL["input_schema"]}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
MCP = [{"type": "url", "url": "https://mcp.example", "name": "x"}]


API = {CHAT: "chat", RESPONSES: "responses", MESSAGES_API: "messages", COUNT: "count_tokens"}


def base_body(path: str) -> dict:
    if path == CHAT:
        return {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}
    if path == RESPONSES:
        return {"model": "tiny", "input": "Hi", "max_output_tokens": 1}
    body = {"model": "tiny", "messages": MESSAGES}
    return body | {"max_tokens": 0} if path == MESSAGES_API else body  # 0: the prompt computed, nothing generated


def round_trip(call: dict | None = None, result: dict | None = None) -> dict:
    """A conversation with one tool call and its result, the call's and the result's blocks given these fields."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}} | (call or {})
    answer = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"} | (result or {})
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [use]}]
    return {"messages": [*messages, {"role": "user", "content": [answer]}], "tools": [TOOL]}


def text_part(**fields) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", **fields}]}]}


CALL_ITEM = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
OUTPUT_ITEM = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
NULLS = {"caller": None, "namespace": None}  # what the SDKs type as optional on these items, sent as null

# Accepted, with no effect on the answer (docs/api.md says why for each).
HINTS = [
    (MESSAGES_API, {"tools": [TOOL | {"eager_input_streaming": True, "strict": True, "type": "custom"}]}),
    (MESSAGES_API, {"tools": [TOOL | {"allowed_callers": ["direct"], "defer_loading": False, "input_examples": []}]}),
    (MESSAGES_API, {"service_tier": "standard_only", "speed": "standard", "metadata": {"user_id": "u-1"}}),
    (MESSAGES_API, {"billing_policy": {"type": "billing_policy", "bill_to": "self"}, "fallbacks": "default"}),
    (MESSAGES_API, round_trip({"caller": {"type": "direct"}, "toolset_name": None}, {"toolset_name": None})),
    (MESSAGES_API, text_part(citations=None)),
    (COUNT, {"tools": [TOOL | {"eager_input_streaming": True}], "cache_control": {"type": "ephemeral"}}),
    (COUNT, {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}, "speed": "standard"}),
    (COUNT, {"compaction": {"type": "enabled"}}),  # Anthropic's count_tokens ignores it too
    (CHAT, {"store": False, "service_tier": "auto", "modalities": ["text"], "verbosity": "medium"}),
    (CHAT, {"safety_identifier": "u-1", "prompt_cache_retention": "24h"}),
    (CHAT, {"prompt_cache_options": {"mode": "explicit", "ttl": "30m"}, "temperature": None, "top_p": None}),
    (CHAT, text_part(prompt_cache_breakpoint={"mode": "explicit", "ttl": "12h"})),
    (CHAT, {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}),
    (RESPONSES, {"safety_identifier": "u-1", "prompt_cache_retention": "in_memory", "service_tier": "default"}),
    (RESPONSES, {"prompt_cache_options": {"mode": "implicit", "ttl": "12h"}, "parallel_tool_calls": None}),
    (RESPONSES, {"tools": [FUNCTION | {"strict": False, "defer_loading": False, "allowed_callers": ["direct"]}]}),
    (RESPONSES, {"stream": True, "stream_options": {"include_obfuscation": False}}),
    (RESPONSES, {"input": [{"role": "user", "content": "Hi", "phase": None}, CALL_ITEM | NULLS,
                           OUTPUT_ITEM | NULLS | {"name": None}], "tools": [FUNCTION]}),
    (CHAT, {"messages": [*MESSAGES, {"role": "assistant", "content": "Sunny.", "refusal": None, "audio": None,
                                     "function_call": None}, {"role": "user", "content": "Thanks"}]}),
]  # fmt: skip


@pytest.mark.parametrize(("path", "extra"), HINTS, ids=[f"{API[p]}:{','.join(extra)}" for p, extra in HINTS])
def test_an_accepted_hint_is_answered(served, path, extra):
    base, _ = served
    body = base_body(path) | extra
    r, data = post(base, path, body)
    assert_answered(path, r, data, bool(body.get("stream")))


# Refused with a 400 naming the field: (route, the body's addition, what the message names, and on the OpenAI routes
# the error's `param`; Anthropic's envelope has no param).
SERVER_CALLER = {"caller": {"type": "code_execution_20250825", "tool_id": "srvtoolu_1"}}
CHARS = {"type": "char_location", "cited_text": "x"}
REFUSED = [
    (MESSAGES_API, {"tools": [TOOL | {"defer_loading": True}]}, "tools.0.defer_loading", None),
    (MESSAGES_API, {"tools": [TOOL | {"allowed_callers": ["code_execution_20260120"]}]}, "allowed_callers", None),
    (MESSAGES_API, {"tools": [TOOL | {"input_examples": [{"city": "Paris"}]}]}, "tools.0.input_examples", None),
    (MESSAGES_API, {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305", None),
    (MESSAGES_API, {"messages": [*MESSAGES, {"role": "system", "content": "Be brief."}]}, "system messages", None),
    (MESSAGES_API, text_part(citations=[CHARS]), "messages.0.content.0.citations", None),
    (MESSAGES_API, round_trip(SERVER_CALLER), "code_execution_20250825", None),
    (MESSAGES_API, round_trip({"toolset_name": "browser"}), "messages.1.content.0.toolset_name", None),
    (MESSAGES_API, round_trip(result={"toolset_name": "browser"}), "messages.2.content.0.toolset_name", None),
    (MESSAGES_API, round_trip(result={"content": [IMAGE]}), "tool_result content blocks of type 'image'", None),
    (MESSAGES_API, {"thinking": {"type": "adaptive"}}, "thinking of type 'adaptive'", None),
    (MESSAGES_API, {"output_config": {"effort": "low"}}, "output_config.effort", None),
    (MESSAGES_API, {"output_config": {"task_budget": {"type": "tokens", "total": 20000}}}, "task_budget", None),
    (MESSAGES_API, {"speed": "fast"}, "speed 'fast'", None),
    (MESSAGES_API, {"inference_geo": "us"}, "inference_geo", None),
    (MESSAGES_API, {"container": "container_1"}, "container", None),
    (MESSAGES_API, {"diagnostics": {"previous_message_id": None}}, "diagnostics", None),
    (MESSAGES_API, {"mcp_servers": MCP}, "mcp_servers", None),
    (MESSAGES_API, {"context_management": {"edits": []}}, "context_management", None),
    (MESSAGES_API, {"compaction": {"type": "enabled"}}, "compaction", None),
    (MESSAGES_API, {"billing_policy": {"type": "billing_policy", "bill_to": "user_profile"}}, "billing_policy", None),
    (MESSAGES_API, {"fallbacks": [{"model": "claude-haiku-5-5"}]}, "fallbacks", None),
    (MESSAGES_API, {"fallback_credit_token": "tok"}, "fallback_credit_token", None),
    (MESSAGES_API, {"prompt_cache_key": "bucket"}, "prompt_cache_key", None),
    (COUNT, {"mcp_servers": MCP}, "mcp_servers", None),
    (COUNT, {"tools": [TOOL | {"defer_loading": True}]}, "tools.0.defer_loading", None),
    (CHAT, {"store": True}, "store", "store"),
    (CHAT, {"service_tier": "priority"}, "service_tier", "service_tier"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities", "modalities"),
    (CHAT, {"verbosity": "low"}, "verbosity", "verbosity"),
    (CHAT, {"moderation": {"model": "omni-moderation-latest"}}, "moderation", "moderation"),
    (CHAT, {"reasoning_effort": "low"}, "reasoning_effort", "reasoning_effort"),
    (CHAT, {"metadata": {"k": "v"}}, "metadata", "metadata"),
    (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction", "prediction"),
    (CHAT, {"web_search_options": {}}, "web_search_options", "web_search_options"),
    (CHAT, {"audio": {"format": "wav", "voice": "alloy"}}, "audio", "audio"),
    (CHAT, {"stream_options": {"include_obfuscation": True}}, "obfuscation", "stream_options.include_obfuscation"),
    (CHAT, {"prompt_cache_options": {"prewarm": True}}, "prewarm", "prompt_cache_options.prewarm"),
    (CHAT, {"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools of type 'custom'", "tools"),
    (RESPONSES, {"tools": [FUNCTION | {"defer_loading": True}]}, "defer_loading", "tools.0.defer_loading"),
    (RESPONSES, {"tools": [FUNCTION | {"output_schema": {}}]}, "output_schema", "tools.0.output_schema"),
    (RESPONSES, {"tools": [FUNCTION | {"async": True}]}, "tools.0.async", "tools.0.async"),
    (RESPONSES, {"moderation": {"model": "omni-moderation-latest"}}, "moderation", "moderation"),
    (RESPONSES, {"context_management": [{"type": "compaction"}]}, "context_management", "context_management"),
    (RESPONSES, {"background_options": {"completion_window": "2h"}}, "background_options", "background_options"),
    (RESPONSES, {"access_programs": {"cyber": "standard"}}, "access_programs", "access_programs"),
    (RESPONSES, {"image": {"context_compression": "auto"}}, "image", "image"),
    (RESPONSES, {"reasoning": {"effort": "low"}}, "reasoning", "reasoning"),
    (RESPONSES, {"stream_options": {"include_obfuscation": True}}, "stream_options", "stream_options"),
    (RESPONSES, {"prompt_cache_options": {"comparison_response_id": "resp_x"}}, "comparison_response_id",
     "prompt_cache_options.comparison_response_id"),
    (RESPONSES, {"input": [{"role": "assistant", "content": "Hi", "phase": "commentary"}]}, "phase", "input.0.phase"),
    (RESPONSES, {"input": [CALL_ITEM | {"caller": {"type": "direct"}}]}, "caller", "input.0.caller"),
    (RESPONSES, {"input": [CALL_ITEM | {"namespace": "ns"}]}, "namespace", "input.0.namespace"),
    (RESPONSES, {"input": [{"type": "reasoning", "summary": []}]}, "input items of type 'reasoning'", "input"),
    (CHAT, {"messages": [*MESSAGES, {"role": "assistant", "content": "No.", "refusal": "No."}]}, "refusal",
     "messages.1.refusal"),
    (CHAT, {"messages": [*MESSAGES, {"role": "assistant", "content": "x", "audio": {"id": "audio_1"}}]}, "audio",
     "messages.1.audio"),
    (RESPONSES, {"input": [CALL_ITEM, OUTPUT_ITEM | {"name": "get_weather"}]}, "input.1.name", "input.1.name"),
]  # fmt: skip
# Refused as values outside what the field takes here (invalid_parameter), named all the same.
INVALID = [
    (CHAT, {"messages": [*MESSAGES, {"role": "function", "name": "f", "content": "x"}]}, "messages.1.role",
     "messages.1.role"),
    (CHAT, {"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "custom", "custom": {"name": "grep", "input": "x"}}]}]}, "messages.1.tool_calls.0",
     "messages.1.tool_calls.0.type"),
    (CHAT, {"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}}, "tool_choice",
     "tool_choice"),
    (RESPONSES, {"text": {"verbosity": "low"}}, "text.verbosity", "text.verbosity"),
]  # fmt: skip


CASES = [(*row, "unsupported_parameter") for row in REFUSED] + [(*row, "invalid_parameter") for row in INVALID]


@pytest.mark.parametrize(("path", "extra", "said", "param", "code"), CASES, ids=[f"{API[c[0]]}:{c[2]}" for c in CASES])
def test_a_refused_field_is_a_400_naming_it(client, path, extra, said, param, code):
    r = client.post(path, json=base_body(path) | extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code, error
    assert said in error["message"], error
    if path.startswith(MESSAGES_API):
        assert r.json()["type"] == "error"  # Anthropic's envelope
    else:
        assert error["param"] == param, error


def test_an_item_reference_without_a_type_is_a_reference(client):
    """The SDKs type an item reference's `type` as optional: `{"id": ...}` alone names a stored item."""
    first = client.post(RESPONSES, json=base_body(RESPONSES))
    assert first.status_code == 200, first.text
    (message,) = first.json()["output"]
    counts = []
    for referred in ([{"id": message["id"]}], []):
        r = client.post(RESPONSES, json=base_body(RESPONSES) | {"input": [*referred, MESSAGES[0]]})
        assert r.status_code == 200, r.text
        counts.append(r.json()["usage"]["input_tokens"])
    assert counts[0] > counts[1]  # the reply it refers to is in the prompt

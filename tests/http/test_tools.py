"""Structured output and tools over HTTP on the tiny model: documents that validate, calls the grammar forces,
streamed as OpenAI's deltas, and a tool round trip on a session that continues token-exactly."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient

from server.anthropic.answers import tool_input
from server.app import create_app
from server.openai.schemas import ChatCompletionRequest
from server.serving import continuation
from server.serving.tools import tool_use
from server.sessions.record import SessionKey
from server.settings import Settings
from tests.http.conftest import wait_ready

CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
# A template that renders tools itself, as Hermes/Qwen-style templates do.
NATIVE_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nFunctions: ' }}{% for t in tools %}{{ t['function']['name'] + ' ' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>' + m['content'] + '</tool_response><|im_end|>\\n' }}{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ '<tool_call>' + (c['function']['arguments'] | tojson) + '</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def ask(client, **body) -> dict:
    r = client.post(CHAT, json={"model": "tiny", "temperature": 1.0, "max_tokens": 80, **body})
    assert r.status_code == 200, r.text
    return r.json()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_json_schema_output_always_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(10):
        body = ask(client, messages=user("Who?"), seed=seed, response_format=fmt)
        assert body["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), PERSON)
    # Any object: a random model's keys and strings are unbounded, so some run out of tokens (as OpenAI's do).
    objects = [ask(client, messages=user("Any"), seed=s, response_format={"type": "json_object"}) for s in range(6)]
    done = [o["choices"][0]["message"]["content"] for o in objects if o["choices"][0]["finish_reason"] == "stop"]
    assert done
    assert all(isinstance(json.loads(text), dict) for text in done)
    assert all(o["choices"][0]["message"]["content"].startswith("{") for o in objects)
    text = ask(client, messages=user("Anything"), seed=3, response_format={"type": "text"}, max_tokens=8)
    assert text["choices"][0]["message"]["content"]  # free text, as without a format


def test_completions_take_a_response_format_too(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = {
        "model": "tiny",
        "prompt": "Person:",
        "max_tokens": 80,
        "temperature": 1.0,
        "seed": 1,
        "response_format": fmt,
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), PERSON)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_are_valid_calls_of_declared_functions(client, parallel):
    for seed in range(5):
        body = ask(
            client, messages=user("Weather?"), seed=seed, tools=[WEATHER, ADD], tool_choice="required",
            parallel_tool_calls=parallel,
        )  # fmt: skip
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert calls
        assert parallel or len(calls) == 1
        for call in calls:
            tool = {"get_weather": WEATHER, "add": ADD}[call["function"]["name"]]
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
            assert call["id"].startswith("call_")
            assert call["type"] == "function"
        assert len({c["id"] for c in calls}) == len(calls)


def test_a_named_tool_choice_calls_that_function(client):
    choice = {"type": "function", "function": {"name": "add"}}
    body = ask(client, messages=user("Sum"), seed=2, tools=[WEATHER, ADD], tool_choice=choice)
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "add"


def test_streamed_tool_calls_add_up_to_the_same_calls(client):
    body = {"messages": user("Weather?"), "seed": 4, "tools": [WEATHER], "tool_choice": "required"}
    whole = ask(client, **body)["choices"][0]["message"]["tool_calls"]
    body["session_id"] = "streamed-calls"
    calls: dict[int, dict] = {}
    finish = None
    with client.stream(
        "POST", CHAT, json={"model": "tiny", "temperature": 1.0, "max_tokens": 80, "stream": True, **body}
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            finish = choice["finish_reason"] or finish
            for part in choice["delta"].get("tool_calls", []):
                call = calls.setdefault(part["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = part.get("id") or call["id"]
                call["name"] += part.get("function", {}).get("name", "")
                call["arguments"] += part.get("function", {}).get("arguments", "")
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole
    ]  # the same seed: the same calls, streamed or whole
    recorded = client.app.state.host.store.view(SessionKey("default", "streamed-calls")).messages[-1]["tool_calls"]
    assert [c["id"] for c in recorded] == [c["id"] for c in calls.values()]  # the session names them alike


def round_trip(client, sid: str, tools: list[dict], respaced: bool = False) -> tuple[dict, dict, list[int]]:
    """Turn 1 calls a tool; turn 2 sends the call back (as returned, or re-serialised) with its result. Returns
    both answers and turn 1's transcript."""
    messages = user("What is the weather in Paris?")
    first = ask(client, messages=messages, seed=5, tools=tools, tool_choice="required", session_id=sid)
    transcript = client.app.state.host.store.view(SessionKey("default", sid)).transcript_ids
    message = first["choices"][0]["message"]
    if respaced:  # as LangChain does: the arguments parsed and dumped again
        for call in message["tool_calls"]:
            call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]), indent=1)
    results = [{"role": "tool", "tool_call_id": c["id"], "content": '{"sky": "clear"}'} for c in message["tool_calls"]]
    second = ask(client, messages=[*messages, message, *results], tools=tools, session_id=sid, max_tokens=6, seed=1)
    return first, second, transcript


def assert_continued(client, sid: str, second: dict, transcript: list[int]) -> None:
    """Turn 2's prompt is turn 1's exact transcript plus the new tokens, and reused all of it."""
    session = client.app.state.host.store.view(SessionKey("default", sid))
    assert session.num_turns == 2
    assert session.transcript_ids[: len(transcript)] == transcript
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(transcript) - 1


@pytest.mark.parametrize("respaced", [False, True])
def test_a_tool_round_trip_on_a_session_continues_token_exactly(client, respaced):
    sid = f"tools-{respaced}"
    first, second, transcript = round_trip(client, sid, [WEATHER], respaced)
    assert_continued(client, sid, second, transcript)
    session = client.app.state.host.store.view(SessionKey("default", sid))
    assert session.messages[1]["tool_calls"][0]["id"] == first["choices"][0]["message"]["tool_calls"][0]["id"]
    assert session.tools == [WEATHER]


def test_other_tools_on_the_next_turn_are_a_new_prompt_not_a_continuation(client):
    _first, second, _ = round_trip(client, "tools-changed", [WEATHER])
    store = client.app.state.host.store
    before = store.view(SessionKey("default", "tools-changed"))
    # The next turn extends the session's messages exactly, but with another list of tools.
    messages = [*before.messages, *user("And in Rome?")]
    ask(client, messages=messages, tools=[WEATHER, ADD], session_id="tools-changed", max_tokens=4)
    # The generic prompt lists the tools in the system message: the new list is rendered, not the old transcript's.
    after = store.view(SessionKey("default", "tools-changed")).transcript_ids
    tokenizer = client.app.state.host.engines["tiny"].loaded.tokenizer
    assert '"add"' not in tokenizer.decode(before.transcript_ids)
    assert '"add"' in tokenizer.decode(after)
    assert second["choices"][0]["message"]["content"] is not None


def test_the_generic_prompt_lists_the_tools_and_a_native_template_renders_them_itself(tiny_spec, tiny):
    tools = tool_use(ChatCompletionRequest(model="tiny", messages=user("Hi"), tools=[WEATHER]))
    generic = continuation.render(tiny, user("Hi"), True, tools)
    for part in ("<tools>", '"get_weather"', "<tool_call>"):
        assert part in generic
    tokenizer = tiny.tokenizer.__class__.from_pretrained(tiny_spec.source)
    tokenizer.chat_template = NATIVE_TEMPLATE
    rendered = continuation.render(dataclasses.replace(tiny, tokenizer=tokenizer), user("Hi"), True, tools)
    assert rendered.startswith("<|im_start|>system\nFunctions: get_weather")
    assert "<tools>" not in rendered


def test_a_native_tool_template_round_trip_is_token_exact(tiny_spec):
    spec = dataclasses.replace(tiny_spec, id="tiny", chat_template=NATIVE_TEMPLATE)
    with TestClient(create_app(Settings(), specs=[spec])) as native:
        wait_ready(native)
        _first, second, transcript = round_trip(native, "native", [WEATHER])
        assert_continued(native, "native", second, transcript)


def cut_inside_arguments(tokenizer, reply_ids: list[int]) -> int:
    """How many of a forced call's tokens end it inside its arguments, after a member that is whole: found in the
    reply's own tokens, so the cut lands there whatever the tokenizer."""
    for k in range(1, len(reply_ids)):
        text = tokenizer.decode(reply_ids[:k])
        if '"arguments":' not in text:
            continue
        arguments = text.split('"arguments":', 1)[1]
        with contextlib.suppress(ValueError):
            json.loads(arguments)
            continue  # whole: past the cut wanted
        if tool_input(arguments):
            return k
    raise AssertionError(f"no cut inside the arguments of {tokenizer.decode(reply_ids)!r}")


def reply_ids(client, key: SessionKey, num_tokens: int) -> list[int]:
    return client.app.state.host.store.view(key).transcript_ids[-num_tokens:]


def streamed_calls(client, body: dict) -> tuple[str, list[tuple[str, str]], str | None]:
    """A chat stream's content, its calls assembled from their deltas (name, arguments), and its finish reason."""
    content, calls, finish = "", {}, None
    with client.stream("POST", CHAT, json={"model": "tiny", "temperature": 1.0, "stream": True, **body}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            finish = choice["finish_reason"] or finish
            content += choice["delta"].get("content") or ""
            for part in choice["delta"].get("tool_calls", []):
                call = calls.setdefault(part["index"], ["", ""])
                call[0] += part.get("function", {}).get("name", "")
                call[1] += part.get("function", {}).get("arguments", "")
    return content, [tuple(c) for c in calls.values()], finish


def test_a_forced_call_cut_by_max_tokens_is_a_call_cut_short_never_markup(client):
    """Cut inside its arguments: the call's name and its arguments so far, finish_reason length, no content; the
    stream says the same; the session records that answer; echoed back with a result, it continues exactly."""
    body = {"messages": user("Weather?"), "seed": 4, "tools": [WEATHER], "tool_choice": "required"}
    body["parallel_tool_calls"] = False
    whole = ask(client, **body, session_id="cut-whole")
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    tokenizer = client.app.state.host.engines["tiny"].loaded.tokenizer
    ids = reply_ids(client, SessionKey("default", "cut-whole"), whole["usage"]["completion_tokens"])
    num_cut = cut_inside_arguments(tokenizer, ids)
    cut = ask(client, **body, max_tokens=num_cut, session_id="cut")
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None  # no `<tool_call>` markup, nor anything else
    (partial,) = choice["message"]["tool_calls"]
    arguments = partial["function"]["arguments"]
    assert partial["function"]["name"] == "get_weather"
    assert call["function"]["arguments"].startswith(arguments)  # the arguments so far...
    assert arguments != call["function"]["arguments"]  # ...cut short
    content, calls, finish = streamed_calls(client, {**body, "max_tokens": num_cut})
    assert (content, calls, finish) == ("", [("get_weather", arguments)], "length")
    session = client.app.state.host.store.view(SessionKey("default", "cut"))
    assert session.messages[-1] == {"role": "assistant", "content": "", "tool_calls": [partial]}
    results = [{"role": "tool", "tool_call_id": partial["id"], "content": "cut short: ask again"}]
    echo = [*body["messages"], choice["message"], *results]
    second = ask(client, messages=echo, tools=[WEATHER], session_id="cut", max_tokens=4, seed=1)
    assert_continued(client, "cut", second, session.transcript_ids)


def test_a_forced_call_cut_before_its_name_is_whole_is_nothing(client):
    body = {"messages": user("Weather?"), "seed": 4, "tools": [WEATHER, ADD], "tool_choice": "required"}
    whole = ask(client, **body, session_id="cut-name")
    ids = reply_ids(client, SessionKey("default", "cut-name"), whole["usage"]["completion_tokens"])
    tokenizer = client.app.state.host.engines["tiny"].loaded.tokenizer
    num_cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith('"name":"'))
    choice = ask(client, **body, max_tokens=num_cut + 1)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == ""
    assert "tool_calls" not in choice["message"]
    assert streamed_calls(client, {**body, "max_tokens": num_cut + 1}) == ("", [], "length")


MANY_OPTIONAL = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
NO_FINITE_DOCUMENT = [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
]


def assert_refused(r, param: str, said: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_parameter", param)
    assert said in error["message"]
    assert len(error["message"]) < 600
    assert "p999" not in error["message"]  # the reason, never the grammar


@pytest.mark.parametrize("case", range(1 + len(NO_FINITE_DOCUMENT)))
def test_a_schema_the_grammar_cannot_hold_is_a_400_before_anything_runs(client, case):
    store, sid = client.app.state.host.store, f"refused-format-{case}"
    schema = [MANY_OPTIONAL, *NO_FINITE_DOCUMENT][case]
    fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}}
    body = {"model": "tiny", "messages": user("Hi"), "max_tokens": 8, "session_id": sid}
    said = "too many alternatives" if schema is MANY_OPTIONAL else "no finite document"
    assert_refused(client.post(CHAT, json={**body, "response_format": fmt}), "response_format", said)
    tool = {"type": "function", "function": {"name": "big", "parameters": schema}}
    r = client.post(CHAT, json={**body, "tools": [WEATHER, tool], "tool_choice": "required"})
    assert_refused(r, "tools", "function 'big'")
    assert store.view(SessionKey("default", sid)) is None  # nothing made, nothing recorded


def test_a_forced_call_to_a_tool_with_defs_resolves_its_refs(client):
    """Pydantic writes a nested model as `$defs` and a `#/$defs/...` reference: each function's arguments are a
    schema root of their own in the call grammar, so the reference resolves (a 400 'does not exist' before)."""
    parameters = {
        "$defs": {
            "Place": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
        },
        "type": "object",
        "properties": {"place": {"$ref": "#/$defs/Place"}},
        "required": ["place"],
    }
    tool = {"type": "function", "function": {"name": "visit", "parameters": parameters}}
    body = ask(client, messages=user("Where?"), seed=1, tools=[tool], tool_choice="required", parallel_tool_calls=False)
    (call,) = body["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), parameters)


CLOCK = {"type": "function", "function": {"name": "now", "description": "The time"}}  # no parameters: {} only
CLOCK_CALL = '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>'  # so each call the grammar allows is this


def test_a_forced_reply_that_repeats_a_call_ends_there(client, tiny):
    """Sampled, the tiny model sometimes writes the forced call to a function without parameters two or three times
    (each repeat identical: the grammar allows nothing else). The reply ends at the first repeat, which is not one
    of its calls, streamed or whole, and the session records what the client got."""
    num_repeats = 0
    for seed in range(8):
        body = {
            "messages": user("What time is it?"), "tools": [CLOCK], "tool_choice": "required", "seed": seed,
            "max_tokens": 300, "session_id": f"clock-{seed}",
        }  # fmt: skip
        choice = ask(client, **body)["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "now", "arguments": "{}"}]
        session = client.app.state.host.store.view(SessionKey("default", f"clock-{seed}"))
        assert session.messages[-1]["tool_calls"] == choice["message"]["tool_calls"]
        generated = tiny.tokenizer.decode(session.transcript_ids[session.turns[0].end :], skip_special_tokens=True)
        generated = generated[generated.index(CLOCK_CALL) :]  # the transcript's reply, after the prompt's end
        assert generated in (CLOCK_CALL, CLOCK_CALL + "\n" + CLOCK_CALL), (seed, generated)  # never on past a repeat
        num_repeats += generated != CLOCK_CALL
        with client.stream(
            "POST", CHAT, json={"model": "tiny", "temperature": 1.0, **body, "session_id": None, "stream": True}
        ) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        streamed = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls", [])]
        assert [p["function"]["name"] for p in streamed if "name" in p.get("function", {})] == ["now"]
    assert num_repeats, "no seed repeated the call: nothing was shown"


def test_after_a_tool_result_no_line_of_the_reply_opens_with_the_tag(client, tiny):
    """The tiny model, pushed toward `<` and line breaks, opens lines with `<` (the first token of the generic
    prompt's <tool_response>); once the conversation holds a tool result it never does, but a reply held to a
    forced call's grammar still opens with the call tag."""
    tokenizer = tiny.tokenizer
    less, newline = tokenizer.convert_tokens_to_ids("<"), tokenizer.convert_tokens_to_ids("\u010a")
    bias = {str(less): 8, str(newline): 7}
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}
    result = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]

    def openings(messages: list[dict], seed: int) -> list[str]:
        body = ask(client, messages=messages, tools=[ADD], seed=seed, max_tokens=40, logit_bias=bias)
        text = body["choices"][0]["message"]["content"] or ""
        return [line.lstrip(" \t\r")[:1] for line in text.split("\n")]

    asked = user("Add 1 and 2")
    assert sum(openings(asked, seed).count("<") for seed in range(6)) > 2  # the bias works: lines open with `<`
    assert all("<" not in openings([*asked, *result], seed) for seed in range(6))
    forced = ask(client, messages=[*asked, *result], tools=[ADD], tool_choice="required", seed=0)
    assert forced["choices"][0]["finish_reason"] == "tool_calls", forced


@pytest.mark.e2e
def test_after_a_tool_result_the_default_models_echo_of_it_never_reaches_the_client(default_model):
    """Given a tool result, SmolLM2 left alone answers greedily by copying it in the generic prompt's
    <tool_response> tags: the model imitating its prompt, not an answer. The tag may not open a line of the reply
    (and a block written mid-line is hidden): whole or streamed, and in the session's record, no block reaches the
    client, and the next turn still continues the transcript (what was generated) token-exactly."""
    base, model = default_model
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["function"]["parameters"]}}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "temp_c": 21}'},
    ]
    body = {"model": model, "temperature": 0, "max_tokens": 40, "messages": messages, "tools": [tool]}
    sid = "echoed-result"
    r = httpx.post(base + CHAT, json=body, headers={"X-Session-ID": sid}, timeout=300)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]
    assert "tool_response" not in (answer["content"] or "")
    with httpx.stream("POST", base + CHAT, json={**body, "stream": True}, timeout=300) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == (answer["content"] or "")
    record = httpx.get(f"{base}/v1/sessions/{sid}").json()
    next_turn = [*messages, answer, {"role": "user", "content": "Thanks"}]
    again = httpx.post(
        base + CHAT, json={**body, "messages": next_turn, "max_tokens": 2}, headers={"X-Session-ID": sid}, timeout=300
    )
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == record["transcript_tokens"] - 1


@pytest.mark.e2e
@pytest.mark.timeout(900)  # ten replies of up to 48 tokens on the default model, on a CPU that may be busy
def test_after_a_tool_result_the_default_model_answers_with_text_in_most_seeded_runs(default_model):
    """Step 2 of a tool loop, as the Vercel AI SDK's and the openai SDK's send it. Left alone, SmolLM2 answers most
    seeds by echoing the result in <tool_response> tags, which readers hide: an empty reply. Kept from opening a
    line with the tag, it answers in text."""
    base, model = default_model
    weather = {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Berlin"]}}},
        },
    }
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Berlin"}'}}
    messages = [
        {"role": "user", "content": "What is the weather in Berlin?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny in Berlin"},
    ]
    answers = []
    with httpx.Client(base_url=base, timeout=300) as http:
        for seed in range(10):
            body = {"model": model, "messages": messages, "tools": [weather], "temperature": 0.5, "seed": seed}
            r = http.post(CHAT, json={**body, "max_tokens": 48})
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["message"]["content"] or "")
    assert not any("tool_response" in answer for answer in answers), answers
    assert sum(bool(answer.strip()) for answer in answers) >= 6, answers

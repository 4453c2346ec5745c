"""Each API's reader: a request body and its arrival in, a Turn out (pure data), or the 400 it deserves.

No server, no model, no store: a reader is a pure function, so these run on bodies alone.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from server.anthropic.schemas import MessagesRequest
from server.engine.request import SamplingParams
from server.openai.errors import ApiError
from server.openai.responses import ResponseRequest
from server.openai.schemas import ChatCompletionRequest, CompletionRequest
from server.serving.apis import APIS, api_under, envelope_of
from server.serving.completions import CompletionAnswer, read_chat, read_completion
from server.serving.messages import MessageAnswer, WithTtl, read_message
from server.serving.pipeline import Arrival, NamedSession, OnNamed, Stateless, Turn
from server.serving.responses import ResponseAnswer, ResponseHistory, ResponsePlace, read_response
from server.serving.threads import ThreadHistory, ThreadNode
from server.serving.tools import ToolSpec, ToolUse
from server.sessions.record import SessionKey

ARRIVAL = Arrival("alice", None, "req-1", 1_700_000_000)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def chat(**body: Any) -> Turn:
    return read_chat(
        ChatCompletionRequest(**{"model": "m", "messages": [{"role": "user", "content": "Hi"}], **body}), ARRIVAL
    )


def test_a_chat_body_is_its_turn():
    turn = read_chat(
        ChatCompletionRequest(
            model="m",
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "?"}]},
            ],
            tools=[{"type": "function", "function": {"name": "weather", "parameters": WEATHER}}],
            tool_choice="required",
            temperature=0.5,
            stop="END",
            logit_bias={"7": -100},
            max_completion_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            session_id="s1",
            cache_prompt=False,
            response_format={"type": "json_object"},
        ),
        ARRIVAL,
    )
    assert turn.model == "m"
    assert (turn.tenant, turn.request_id) == ("alice", "req-1")
    assert turn.named == SessionKey("alice", "s1")
    assert turn.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather ?"}]
    assert turn.tools == ToolUse((ToolSpec("weather", None, WEATHER),), "required", None, True)
    assert turn.sampling == SamplingParams(temperature=0.5, stop=["END"], logit_bias={7: -100.0})
    assert (turn.max_tokens, turn.stream, turn.use_cache) == (12, True, False)
    assert turn.schema == {"type": "object"}
    assert (turn.history, turn.place, turn.answer) == (NamedSession(), OnNamed(), CompletionAnswer(True, True))


def test_a_reader_is_pure_the_same_body_gives_the_same_turn():
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "session_id": "s"}
    assert read_chat(ChatCompletionRequest(**body), ARRIVAL) == read_chat(ChatCompletionRequest(**body), ARRIVAL)


def test_the_session_comes_from_the_header_or_the_body_and_they_must_agree():
    with_header = Arrival("alice", "from-header", "r", 0)
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}])
    assert read_chat(body, with_header).named == SessionKey("alice", "from-header")
    with pytest.raises(ApiError) as err:
        read_chat(body.model_copy(update={"session_id": "other"}), with_header)
    assert (err.value.status, err.value.param) == (400, "session_id")
    with pytest.raises(ApiError) as err:
        read_chat(body, Arrival("alice", "no spaces allowed", "r", 0))
    assert err.value.code == "invalid_parameter"


def test_a_cache_key_is_a_bucket_and_no_name_is_no_session():
    assert chat(prompt_cache_key="shared").named == SessionKey("alice", "shared", "bucket")
    assert chat().named is None


def test_logit_bias_keys_must_be_token_ids():
    with pytest.raises(ApiError) as err:
        chat(logit_bias={"hello": 1})
    assert (err.value.status, err.value.param) == (400, "logit_bias")


def test_a_completion_is_stateless_text_or_ids():
    text = read_completion(CompletionRequest(model="m", prompt="Once", max_tokens=3, logprobs=2), ARRIVAL)
    assert (text.prompt, text.messages, text.history, text.text_param) == ("Once", None, Stateless(), "prompt")
    assert text.sampling.num_logprobs == 2
    assert text.answer == CompletionAnswer(False, False)
    ids = read_completion(CompletionRequest(model="m", prompt=[1, 2, 3]), ARRIVAL)
    assert ids.prompt == [1, 2, 3]


def test_a_messages_body_is_chat_normal_form_with_its_breakpoint_and_ttl():
    req = MessagesRequest(
        model="m",
        max_tokens=5,
        system=[{"type": "text", "text": "Sys", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "X"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
        ],
        tools=[{"name": "w", "input_schema": WEATHER}],
        stop_sequences=["STOP"],
        top_k=3,
    )
    turn = read_message(req, ARRIVAL)
    assert [m["role"] for m in turn.messages or []] == ["system", "user", "assistant", "tool"]
    assert turn.messages[2]["tool_calls"][0]["function"] == {"name": "w", "arguments": '{"city":"X"}'}
    assert turn.messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "sunny"}
    assert turn.sampling == SamplingParams(top_k=3, stop=["STOP"])
    assert turn.max_tokens == 5
    assert turn.place == WithTtl(3600.0)  # a new session it names is made with the breakpoint's ttl
    assert turn.answer == MessageAnswer(1, 3600.0)  # the breakpoint ends after the system message


def test_a_messages_breakpoint_on_a_message_counts_the_messages_before_it():
    marked = {"type": "text", "text": "Q", "cache_control": {"type": "ephemeral"}}
    req = MessagesRequest(
        model="m",
        max_tokens=5,
        messages=[
            {"role": "user", "content": [marked]},
            {"role": "assistant", "content": "A"},
            {"role": "user", "content": "Q2"},
        ],
    )
    turn = read_message(req, ARRIVAL)
    assert turn.answer == MessageAnswer(1, 300.0)
    plain = read_message(req.model_copy(update={"messages": req.messages[1:]}), ARRIVAL)
    assert (plain.answer, plain.place) == (MessageAnswer(None, None), OnNamed())


def test_a_thread_create_is_a_node_and_a_continue_reads_its_parent():
    create = read_message(
        MessagesRequest(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "Hi"}], thread={"type": "create"}
        ),
        ARRIVAL,
    )
    assert (create.history, create.place, create.named) == (NamedSession(), ThreadNode(None), None)
    body = {
        "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "More"}],
        "thread": {"type": "continue", "previous_message_id": "msg_" + "a" * 32},
        "tool_choice": {"type": "tool", "name": "w", "disable_parallel_tool_use": True},
    }  # fmt: skip
    turn = read_message(MessagesRequest(**body), ARRIVAL)
    assert turn.history == ThreadHistory("msg_" + "a" * 32, "function", "w", False)  # a turn may pick the tool
    assert turn.place == ThreadNode("msg_" + "a" * 32)
    assert turn.messages == [{"role": "user", "content": "More"}]  # only the new turn: the thread holds the rest
    assert turn.tools is None  # the thread's, read with the node


def test_a_thread_is_no_session_and_a_continue_sends_no_system_or_tools():
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(ApiError) as err:
        read_message(MessagesRequest(**body, thread={"type": "create"}), Arrival("alice", "s1", "r", 0))
    assert (err.value.status, err.value.param) == (400, "thread")
    continued = {**body, "thread": {"type": "continue", "previous_message_id": "msg_" + "a" * 32}}
    for field, value in (("system", "Be brief."), ("tools", [{"name": "w", "input_schema": WEATHER}])):
        with pytest.raises(ValidationError) as invalid:
            MessagesRequest(**continued, **{field: value})
        assert invalid.value.errors()[0]["ctx"]["name"] == field


def test_a_responses_body_is_its_items_after_its_parent():
    req = ResponseRequest(
        model="m",
        input=[{"role": "user", "content": "Hi"}, {"type": "item_reference", "id": "msg_" + "0" * 32}],
        instructions="Be kind.",
        previous_response_id="resp_" + "1" * 32,
        text={"format": {"type": "json_schema", "name": "x", "schema": WEATHER}},
        max_output_tokens=9,
    )
    turn = read_response(req, Arrival("alice", None, "resp_" + "2" * 32, 1234))
    assert isinstance(turn.history, ResponseHistory)
    assert (turn.history.parent_id, turn.history.instructions) == ("resp_" + "1" * 32, "Be kind.")
    first, reference = turn.history.items
    assert first["id"] == "in_" + "2" * 32 + "_0"
    assert reference == {"type": "item_reference", "id": "msg_" + "0" * 32}
    stored = SessionKey("alice", "resp_" + "2" * 32, "response")
    assert isinstance(turn.place, ResponsePlace)
    assert turn.place.stored == stored
    assert turn.place.record["created_at"] == 1234
    assert turn.answer == ResponseAnswer(turn.place.record, "resp_" + "1" * 32, stored, None)
    assert (turn.schema, turn.schema_param, turn.text_param, turn.max_tokens) == (WEATHER, "text.format", "input", 9)
    not_stored = read_response(req.model_copy(update={"store": False}), ARRIVAL)
    assert isinstance(not_stored.place, ResponsePlace)
    assert not_stored.place.stored is None


def test_every_table_of_apis_reads_the_specs():
    assert [api.path for api in APIS] == ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"]
    assert api_under("/v1/messages/count_tokens").name == "create_message"
    assert api_under("/v1/responses/resp_1/input_items").name == "create_response"
    assert api_under("/v1/chat/completions").name == "create_chat_completion"
    assert api_under("/v1/sessions") is None
    assert envelope_of("/v1/messages/count_tokens") == "anthropic"
    assert envelope_of("/v1/chat/completions") == envelope_of("/v1/models") == "openai"
    assert len({api.new_id() for api in APIS}) == len(APIS)

"""What agent builders call first, through the clients they use: the official `openai` SDK's parse(), tools with a
round trip and Responses function calls, and LangChain's bind_tools and with_structured_output, against a live
server on the tiny model (a random model: every field is bounded so a document ends within max_tokens), and forced
pydantic tools on the default model (e2e)."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import langchain_openai
import openai
import pytest
from pydantic import BaseModel, Field

from server.serving import tools
from server.sessions.record import SessionKey


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)


class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def sdk(live) -> tuple[openai.OpenAI, object]:
    base, engine = live
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0), engine


def test_chat_completions_parse_gives_the_model_object(sdk):
    client, _ = sdk
    for seed in range(3):
        done = client.chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": "Who?"}], response_format=Person,
            max_tokens=80, seed=seed, temperature=1.0,
        )  # fmt: skip
        assert isinstance(done.choices[0].message.parsed, Person)


def test_strict_function_tools_parse_and_round_trip_on_a_session(sdk):
    client, engine = sdk
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.parse(
        model="tiny", messages=messages, tools=[openai.pydantic_function_tool(Weather)], tool_choice="required",
        parallel_tool_calls=False, max_tokens=200, seed=5, temperature=1.0, extra_body={"session_id": "sdk-tools"},
    )  # fmt: skip
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    call = message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Weather)
    transcript = engine.store.view(SessionKey("default", "sdk-tools")).transcript_ids
    messages += [message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(
        model="tiny", messages=messages, tools=[openai.pydantic_function_tool(Weather)], max_tokens=4,
        extra_headers={"X-Session-ID": "sdk-tools"},
    )  # fmt: skip
    assert second.usage.prompt_tokens_details.cached_tokens >= len(transcript) - 1
    assert engine.store.view(SessionKey("default", "sdk-tools")).transcript_ids[: len(transcript)] == transcript


def test_responses_function_calls_and_parse(sdk):
    client, _ = sdk
    tool = {"type": "function", "name": "weather", "parameters": Weather.model_json_schema(), "strict": False}
    first = client.responses.create(
        model="tiny", input="Weather?", tools=[tool], tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=1.0, extra_body={"seed": 5},
    )  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls
    Weather.model_validate_json(calls[0].arguments)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": '{"sky": "clear"}'} for c in calls]
    second = client.responses.create(
        model="tiny", input=outputs, previous_response_id=first.id, tools=[tool], max_output_tokens=4
    )
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    parsed = client.responses.parse(
        model="tiny", input="Who?", text_format=Person, max_output_tokens=80, temperature=1.0, extra_body={"seed": 1}
    )
    assert isinstance(parsed.output_parsed, Person)


def test_langchain_bind_tools_and_with_structured_output(live):
    base, _ = live
    llm = langchain_openai.ChatOpenAI(
        base_url=base + "/v1", api_key="unused", model="tiny", temperature=1.0, max_tokens=200, seed=5, max_retries=0
    )

    def weather(city: Literal["Paris", "Rome", "Oslo"], days: int) -> str:
        """The weather in a city for some days."""
        return "sunny"

    answer = llm.bind_tools([weather], tool_choice="required", parallel_tool_calls=False).invoke("Weather in Rome?")
    assert answer.tool_calls
    assert answer.tool_calls[0]["name"] == "weather"
    # Its schema does not say additionalProperties: a forced call holds it closed, so it ends with these two keys
    assert set(answer.tool_calls[0]["args"]) == {"city", "days"}
    assert answer.response_metadata["finish_reason"] == "tool_calls"
    person = llm.with_structured_output(Person).invoke("Who?")
    assert isinstance(person, Person)
    raw = llm.with_structured_output(Person, method="json_mode", include_raw=True).invoke("Answer in JSON: who?")
    assert isinstance(json.loads(raw["raw"].content), dict) or raw["parsing_error"] is not None


class Note(BaseModel):
    """Write a note down."""

    text: str  # no maxLength: a forced call bounds it (tools.MAX_FORCED_STRING)
    urgent: bool


def test_forced_calls_hold_open_schemas_closed_and_strings_bounded(live, monkeypatch):
    """LangChain's pydantic tools say neither additionalProperties nor maxLength: on chat, Responses and Messages a
    forced call still ends, a call with the declared keys, well within max_tokens (a random model never closes a
    string by itself: the bound, shrunk here, ends it). Held open, this seed and this prompt add undeclared keys
    until max_tokens."""
    monkeypatch.setattr(tools, "MAX_FORCED_STRING", 12)
    base, _ = live
    for use_responses_api in (False, True):
        llm = langchain_openai.ChatOpenAI(
            base_url=base + "/v1", api_key="unused", model="tiny", temperature=1.0, max_tokens=300,
            extra_body={"seed": 1}, max_retries=0, use_responses_api=use_responses_api,
        )  # fmt: skip
        answer = llm.bind_tools([Note], tool_choice="required", parallel_tool_calls=False).invoke("Note it")
        (call,) = answer.tool_calls
        assert set(call["args"]) == {"text", "urgent"}
        assert len(call["args"]["text"]) <= 12
        finish = answer.response_metadata.get("finish_reason") or answer.response_metadata.get("status")
        assert finish == ("completed" if use_responses_api else "tool_calls")
        assert answer.usage_metadata["output_tokens"] < 150
    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    reply = claude.messages.create(
        model="tiny", max_tokens=300, messages=[{"role": "user", "content": "Remember milk"}],
        tools=[{"name": "note", "input_schema": Note.model_json_schema()}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0},
    )  # fmt: skip
    assert reply.stop_reason == "tool_use"
    (block,) = reply.content
    assert set(block.input) == {"text", "urgent"}
    assert len(block.input["text"]) <= 12
    assert reply.usage.output_tokens < 150


class Search(BaseModel):
    """Search the web."""

    query: str
    max_results: int = 5


@pytest.mark.e2e
def test_forced_pydantic_tools_end_in_calls_on_the_default_model(default_model):
    """SmolLM2 given an open schema filled undeclared keys (`"type"`, `"description"`, ...) until max_tokens on every
    API; held closed, it ends in calls of the declared keys, well within max_tokens."""
    base, model = default_model
    question = "Find recent news about the Mars rover."
    for use_responses_api in (False, True):
        llm = langchain_openai.ChatOpenAI(
            base_url=base + "/v1", api_key="unused", model=model, temperature=0, max_tokens=200, max_retries=0,
            use_responses_api=use_responses_api,
        )  # fmt: skip
        answer = llm.bind_tools([Search], tool_choice="required").invoke(question)
        assert answer.tool_calls
        assert not answer.invalid_tool_calls
        assert all(set(call["args"]) <= {"query", "max_results"} for call in answer.tool_calls)
        finish = answer.response_metadata.get("finish_reason") or answer.response_metadata.get("status")
        assert finish == ("completed" if use_responses_api else "tool_calls")
        assert answer.usage_metadata["output_tokens"] <= 100
    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    reply = claude.messages.create(
        model=model, max_tokens=200, messages=[{"role": "user", "content": question}],
        tools=[{"name": "search", "description": Search.__doc__, "input_schema": Search.model_json_schema()}],
        tool_choice={"type": "any"}, extra_body={"temperature": 0},
    )  # fmt: skip
    assert reply.stop_reason == "tool_use"
    assert all(b.type == "tool_use" and set(b.input) <= {"query", "max_results"} for b in reply.content)
    assert reply.usage.output_tokens <= 100

"""Reading tool calls out of replies: Hermes blocks and Llama-3 JSON, streamed in any split, or whole."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.serving.tool_reader import ToolReader, read_reply
from server.serving.tools import ToolSpec, ToolUse, chat_template, model_tool_format, tool_format

TOOLS = ToolUse((ToolSpec("get_weather", None, {"type": "object"}), ToolSpec("add", None, {"type": "object"})))
REPLY = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'
)


def streamed(text: str, size: int, tools: ToolUse = TOOLS, style: str = "hermes") -> tuple[str, list, dict]:
    reader = ToolReader(tools, style, "req")
    content, calls = "", []
    for start in range(0, len(text), size):
        sent, found = reader.feed(text[start : start + size])
        content, calls = content + sent, calls + found
    sent, found = reader.finish()
    return content + sent, calls + found, reader.message()


@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
def test_calls_are_the_same_in_any_split_and_whole(size):
    content, calls, message = streamed(REPLY, size)
    assert content == "Let me check. "  # what precedes the first call; nothing of a call leaks as content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city":"Paris"}'),
        ("add", '{"a":1,"b":2}'),
    ]
    assert message == read_reply(REPLY, TOOLS, "hermes", "req")  # streamed or whole: one answer, the same ids


def test_text_that_only_looks_like_a_call_stays_content():
    for text in (
        "a <tool_call>{not json}</tool_call> b",
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        "<tool",
    ):
        assert read_reply(text, TOOLS, "hermes", "r") == {"role": "assistant", "content": text}


def test_without_parallel_calls_only_the_first_counts():
    single = ToolUse(TOOLS.specs, parallel=False)
    message = read_reply(REPLY, single, "hermes", "r")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_a_llama3_reply_that_is_a_json_call_is_a_call():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}'
    content, calls, _ = streamed(text, 3, style="llama3_json")
    assert content == ""
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a":1,"b":2}'}
    assert read_reply("The answer is 3.", TOOLS, "llama3_json", "r")["content"] == "The answer is 3."
    two = '{"name": "add", "parameters": {"a": ";"}}; {"name": "get_weather", "parameters": {"q": "SELECT 1;"}}'
    message = read_reply(two, TOOLS, "llama3_json", "r")
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"a":";"}', '{"q":"SELECT 1;"}']


def test_tool_choice_none_reads_no_calls():
    none = ToolUse(TOOLS.specs, choice="none")
    assert read_reply(REPLY, none, "hermes", "r") == {"role": "assistant", "content": REPLY}


def test_a_template_says_whether_it_renders_tools_and_how_calls_look():
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}").native is False
    assert tool_format("{% if tools %}<tool_call>{% endif %}") == tool_format("{{ tools }} <tool_call>")
    assert tool_format("{% if tools %}<tool_call>{% endif %}").style == "hermes"
    assert tool_format('{{ tools }} "parameters" <|python_tag|>').style == "llama3_json"


def test_a_tokenizer_with_named_templates_uses_the_one_transformers_would():
    # transformers keeps a model's several templates as a dict (Hermes-2-Pro, Command-R)
    named = SimpleNamespace(chat_template={"default": "{{ messages }}", "tool_use": "{{ tools }} <tool_call>"})
    assert chat_template(named, None) == "{{ messages }}"
    assert chat_template(named, TOOLS) == "{{ tools }} <tool_call>"
    assert model_tool_format(named, TOOLS).native is True
    assert model_tool_format(named, None).native is False

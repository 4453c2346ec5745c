"""Streamed content blocks match the answer's JSON: whitespace before a call is no block of its own."""

from __future__ import annotations

import json

import jiter

from server.anthropic.answers import tool_input
from server.engine.request import Admitted, Finished, TextDelta
from server.serving.call_syntax import HERMES, LLAMA3_JSON
from server.serving.render.messages import MessageRenderer
from server.serving.tool_reader import ToolReader
from server.serving.tools import ToolSpec, ToolUse
from server.sessions.record import Usage

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}


def message_blocks(reader: ToolReader | None = None) -> MessageRenderer:
    """A Messages reply's renderer, for its content blocks' events (its reader reads no calls unless given one)."""
    reader = reader or ToolReader(None, HERMES, "msg_1")
    return MessageRenderer("msg_1", "m", reader, 0, Admitted(1, 0, "none"), None)


def kinds(events) -> list[tuple[str, str]]:
    out = []
    for sse in events:
        data = json.loads(sse.data)
        block = data.get("content_block") or data.get("delta") or {}
        out.append((data["type"], block.get("type", "")))
    return out


def test_whitespace_then_a_call_streams_only_the_call():
    blocks = message_blocks()
    events = blocks.text("\n") + blocks.calls([CALL]) + blocks.text("", last=True) + blocks.close_text()
    assert kinds(events) == [
        ("content_block_start", "tool_use"),
        ("content_block_delta", "input_json_delta"),
        ("content_block_stop", ""),
    ]


def test_text_then_a_call_streams_both_in_order():
    blocks = message_blocks()
    events = blocks.text("Let me look.") + blocks.calls([CALL]) + blocks.close_text()
    assert [k for k, _ in kinds(events)].count("content_block_start") == 2
    assert kinds(events)[0] == ("content_block_start", "text")


def test_each_block_has_its_own_index_the_text_first():
    """Anthropic's client assembles blocks by index: a call after text is block 1, the next one block 2."""
    blocks = message_blocks()
    second = {**CALL, "id": "call_2"}
    events = [json.loads(sse.data) for sse in blocks.text("Let me look.") + blocks.calls([CALL, second])]
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "text"), (1, "tool_use"), (2, "tool_use")]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    deltas = [e["index"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == [0, 1, 2]  # the text's, then each call's input


async def test_a_streamed_reply_whose_held_back_text_is_a_call_stops_for_tool_use():
    """A Llama-3 reply that is one JSON call is held back until it ends: the call comes out at the end, and the
    stop reason, told after it, is tool_use, as in the answer's JSON."""
    tools = ToolUse((ToolSpec("f", None, {"type": "object"}),))
    blocks = message_blocks(ToolReader(tools, LLAMA3_JSON, "msg_1"))
    reply, finished = '{"name": "f", "parameters": {"a": 1}}', Finished("stop", Usage(1, 3, 0))
    assert blocks.delta(TextDelta(reply, [1, 2, 3])) == []  # held back: a call, or text, is known at the end
    events = [json.loads(sse.data) for sse in await blocks.finished(finished)]
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == ["tool_use"]
    (end,) = [e for e in events if e["type"] == "message_delta"]
    assert end["delta"]["stop_reason"] == "tool_use"
    answer = await message_blocks(ToolReader(tools, LLAMA3_JSON, "msg_1")).body(finished, reply, [])
    assert answer["stop_reason"] == "tool_use"


DOCUMENT = (
    '{"city": "Paris", "days": 12, "ok": true, "none": null, "f": -1.5e3, "list": [1, "a", {"b": [false]}],'
    ' "nested": {"x": {"y": "z\\"q\\u00e9"}}, "empty": {}, "no": []}'
)


def test_a_cut_calls_input_is_what_anthropics_client_reads_of_it():
    """Every prefix of a document: the input a tool_use block cut short gets is what the `anthropic` SDK makes of
    the same text streamed (jiter's partial mode), so a streamed and a JSON answer agree."""
    for end in range(1, len(DOCUMENT) + 1):
        text = DOCUMENT[:end]
        assert tool_input(text) == jiter.from_json(text.encode(), partial_mode=True), text


def test_a_cut_call_streams_its_input_so_far():
    cut = {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": '{"a":1,"b":"unfinis'}}
    events = [json.loads(sse.data) for sse in message_blocks().calls([cut])]
    assert events[0]["content_block"] == {"type": "tool_use", "id": "call_2", "name": "f", "input": {}}
    assert json.loads(events[1]["delta"]["partial_json"]) == {"a": 1} == tool_input(cut["function"]["arguments"])

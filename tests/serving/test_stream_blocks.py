"""Streamed content blocks match the answer's JSON: whitespace before a call is no block of its own."""

from __future__ import annotations

import json

from server.serving.message_run import _BlockStream

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}


def kinds(events) -> list[tuple[str, str]]:
    out = []
    for sse in events:
        data = json.loads(sse.data)
        block = data.get("content_block") or data.get("delta") or {}
        out.append((data["type"], block.get("type", "")))
    return out


def test_whitespace_then_a_call_streams_only_the_call():
    blocks = _BlockStream()
    events = blocks.text("\n") + blocks.calls([CALL]) + blocks.text("", last=True) + blocks.close()
    assert kinds(events) == [
        ("content_block_start", "tool_use"),
        ("content_block_delta", "input_json_delta"),
        ("content_block_stop", ""),
    ]


def test_text_then_a_call_streams_both_in_order():
    blocks = _BlockStream()
    events = blocks.text("Let me look.") + blocks.calls([CALL]) + blocks.close()
    assert [k for k, _ in kinds(events)].count("content_block_start") == 2
    assert kinds(events)[0] == ("content_block_start", "text")

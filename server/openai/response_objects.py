"""The Responses API's answers: the Response object and its output items, built from a stored record."""

from __future__ import annotations

import time
from typing import Any

from server.sessions.chat import ToolCall


def usage_object(usage: list[int] | None, written: int = 0) -> dict[str, Any] | None:
    """[prompt, completion, cached] tokens as the Responses API's usage, with `written`: the prompt tokens this
    request computed and kept in the cache (cache_write_tokens)."""
    if usage is None:
        return None
    prompt, completion, cached = usage
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def message_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("resp_")


def call_item_id(response_id: str, index: int) -> str:
    return f"fc_{response_id.removeprefix('resp_')}_{index}"


def message_item(response_id: str, status: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": message_id(response_id), "type": "message", "status": status, "role": "assistant", "content": content}


def function_call_item(response_id: str, index: int, call: ToolCall, status: str) -> dict[str, Any]:
    """A tool call of the reply (chat's shape: id, function name and arguments) as a Responses output item."""
    function = call["function"]
    return {
        "id": call_item_id(response_id, index),
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
    }


def output_items(response_id: str, text: str | None, calls: list[ToolCall], status: str) -> list[dict[str, Any]]:
    """The message (when there is text, or nothing else), then one item per call."""
    items = [message_item(response_id, status, text)] if text is not None and (text or not calls) else []
    return items + [function_call_item(response_id, i, call, status) for i, call in enumerate(calls)]


def response_object(response_id: str, model: str, record: dict[str, Any], parent: str | None) -> dict[str, Any]:
    """The Response resource, from a stored response's record (request fields, status, output, usage)."""
    status, text = record.get("status", "in_progress"), record.get("output_text")
    item_status = status if status in ("completed", "incomplete") else "in_progress"
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": record.get("created_at", int(time.time())),
        "status": status,
        "model": model,
        "output": output_items(response_id, text, record.get("calls") or [], item_status),
        # Beside the usage list, so a record read by a replica that predates it still unpacks (and older ones say 0)
        "usage": usage_object(record.get("usage"), record.get("cache_write_tokens", 0)),
        "previous_response_id": parent,
        "instructions": record.get("instructions"),
        "max_output_tokens": record.get("max_output_tokens"),
        "temperature": record.get("temperature", 1.0),
        "top_p": record.get("top_p", 1.0),
        "store": record.get("store", True),
        "metadata": record.get("metadata") or {},
        "user": record.get("user"),
        "incomplete_details": incomplete,
        "error": record.get("error"),
        "parallel_tool_calls": record.get("parallel_tool_calls", True),
        "tool_choice": record.get("tool_choice") or "auto",
        "tools": record.get("tools") or [],
        "text": {"format": record.get("text_format") or {"type": "text"}},
        "truncation": "disabled",
    }

"""Responses API input items: stored with ids, references to stored items resolved, turned into chat messages.

Items kvserve stored can be referenced (`item_reference`) by any later request of the same tenant:
a response's output message `msg_<hex>`, its calls `fc_<hex>_<i>`, and its input items `in_<hex>_<i>`
(hex: the response id's). A function_call item that follows an assistant message joins it, so a
reply echoed as items (its text, then its calls) is the very message the session recorded.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from server.openai.errors import ApiError
from server.openai.response_objects import output_items
from server.openai.responses import ItemReference, ResponseRequest
from server.serving.tools import tool_call
from server.sessions.chat import ChatMessage, Role
from server.sessions.record import Session

ITEM_ID = re.compile(r"^(msg|fc|in)_([0-9a-f]{32})(?:_([0-9]+))?$")
Lookup = Callable[[str], Session | None]  # a response id -> its stored record, if any


def stored_items(response_id: str, req: ResponseRequest) -> list[dict[str, Any]]:
    """The request's input items as GET .../input_items lists them (ids given to those without)."""
    hex_id = response_id.removeprefix("resp_")
    if isinstance(req.input, str):
        content = [{"type": "input_text", "text": req.input}]
        return [{"id": f"in_{hex_id}_0", "type": "message", "role": "user", "content": content, "status": "completed"}]
    items = []
    for index, item in enumerate(req.input):
        data = item.model_dump(exclude_none=True, by_alias=True)
        data.setdefault("type", "message")
        if isinstance(item, ItemReference):
            items.append(data)
            continue
        data.setdefault("id", f"in_{hex_id}_{index}")
        if isinstance(data.get("content"), str):
            kind = "output_text" if data.get("role") == "assistant" else "input_text"
            data["content"] = [{"type": kind, "text": data["content"]}]
        items.append(data)
    return items


def resolve(items: list[dict[str, Any]], lookup: Lookup) -> list[dict[str, Any]]:
    """References replaced by the items they name; one that names nothing stored is a 400."""
    return [_find(item["id"], lookup) if item["type"] == "item_reference" else item for item in items]


def _find(item_id: str, lookup: Lookup) -> dict[str, Any]:
    match = ITEM_ID.match(item_id)
    stored = lookup("resp_" + match.group(2)) if match else None
    found = None
    if match is not None and stored is not None:
        record = stored.extras
        if match.group(1) == "in":
            found = next((i for i in record.get("input_items", []) if i.get("id") == item_id), None)
        else:
            calls = record.get("calls") or []
            out = output_items("resp_" + match.group(2), record.get("output_text"), calls, "completed")
            found = next((i for i in out if i["id"] == item_id), None)
    if found is None or found.get("type") == "item_reference":
        raise ApiError(400, "invalid_parameter", f"no stored item {item_id[:80]!r} to refer to", "input")
    item: dict[str, Any] = found
    return item


def messages_of(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """Resolved items as normalized chat messages (chat's normal form: prompts.chat_messages)."""
    messages: list[ChatMessage] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role: Role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item["content"])})
        elif kind == "function_call":
            call = tool_call(item["call_id"], item["name"], item["arguments"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:  # function_call_output
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
    return messages


def _text(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)

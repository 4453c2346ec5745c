"""Anthropic's answer shapes: the message object, its content blocks, usage, stream events, the error envelope."""

from __future__ import annotations

import json
from typing import Any

import jiter
from sse_starlette import ServerSentEvent

from server.openai.formats import JSON, exact_float
from server.sessions.chat import ToolCall

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
STOP_REASONS = {"length": "max_tokens"}
# Codes that are Anthropic's own (its message threads'): sent as `error.details.error_code` too, which its SDKs read
# to tell the cause (and a thread then replays the whole conversation, or starts a new thread).
ANTHROPIC_CODES = frozenset(
    {
        "thread_not_found",
        "thread_already_continued",
        "thread_continue_in_flight",
        "thread_fingerprint_mismatch",
        "thread_unsupported_request",
    }
)


def error_envelope(status: int, code: str, message: str) -> dict[str, Any]:
    """Anthropic's error body; kvserve's code (the OpenAI envelope's) rides along for clients that want it."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    error: dict[str, Any] = {"type": kind, "message": message[:512], "code": code}
    if code in ANTHROPIC_CODES:
        error["details"] = {"error_code": code}
    return {"type": "error", "error": error}


def usage(num_prompt: int, num_cached: int, num_created: int, num_output: int, is_hour: bool) -> dict[str, Any]:
    """Every prompt token in one of three places: read from cache, written to it (up to the last breakpoint,
    under its ttl: `is_hour` for 1h), or plain input; `num_created` already excludes what was read."""
    created = {"ephemeral_5m_input_tokens": 0 if is_hour else num_created}
    created["ephemeral_1h_input_tokens"] = num_created if is_hour else 0
    return {
        "input_tokens": num_prompt - num_cached - num_created,
        "cache_creation_input_tokens": num_created,
        "cache_read_input_tokens": num_cached,
        "cache_creation": created,
        "output_tokens": num_output,
    }


def stop_reason(finish_reason: str, stop_sequence: str | None, has_calls: bool) -> str:
    if has_calls and finish_reason == "stop":
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason, "end_turn")


def content_blocks(text: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    return blocks + [tool_use_block(call) for call in calls]


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    function = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": function["name"], "input": tool_input(function["arguments"])}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a tool_use block's `input` (an object). A call max_tokens cut short has the text so
    far: its input is what of it is whole, read as Anthropic's clients read a streamed input cut short (jiter's
    partial mode: members whose value ended; an unfinished string, literal or key left out; an unfinished object
    or array as far as it went). Numbers are read as a call's arguments are (`exact_float`: never infinity)."""
    try:
        value = JSON.decode(arguments)
    except ValueError:
        try:
            found = jiter.from_json(
                arguments.encode(), partial_mode=True, allow_inf_nan=False, float_mode="lossless-float"
            )
            value = _exact(found)
        except ValueError:
            value = None
    return value if isinstance(value, dict) else {}


def _exact(value: Any) -> Any:
    """jiter's lossless floats as `exact_float` reads them (a member it cannot hold raises ValueError)."""
    if isinstance(value, jiter.LosslessFloat):
        return exact_float(str(value))
    if isinstance(value, dict):
        return {key: _exact(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_exact(item) for item in value]
    return value


def message_object(message_id: str, model: str, content: list[dict[str, Any]], **state: Any) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": state.get("stop_reason"),
        "stop_sequence": state.get("stop_sequence"),
        "usage": state["usage"],
    }


def event(kind: str, **fields: Any) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps({"type": kind, **fields}, ensure_ascii=False), event=kind, sep="\n")

"""OpenAI response and chunk shapes for completions and chat completions (plain dicts)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from server.sessions.chat import ToolCall
from server.sessions.record import Usage

TokenText = Callable[[int], str]


class TokenLogprob(Protocol):
    """One sampled token's logprob and its best alternatives (the engine's TokenLogprob fits)."""

    @property
    def token_id(self) -> int: ...
    @property
    def logprob(self) -> float: ...
    @property
    def top(self) -> list[tuple[int, float]]: ...


@dataclass(slots=True)
class Meta:
    """What every response and chunk of one request repeats."""

    request_id: str
    created: int
    model: str
    is_chat: bool

    @property
    def object(self) -> str:
        return "chat.completion" if self.is_chat else "text_completion"

    def envelope(self, chunk: bool) -> dict[str, Any]:
        kind = self.object + (".chunk" if chunk and self.is_chat else "")
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_logprobs(items: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content: list[dict[str, Any]] = []
    for item in items:
        row = entry(item.token_id, item.logprob)
        row["top_logprobs"] = [entry(t, lp) for t, lp in item.top]
        content.append(row)
    return {"content": content}


def text_logprobs(items: Sequence[TokenLogprob], token_text: TokenText, offset: int) -> dict[str, Any]:
    tokens: list[str] = []
    offsets: list[int] = []
    for item in items:
        tokens.append(token_text(item.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": [{token_text(t): lp for t, lp in item.top} for item in items],
        "text_offset": offsets,
    }


def choice_logprobs(
    meta: Meta, items: Sequence[TokenLogprob] | None, token_text: TokenText, offset: int
) -> dict[str, Any] | None:
    if items is None:
        return None
    return chat_logprobs(items, token_text) if meta.is_chat else text_logprobs(items, token_text, offset)


def finish_reason_of(finish_reason: str, calls: list[ToolCall] | None) -> str:
    """A reply that called tools finished for that reason (OpenAI's), whatever ended its tokens."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def full_response(
    meta: Meta,
    text: str,
    finish_reason: str,
    usage: Usage,
    logprobs: dict[str, Any] | None,
    calls: list[ToolCall] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason_of(finish_reason, calls), "logprobs": logprobs}
    if meta.is_chat:
        message: dict[str, Any] = {"role": "assistant", "content": text or None if calls else text, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        choice["message"] = message
    else:
        choice["text"] = text
    return {**meta.envelope(chunk=False), "choices": [choice], "usage": usage_dict(usage)}


def delta_chunk(
    meta: Meta,
    text: str | None,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    role: bool = False,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
    if meta.is_chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {**meta.envelope(chunk=True), "choices": [choice]}


def tool_call_chunks(meta: Meta, calls: list[ToolCall], first_index: int) -> list[dict[str, Any]]:
    """OpenAI's streamed tool calls: per call, a delta naming it (id, name, empty arguments), then its arguments."""
    out: list[dict[str, Any]] = []
    for index, call in enumerate(calls, first_index):
        head = {"index": index, "id": call["id"], "type": "function"}
        head["function"] = {"name": call["function"]["name"], "arguments": ""}
        body = {"index": index, "function": {"arguments": call["function"]["arguments"]}}
        for part in (head, body):
            choice = {"index": 0, "delta": {"tool_calls": [part]}, "finish_reason": None, "logprobs": None}
            out.append({**meta.envelope(chunk=True), "choices": [choice]})
    return out


def usage_chunk(meta: Meta, usage: Usage) -> dict[str, Any]:
    return {**meta.envelope(chunk=True), "choices": [], "usage": usage_dict(usage)}

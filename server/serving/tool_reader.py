"""Reading tool calls out of a reply, as it streams or whole (the same calls, the same ids, either way)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from server.serving.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    PYTHON_TAG,
    ToolUse,
    assistant_message,
    call_id,
    call_markers,
    canonical_arguments,
    model_tool_format,
)


@dataclass(slots=True)
class ToolReader:
    """Reads calls out of a reply as it streams; `feed` returns (content to send now, calls completed now). A
    request that reads no calls (no tools, or tool_choice none) gets all of its text as content, as it comes."""

    tools: ToolUse | None
    style: str
    request_id: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    content: str = ""  # sent as content so far
    _held: str = ""  # not sent yet: a possible call's start, or the call blocks being read
    _since_first_call: str = ""  # everything from the first call's start: content after all if no call parses
    _in_calls: bool = False
    _json_reply: bool | None = None  # llama3_json: the reply starts as a JSON object (decided on its first text)

    @property
    def reads_calls(self) -> bool:
        return self.tools is not None and self.tools.reads_calls

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if not self.reads_calls:
            self.content += text
            return text, []
        if self.style == "llama3_json" and self._json_reply is None:
            opening = (self._held + text).lstrip()
            if not opening or PYTHON_TAG.startswith(opening):
                self._held += text
                return "", []  # not known yet whether the reply is a JSON call
            self._json_reply = opening.startswith(("{", PYTHON_TAG))
            text, self._held = self._held + text, ""
        if self._json_reply:
            self._held += text
            return "", []  # read whole at the end
        sent = ""
        if not self._in_calls:
            self._held += text
            start = self._held.find(CALL_OPEN)
            if start < 0:
                keep = _partial_suffix(self._held, CALL_OPEN)
                sent, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
                self.content += sent
                return sent, []
            sent, text, self._held, self._in_calls = self._held[:start], self._held[start:], "", True
            self.content += sent
        self._since_first_call += text
        self._held += text
        found: list[dict[str, Any]] = []
        while (start := self._held.find(CALL_OPEN)) >= 0 and (end := self._held.find(CALL_CLOSE, start)) >= 0:
            found += self._add(_json_object(self._held[start + len(CALL_OPEN) : end]))
            self._held = self._held[end + len(CALL_CLOSE) :]
        return sent, found

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end of the reply: what is left. A reply whose call blocks all failed to parse is content."""
        held, self._held = self._held, ""
        if self._json_reply:
            found = [call for obj in _json_objects(held.strip().removeprefix(PYTHON_TAG)) for call in self._add(obj)]
            if found:
                return "", found
        elif self.calls:
            return "", []  # after the calls (text, an unclosed block): not part of the answer
        elif self._in_calls:
            held = self._since_first_call
        self.content += held
        return held, []

    def _add(self, obj: Any) -> list[dict[str, Any]]:
        assert self.tools is not None  # only a reader that reads calls finds any
        names = {spec.name for spec in self.tools.specs}
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return []
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(arguments, dict) or (self.calls and not self.tools.parallel):
            return []
        function = {"name": obj["name"], "arguments": canonical_arguments(arguments)}
        call: dict[str, Any] = {
            "id": call_id(self.request_id, len(self.calls)),
            "type": "function",
            "function": function,
        }
        self.calls.append(call)
        return [call]

    def message(self) -> dict[str, Any]:
        """The reply as the session records it (content "" when only calls were made)."""
        return assistant_message(self.content, self.calls)

    def read_all(self, text: str) -> dict[str, Any]:
        """The whole reply at once: the assistant message, calls included (the same a stream gives)."""
        self.feed(text)
        self.finish()
        return self.message()


def read_reply(text: str, tools: ToolUse | None, style: str, request_id: str) -> dict[str, Any]:
    return ToolReader(tools, style, request_id).read_all(text)


@dataclass(slots=True, frozen=True)
class Reading:
    """How one request's reply is read: its tools (None: none), the model's call syntax, the request id its call
    ids derive from, and the call tags that are special tokens (kept in its text)."""

    tools: ToolUse | None
    style: str
    request_id: str
    markers: frozenset[int] = frozenset()

    @classmethod
    def of(cls, tokenizer: Any, tools: ToolUse | None, request_id: str) -> Reading:
        return cls(tools, model_tool_format(tokenizer, tools).style, request_id, call_markers(tokenizer, tools))

    def reader(self) -> ToolReader:
        return ToolReader(self.tools, self.style, self.request_id)

    def reply(self, text: str) -> dict[str, Any]:
        return read_reply(text, self.tools, self.style, self.request_id)


class LeadingBlank:
    """Whitespace before a reply's first visible text is held back: if calls follow, it is no content (the
    answer's rule, `content_beside_calls`); a reply that is only whitespace and makes no call keeps it."""

    def __init__(self) -> None:
        self._held = ""

    def take(self, text: str, is_open: bool, last: bool, num_calls: int) -> str:
        """What of the held whitespace and `text` to send now ("" while it is held)."""
        text, self._held = self._held + text, ""
        if text and (is_open or text.strip() or (last and not num_calls)):
            return text
        self._held = text
        return ""


def _partial_suffix(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker` (held back, not sent)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _json_objects(text: str) -> list[Any]:
    """Successive JSON values separated by `;` or whitespace (a `;` inside a string is the string's); [] when the
    text is not only that."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(text):
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            break
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return []
        found.append(value)
    return found


def _json_object(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except ValueError:
        return None

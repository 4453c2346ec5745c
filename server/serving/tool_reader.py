"""Reading tool calls out of a reply, as it streams or whole (the same calls, the same ids, either way).

Two kinds of text in a reply are never content. A call block: it becomes a call. And, where the prompt wrote tool
results inside `<tool_response>` tags (the generic prompt, templates such as Qwen's) and the conversation holds
one, a `<tool_response>` block the model writes itself: that is the model imitating its prompt's tool results
(inventing one), not an answer, so the block, its tags included, is dropped wherever it stands in the content.
A forced reply with parallel calls ends at the first call that repeats an earlier one (same function, same
arguments): that call is dropped, and the engine stops the reply there (`Reading.watch`), since a model that
repeats a call once repeats it until max_tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from server.openai.formats import JSON
from server.serving.call_syntax import CALL_CLOSE, CALL_OPEN, HERMES, PYTHON_TAG, CallSyntax
from server.serving.tools import (
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    ToolUse,
    assistant_message,
    call_id,
    call_markers,
    model_tool_format,
    tool_call,
)
from server.sessions.chat import ChatMessage, ToolCall

# A call's opening with its name whole (the name first, as the prompt and the grammar write it), and where its
# arguments begin when their key was written too.
NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"(\s*,\s*"(?:arguments|parameters)"\s*:\s*)?')
RESPONSE_BLOCK = re.compile(re.escape(RESPONSE_OPEN) + r".*?(?:" + re.escape(RESPONSE_CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(slots=True)
class ToolReader:
    """Reads calls out of a reply as it streams; `feed` returns (content to send now, calls completed now). A
    request that reads no calls (no tools, or tool_choice none) gets all of its text as content, as it comes (but
    the tool-response blocks it hides)."""

    tools: ToolUse | None
    syntax: CallSyntax
    request_id: str
    hides_responses: bool = False  # <tool_response> blocks are the prompt's imitated, never content
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""  # sent as content so far
    is_cut: bool = False  # the last call's arguments are unfinished: the reply ended inside its block
    is_repeated: bool = False  # a forced reply repeated a call: it ended there, and nothing after counts
    _held: str = ""  # not sent yet: a possible call's or tool response's start, the blocks being read
    _since_first_call: str = ""  # everything from the first call's start: content after all if no call parses
    _in_calls: bool = False
    _in_response: bool = False  # inside a <tool_response> block the model wrote: dropped
    _json_reply: bool | None = None  # the reply is a bare JSON call (the syntax decides, on its first text)

    @property
    def reads_calls(self) -> bool:
        return self.tools is not None and self.tools.reads_calls

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if not self.reads_calls:
            if not self.hides_responses:
                self.content += text
                return text, []
            sent, _ = self._content(text)
            return sent, []
        if self._json_reply is None:
            self._json_reply = self.syntax.json_reply(self._held + text)
            if self._json_reply is None:
                self._held += text
                return "", []  # not known yet whether the reply is a JSON call
            text, self._held = self._held + text, ""
        if self._json_reply:
            self._held += text
            return "", []  # read whole at the end
        sent = ""
        if not self._in_calls:
            sent, first_call = self._content(text)
            if first_call is None:
                return sent, []
            text = first_call
        self._since_first_call += text
        self._held += text
        found: list[ToolCall] = []
        while (start := self._held.find(CALL_OPEN)) >= 0 and (end := self._held.find(CALL_CLOSE, start)) >= 0:
            found += self._add(_json_object(self._held[start + len(CALL_OPEN) : end]))
            self._held = self._held[end + len(CALL_CLOSE) :]
        return sent, found

    def _content(self, text: str) -> tuple[str, str | None]:
        """Text before the first call: (content to send now, the text from the first call's start once it came).
        A tool-response block is dropped; a tail that may be the start of a tag is held until it is known."""
        self._held += text
        sent = ""
        while True:
            if self._in_response:
                end = self._held.find(RESPONSE_CLOSE)
                if end < 0:  # what the block holds so far goes; a possible start of its closing tag is kept
                    self._held = self._held[len(self._held) - _partial_suffix(self._held, RESPONSE_CLOSE) :]
                    break
                self._held, self._in_response = self._held[end + len(RESPONSE_CLOSE) :], False
            call = self._held.find(CALL_OPEN) if self.reads_calls else -1
            response = self._held.find(RESPONSE_OPEN) if self.hides_responses else -1
            if response >= 0 and (call < 0 or response < call):
                sent += self._held[:response]
                self._held, self._in_response = self._held[response + len(RESPONSE_OPEN) :], True
                continue
            if call >= 0:
                sent, rest, self._held, self._in_calls = sent + self._held[:call], self._held[call:], "", True
                self.content += sent
                return sent, rest
            tags = [CALL_OPEN] * self.reads_calls + [RESPONSE_OPEN] * self.hides_responses
            keep = max(_partial_suffix(self._held, tag) for tag in tags)
            sent, self._held = sent + self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
            break
        self.content += sent
        return sent, None

    def _shown(self, text: str) -> str:
        """`text` without the tool-response blocks this reader hides (an unclosed one runs to the end)."""
        return RESPONSE_BLOCK.sub("", text) if self.hides_responses else text

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the reply: what is left. A call block the reply ended inside (max_tokens cut it) is never
        content: a call cut short (`is_cut`) when its name is whole, its arguments the text so far; else nothing.
        A reply whose closed call blocks all failed to parse is content; a forced reply is only calls."""
        held, self._held = self._held, ""
        is_forced = self.tools is not None and self.tools.is_forced
        if self._json_reply:
            return self._finish_json(held, is_forced)
        if not self._in_calls:
            # a forced reply cut inside its first tag; a reply that ended inside a tool response
            held = "" if is_forced or self._in_response else held
            self.content += held
            return held, []
        start = held.find(CALL_OPEN)  # every block before it closed: an unfinished one from here
        found = self._add_cut(held[start + len(CALL_OPEN) :]) if start >= 0 else []
        if self.calls or is_forced:
            return "", found  # after the calls (text, a block that did not parse): not part of the answer
        before = len(self._since_first_call) - len(held) + (start if start >= 0 else len(held))
        text = self._shown(self._since_first_call[:before])
        self.content += text
        return text, []

    def _finish_json(self, held: str, is_forced: bool) -> tuple[str, list[ToolCall]]:
        """A Llama-3 JSON reply: successive call objects, the last perhaps cut short; content if it is not that."""
        values, rest = _json_values(held.lstrip().removeprefix(PYTHON_TAG))
        found = [call for obj in values for call in self._add(obj)]
        found += self._add_cut(rest) if rest else []
        if found or is_forced:
            return "", found
        held = self._shown(held)
        self.content += held
        return held, []

    def _add(self, obj: Any) -> list[ToolCall]:
        assert self.tools is not None  # only a reader that reads calls finds any
        names = {spec.name for spec in self.tools.specs}
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
            return []
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(arguments, dict) or (self.calls and not self.tools.parallel) or self.is_repeated:
            return []
        call = tool_call(call_id(self.request_id, len(self.calls)), obj["name"], arguments)
        if self.tools.is_forced and any(c["function"] == call["function"] for c in self.calls):
            self.is_repeated = True  # looping: the reply ends here (the engine stops it: Reading.watch)
            return []
        self.calls.append(call)
        return [call]

    def _add_cut(self, text: str) -> list[ToolCall]:
        """The call an unfinished block holds, if its name is whole and declared: its arguments are the text so
        far (whole ones, when only the block's end is missing, are canonical like any call's)."""
        assert self.tools is not None
        match = NAME_FIRST.match(text)
        if match is None or (self.calls and not self.tools.parallel) or self.is_repeated:
            return []
        try:
            name = json.loads(f'"{match.group(1)}"')
        except ValueError:
            return []
        if name not in {spec.name for spec in self.tools.specs}:
            return []
        rest = text[match.end() :] if match.group(2) else ""
        if rest and not rest.startswith("{"):
            return []  # arguments that are no object: no call (as for a whole block)
        try:
            arguments, _end = JSON.raw_decode(rest)
        except ValueError:
            arguments = None
        is_whole = isinstance(arguments, dict)
        # whole arguments canonical; unfinished ones do not parse, so they stay the text so far
        call = tool_call(call_id(self.request_id, len(self.calls)), name, arguments if is_whole else rest)
        self.calls.append(call)
        self.is_cut = not is_whole
        return [call]

    def message(self) -> ChatMessage:
        """The reply as the session records it (content "" when only calls were made)."""
        return assistant_message(self.content, self.calls)

    def read_all(self, text: str) -> ChatMessage:
        """The whole reply at once: the assistant message, calls included (the same a stream gives)."""
        self.feed(text)
        self.finish()
        return self.message()


def read_reply(
    text: str, tools: ToolUse | None, syntax: CallSyntax, request_id: str, hides_responses: bool = False
) -> ChatMessage:
    return ToolReader(tools, syntax, request_id, hides_responses).read_all(text)


@dataclass(slots=True, frozen=True)
class Reading:
    """How one request's reply is read: its tools (None: none), the model's call syntax, the request id its call
    ids derive from, the call tags that are special tokens (kept in its text), and whether tool-response blocks
    are hidden (the prompt wrapped a tool result in them)."""

    tools: ToolUse | None
    syntax: CallSyntax
    request_id: str
    markers: frozenset[int] = frozenset()
    hides_responses: bool = False

    @classmethod
    def of(
        cls, tokenizer: Any, tools: ToolUse | None, request_id: str, messages: Sequence[ChatMessage] = ()
    ) -> Reading:
        """`messages`: the conversation the prompt renders (whether it holds a tool result)."""
        fmt = model_tool_format(tokenizer, tools)
        hides = fmt.wraps_results and any(m["role"] == "tool" for m in messages)
        return cls(tools, fmt.syntax, request_id, call_markers(tokenizer, tools), hides)

    @classmethod
    def plain(cls, request_id: str) -> Reading:
        """A reply read as text: no tools (a completion, a session's prefilled system prompt)."""
        return cls(None, HERMES, request_id)

    def reader(self) -> ToolReader:
        return ToolReader(self.tools, self.syntax, self.request_id, self.hides_responses)

    def reply(self, text: str) -> ChatMessage:
        return read_reply(text, self.tools, self.syntax, self.request_id, self.hides_responses)

    @property
    def banned_openings(self) -> tuple[str, ...]:
        """For the engine: where this reader hides tool responses, the model may not open a line with one (the
        block would be hidden and the reply left empty; `engine/openings.py`); the reader still hides one written
        mid-line."""
        return (RESPONSE_OPEN,) if self.hides_responses else ()

    @property
    def watches_repeats(self) -> bool:
        """A forced reply that may hold several calls: the engine ends it at the first repeated one (`watch`)."""
        return self.tools is not None and self.tools.is_forced and self.tools.parallel

    def watch(self) -> Callable[[str], bool]:
        """For the engine: fed the reply's text piece by piece, True once a call repeated an earlier one (the
        reply ends there; its readers drop that call). Re-reads the reply only when a piece may close a call."""
        pieces: list[str] = []

        def is_over(piece: str) -> bool:
            pieces.append(piece)
            if ">" not in piece and "}" not in piece:  # no call block or JSON call closed in this piece
                return False
            reader = self.reader()
            reader.read_all("".join(pieces))
            return reader.is_repeated

        return is_over


def _partial_suffix(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker` (held back, not sent)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _json_values(text: str) -> tuple[list[Any], str]:
    """Successive JSON values separated by `;` or whitespace (a `;` inside a string is the string's), and the rest
    of the text from where it stopped being that ("" when all of it was)."""
    at = 0
    found: list[Any] = []
    while at < len(text):
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            break
        try:
            value, at = JSON.raw_decode(text, at)
        except ValueError:
            return found, text[at:]
        found.append(value)
    return found, ""


def _json_object(text: str) -> Any:
    try:
        return JSON.decode(text.strip())
    except ValueError:
        return None

"""How a turn's answer is shown: the base every API's renderer (this folder's modules) builds on."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from sse_starlette import ServerSentEvent

from server.engine.request import Failed, Finished, TextDelta, TokenLogprob
from server.openai.errors import failure_body
from server.serving.tool_reader import ToolReader
from server.sessions.chat import ToolCall


class Renderer(ABC):
    """One API's answer on the wire. A collected turn is `body` (or `error`); a streamed one is `opening`, then
    `delta` per text event, `finished` or `failed`, then `closing`. `close` runs last, whatever happened."""

    @abstractmethod
    async def body(self, finished: Finished, text: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        """The collected answer: `text` and `logprobs` are all the deltas'."""

    def error(self, failed: Failed) -> tuple[dict[str, Any], int]:
        """A collected turn's failure: its body and status (OpenAI's envelope unless the API has its own)."""
        return failure_body(failed.code, failed.message)

    def opening(self) -> list[ServerSentEvent]:
        return []

    @abstractmethod
    def delta(self, event: TextDelta) -> list[ServerSentEvent]:
        """The events for new text (none while a tool call or a leading blank is still being read)."""

    @abstractmethod
    async def finished(self, event: Finished) -> list[ServerSentEvent]:
        """The rest of the reply's events and its end (with usage)."""

    @abstractmethod
    def failed(self, event: Failed) -> list[ServerSentEvent]:
        """A failure after the stream opened, in the API's own error event."""

    def closing(self) -> list[ServerSentEvent]:
        return []

    def close(self) -> None:  # noqa: B027 (a hook: only an API that keeps a record of the turn has work here)
        pass


class PartsRenderer(Renderer):
    """A reply streamed as its parts, in order (Messages' content blocks, Responses' output items): the text,
    opened on its first visible text and closed before the first call, then each call. Whitespace before any
    visible text is held back: if calls follow, it is no content (the answer's rule, `content_beside_calls`); a
    reply that is only whitespace and makes no call keeps it."""

    def __init__(self, reader: ToolReader) -> None:
        self.reader = reader
        self.has_text = self.is_text_closed = False
        self.num_calls = 0
        self._blank = ""  # whitespace held back

    def delta(self, event: TextDelta) -> list[ServerSentEvent]:
        if not event.text:
            return []
        text, calls = self.reader.feed(event.text)
        return self.text(text) + self.calls(calls)

    def rest(self) -> list[ServerSentEvent]:
        """At the reply's end: what the reader still held, then the text's end."""
        text, calls = self.reader.finish()
        return self.text(text, last=True) + self.calls(calls, self.reader.is_cut) + self.close_text()

    def text(self, text: str, last: bool = False) -> list[ServerSentEvent]:
        text, self._blank = self._blank + text, ""
        if not text or not (self.has_text or text.strip() or (last and not self.num_calls)):
            self._blank = text
            return []
        return (self.open_text() if not self.has_text else []) + self._text(text)

    def open_text(self) -> list[ServerSentEvent]:
        self.has_text = True
        return self._text_opened()

    def close_text(self) -> list[ServerSentEvent]:
        if not self.has_text or self.is_text_closed:
            return []
        self.is_text_closed = True
        return self._text_closed()

    def calls(self, calls: list[ToolCall], is_cut: bool = False) -> list[ServerSentEvent]:
        """Each call's events, the text closed first; with `is_cut`, the last one's arguments are unfinished."""
        out = self.close_text() if calls else []
        for number, call in enumerate(calls, 1):
            position = self.num_calls + (1 if self.has_text else 0)  # among the parts: after the text, if any
            out += self._call(call, self.num_calls, position, is_cut and number == len(calls))
            self.num_calls += 1
        return out

    @abstractmethod
    def _text_opened(self) -> list[ServerSentEvent]: ...

    @abstractmethod
    def _text(self, text: str) -> list[ServerSentEvent]: ...

    @abstractmethod
    def _text_closed(self) -> list[ServerSentEvent]: ...

    @abstractmethod
    def _call(self, call: ToolCall, index: int, position: int, is_cut: bool) -> list[ServerSentEvent]:
        """A call's events: `index` among the calls, `position` among the parts."""

"""The Messages API on the wire: the message object, or Anthropic's stream of events."""

from __future__ import annotations

import json
from typing import Any

from sse_starlette import ServerSentEvent

from server.anthropic.answers import (
    content_blocks,
    error_envelope,
    event,
    message_object,
    stop_reason,
    tool_input,
    usage,
)
from server.engine.request import Admitted, Failed, Finished, TextDelta, TokenLogprob
from server.openai.errors import CODE_STATUS
from server.serving.pipeline import Renderer
from server.serving.tool_reader import LeadingBlank, ToolReader
from server.sessions.chat import ToolCall


class MessageRenderer(Renderer):
    """One Messages API reply: the message object, or Anthropic's events (content blocks opened as they come)."""

    def __init__(
        self, message_id: str, model: str, reader: ToolReader, num_marked: int, admitted: Admitted, ttl_s: float | None
    ) -> None:
        """`num_marked`: prompt tokens up to the last cache_control breakpoint (computed ones were cached now),
        kept for `ttl_s` (its ttl)."""
        self.message_id, self.model, self.reader = message_id, model, reader
        self.num_prompt, self.num_cached = admitted.num_prompt, admitted.num_cached
        self.num_created = max(0, num_marked - admitted.num_cached)
        self.is_hour = ttl_s is not None and ttl_s >= 3600
        self.blocks = BlockStream()

    def _usage(self, num_output: int) -> dict[str, Any]:
        return usage(self.num_prompt, self.num_cached, self.num_created, num_output, self.is_hour)

    async def body(self, finished: Finished, text: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        message = self.reader.read_all(text)
        content, calls = message["content"], message.get("tool_calls", [])
        reason = stop_reason(finished.finish_reason, finished.stop_sequence, bool(calls))
        return message_object(
            self.message_id, self.model, content_blocks(content, calls), stop_reason=reason,
            stop_sequence=finished.stop_sequence, usage=self._usage(finished.usage.completion_tokens),
        )  # fmt: skip

    def error(self, failed: Failed) -> tuple[dict[str, Any], int]:
        status = CODE_STATUS.get(failed.code, 500)
        return error_envelope(status, failed.code, failed.message), status

    def opening(self) -> list[ServerSentEvent]:
        start = message_object(self.message_id, self.model, [], usage=self._usage(0))
        return [event("message_start", message=start)]

    def delta(self, item: TextDelta) -> list[ServerSentEvent]:
        if not item.text:
            return []
        text, calls = self.reader.feed(item.text)
        return self.blocks.text(text) + self.blocks.calls(calls)

    async def finished(self, item: Finished) -> list[ServerSentEvent]:
        blocks = self.blocks
        text, calls = self.reader.finish()
        out = blocks.text(text, last=True) + blocks.calls(calls) + blocks.close()
        reason = stop_reason(item.finish_reason, item.stop_sequence, bool(blocks.num_calls))
        delta = {"stop_reason": reason, "stop_sequence": item.stop_sequence}
        out.append(event("message_delta", delta=delta, usage={"output_tokens": item.usage.completion_tokens}))
        out.append(event("message_stop"))
        return out

    def failed(self, item: Failed) -> list[ServerSentEvent]:
        status = CODE_STATUS.get(item.code, 500)
        return [event("error", error=error_envelope(status, item.code, item.message)["error"])]


class BlockStream:
    """Content blocks as events, in order: the text block (opened on its first visible text), then each call."""

    def __init__(self) -> None:
        self.index = 0  # the next block's
        self.is_open = False
        self.num_calls = 0
        self._blank = LeadingBlank()

    def text(self, text: str, last: bool = False) -> list[ServerSentEvent]:
        text = self._blank.take(text, self.is_open, last, self.num_calls)
        if not text:
            return []
        out = [] if self.is_open else self._open()
        delta = {"type": "text_delta", "text": text}
        return [*out, event("content_block_delta", index=self.index, delta=delta)]

    def _open(self) -> list[ServerSentEvent]:
        self.is_open = True
        return [event("content_block_start", index=self.index, content_block={"type": "text", "text": ""})]

    def close(self) -> list[ServerSentEvent]:
        """The text block's end (an empty reply has no block at all, as in the answer's JSON)."""
        if not self.is_open:
            return []
        out = []
        self.is_open = False
        out.append(event("content_block_stop", index=self.index))
        self.index += 1
        return out

    def calls(self, calls: list[ToolCall]) -> list[ServerSentEvent]:
        out = self.close() if calls and self.is_open else []
        for call in calls:
            function = call["function"]
            start = {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
            out.append(event("content_block_start", index=self.index, content_block=start))
            # One delta with the whole input (of a call cut short, what of it is whole: the answer's JSON agrees)
            delta = {"type": "input_json_delta", "partial_json": json.dumps(tool_input(function["arguments"]))}
            out.append(event("content_block_delta", index=self.index, delta=delta))
            out.append(event("content_block_stop", index=self.index))
            self.index, self.num_calls = self.index + 1, self.num_calls + 1
        return out

"""One Messages API reply being generated: collected into the message object, or streamed as Anthropic's events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
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
from server.engine.handle import RequestHandle
from server.engine.request import Admitted, Event, Failed, Finished, TextDelta
from server.openai.errors import CODE_STATUS, ApiError
from server.serving.core import cancel_on_disconnect
from server.serving.tool_reader import LeadingBlank, ToolReader


class MessageRun:
    def __init__(
        self,
        message_id: str,
        model: str,
        reader: ToolReader,
        num_marked: int,
        admitted: Admitted,
        ttl_s: float | None,
    ) -> None:
        """`num_marked`: prompt tokens up to the last cache_control breakpoint (computed ones were cached now),
        kept for `ttl_s` (its ttl)."""
        self.message_id, self.model, self.reader = message_id, model, reader
        self.num_prompt, self.num_cached = admitted.num_prompt, admitted.num_cached
        self.num_created = max(0, num_marked - admitted.num_cached)
        self.is_hour = ttl_s is not None and ttl_s >= 3600

    def _usage(self, num_output: int) -> dict[str, Any]:
        return usage(self.num_prompt, self.num_cached, self.num_created, num_output, self.is_hour)

    async def collect(
        self, handle: RequestHandle, events: AsyncIterator[Event], http: Request, headers: dict[str, str]
    ) -> JSONResponse:
        parts: list[str] = []
        watcher = asyncio.create_task(cancel_on_disconnect(http, handle))
        try:
            async for item in events:
                if isinstance(item, TextDelta):
                    parts.append(item.text)
                elif isinstance(item, Finished):
                    message = self.reader.read_all("".join(parts))
                    text, calls = message["content"], message.get("tool_calls", [])
                    reason = stop_reason(item.finish_reason, item.stop_sequence, bool(calls))
                    body = message_object(
                        self.message_id, self.model, content_blocks(text, calls), stop_reason=reason,
                        stop_sequence=item.stop_sequence, usage=self._usage(item.usage.completion_tokens),
                    )  # fmt: skip
                    return JSONResponse(body, headers=headers)
                elif isinstance(item, Failed):
                    status = CODE_STATUS.get(item.code, 500)
                    return JSONResponse(error_envelope(status, item.code, item.message), status, headers=headers)
        finally:
            watcher.cancel()
            handle.cancel()
        raise ApiError(500, "internal_error", "generation ended without a result")

    async def events(self, handle: RequestHandle, events: AsyncIterator[Event]) -> AsyncIterator[ServerSentEvent]:
        blocks = _BlockStream()
        try:
            start = message_object(self.message_id, self.model, [], usage=self._usage(0))
            yield event("message_start", message=start)
            async for item in events:
                if isinstance(item, TextDelta) and item.text:
                    text, calls = self.reader.feed(item.text)
                    for sse in blocks.text(text) + blocks.calls(calls):
                        yield sse
                elif isinstance(item, Finished):
                    text, calls = self.reader.finish()
                    for sse in blocks.text(text, last=True) + blocks.calls(calls) + blocks.close():
                        yield sse
                    reason = stop_reason(item.finish_reason, item.stop_sequence, bool(blocks.num_calls))
                    delta = {"stop_reason": reason, "stop_sequence": item.stop_sequence}
                    yield event("message_delta", delta=delta, usage={"output_tokens": item.usage.completion_tokens})
                    yield event("message_stop")
                elif isinstance(item, Failed):
                    status = CODE_STATUS.get(item.code, 500)
                    yield event("error", error=error_envelope(status, item.code, item.message)["error"])
        finally:
            handle.cancel()


class _BlockStream:
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

    def calls(self, calls: list[dict[str, Any]]) -> list[ServerSentEvent]:
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

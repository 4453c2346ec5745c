"""A completion's answer: one JSON body, or an SSE stream of chunks; a chat reply's tool calls read out of it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import ServerSentEvent

from server.engine.handle import RequestHandle
from server.engine.request import Event, Failed, Finished, TextDelta, TokenLogprob
from server.openai import chunks
from server.openai.errors import CODE_STATUS, ApiError, error_body
from server.serving.core import cancel_on_disconnect
from server.serving.tool_reader import ToolReader


def failure(event: Failed) -> dict[str, Any]:
    return error_body(CODE_STATUS.get(event.code, 500), event.code, event.message)


@dataclass(slots=True)
class Answer:
    """One request's answer in the making: its events, how its chunks look, and its tool calls (if it reads them)."""

    handle: RequestHandle
    events: AsyncIterator[Event]
    meta: chunks.Meta
    token_text: Callable[[int], str]
    reader: ToolReader

    async def collect(self, http: Request, headers: dict[str, str]) -> JSONResponse:
        watcher = asyncio.create_task(cancel_on_disconnect(http, self.handle))
        parts: list[str] = []
        logprobs: list[TokenLogprob] = []
        try:
            async for event in self.events:
                if isinstance(event, TextDelta):
                    parts.append(event.text)
                    logprobs.extend(event.logprobs or [])
                elif isinstance(event, Finished):
                    lp = chunks.choice_logprobs(self.meta, logprobs if logprobs else None, self.token_text, 0)
                    message = self.reader.read_all("".join(parts))  # the content as the session records it
                    text, calls = message["content"], message.get("tool_calls")
                    body = chunks.full_response(self.meta, text, event.finish_reason, event.usage, lp, calls)
                    return JSONResponse(body, headers=headers)
                elif isinstance(event, Failed):
                    return JSONResponse(failure(event), CODE_STATUS.get(event.code, 500), headers=headers)
        finally:
            watcher.cancel()
            self.handle.cancel()
        raise ApiError(500, "internal_error", "generation ended without a result")

    async def stream(self, include_usage: bool) -> AsyncIterator[ServerSentEvent]:
        meta, offset = self.meta, 0
        try:
            if meta.is_chat:
                yield _data(chunks.delta_chunk(meta, "", role=True))
            async for event in self.events:
                if isinstance(event, TextDelta):
                    text, calls = self.reader.feed(event.text)
                    lp = chunks.choice_logprobs(meta, event.logprobs, self.token_text, offset)
                    offset += len(text)
                    if text or lp is not None:
                        yield _data(chunks.delta_chunk(meta, text, logprobs=lp))
                    for chunk in self._calls(calls):
                        yield _data(chunk)
                elif isinstance(event, Finished):
                    text, calls = self.reader.finish()
                    if text:
                        yield _data(chunks.delta_chunk(meta, text))
                    for chunk in self._calls(calls):
                        yield _data(chunk)
                    finish = chunks.finish_reason_of(event.finish_reason, self.reader.calls)
                    yield _data(chunks.delta_chunk(meta, None if meta.is_chat else "", finish))
                    if include_usage:
                        yield _data(chunks.usage_chunk(meta, event.usage))
                elif isinstance(event, Failed):
                    yield _data(failure(event))
            yield ServerSentEvent(data="[DONE]", sep="\n")
        finally:
            self.handle.cancel()  # a client that went away stops its generation at the next step

    def _calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not calls:
            return []
        return chunks.tool_call_chunks(self.meta, calls, len(self.reader.calls) - len(calls))


def _data(obj: dict[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(obj, separators=(",", ":"), ensure_ascii=False), sep="\n")

"""One response being generated: collected into the Response object, or streamed as Responses API events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import ServerSentEvent

from server.engine.handle import RequestHandle
from server.engine.request import Event, Failed, Finished, TextDelta
from server.openai.errors import CODE_STATUS, ApiError
from server.openai.response_objects import call_item_id, function_call_item, message_id, message_item, response_object
from server.serving.answers import failure
from server.serving.core import Serving, cancel_on_disconnect
from server.serving.tool_reader import LeadingBlank, ToolReader
from server.sessions.record import SessionKey, Turn, Usage

KIND = "response"
EMPTY_PART = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, "response_not_found", f"no stored response {response_id!r}", param)


def result(finish_reason: str, text: str, usage: Usage, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A finished response's part of its record."""
    return {
        "status": "completed" if finish_reason == "stop" else "incomplete",
        "output_text": text,
        "calls": calls,
        "finish_reason": finish_reason,
        "usage": [usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens],
        "cache_write_tokens": usage.cache_write_tokens,
    }


class ResponseRun:
    def __init__(
        self,
        response_id: str,
        model: str,
        record: dict[str, Any],
        parent: str | None,
        serving: Serving,
        reader: ToolReader,
        stored: SessionKey | None,
        session: SessionKey | None,
        retention_s: float,
    ) -> None:
        """`stored`: the response's record (None: store=false). Without a `session`, the engine records the turn
        in it; with one, the turn runs on that session and the record is written from its state afterwards."""
        self.response_id, self.model, self.record, self.parent = response_id, model, record, parent
        self.store, self.off_loop = serving.store, serving.off_loop  # the store may wait on Redis: off the loop
        self.reader, self.stored, self.session = reader, stored, session
        self.retention_s = retention_s
        self.sequence_number = 0
        self.is_finished = False

    def _object(self, **state: Any) -> dict[str, Any]:
        return response_object(self.response_id, self.model, {**self.record, **state}, self.parent)

    async def _finished(self, event: Finished) -> dict[str, Any]:
        """The reply its reader read (all of it, by now), recorded and as the final Response object."""
        message = self.reader.message()
        done = result(event.finish_reason, message["content"], event.usage, message.get("tool_calls", []))
        await self.off_loop(self._store_copy, done)
        self.is_finished = True
        return self._object(**done)

    def _store_copy(self, done: dict[str, Any]) -> None:
        """A turn run on a named session: the stored response is that session's state after it."""
        if self.session is None or self.session.is_bucket or self.stored is None:
            return
        view = self.store.view(self.session)
        if view is None:
            return
        fields = {"transcript_ids": list(view.transcript_ids), "messages": [dict(m) for m in view.messages]}
        fields |= {"tools": view.tools, "turns": [Turn(0, 0), Turn(len(view.transcript_ids), len(view.messages))]}
        extras = {**self.record, **done}
        self.store.create(self.stored, self.model, self.retention_s, parent=self.parent, extras=extras, **fields)

    def _forget_unfinished(self) -> None:
        if self.stored is not None and self.session is None and not self.is_finished:
            self.store.delete(self.stored)  # nothing to continue from: a failed or abandoned response is not kept

    async def collect(
        self, handle: RequestHandle, events: AsyncIterator[Event], http: Request, headers: dict[str, str]
    ) -> JSONResponse:
        parts = []
        watcher = asyncio.create_task(cancel_on_disconnect(http, handle))
        try:
            async for event in events:
                if isinstance(event, TextDelta):
                    parts.append(event.text)
                elif isinstance(event, Finished):
                    self.reader.read_all("".join(parts))
                    return JSONResponse(await self._finished(event), headers=headers)
                elif isinstance(event, Failed):
                    return JSONResponse(failure(event), CODE_STATUS.get(event.code, 500), headers=headers)
        finally:
            watcher.cancel()
            handle.cancel()
            self._forget_unfinished()
        raise ApiError(500, "internal_error", "generation ended without a result")

    def _event(self, kind: str, **fields: Any) -> ServerSentEvent:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return ServerSentEvent(data=json.dumps(data, ensure_ascii=False), event=kind, sep="\n")

    async def events(self, handle: RequestHandle, events: AsyncIterator[Event]) -> AsyncIterator[ServerSentEvent]:
        stream = _ItemStream(self)
        try:
            yield self._event("response.created", response=self._object())
            yield self._event("response.in_progress", response=self._object())
            if not self.reader.reads_calls:
                for sse in stream.open_message():
                    yield sse
            async for event in events:
                if isinstance(event, TextDelta) and event.text:
                    text, calls = self.reader.feed(event.text)
                    for sse in stream.text(text) + stream.calls(calls):
                        yield sse
                elif isinstance(event, Finished):
                    text, calls = self.reader.finish()
                    done = stream.text(text, last=True) + stream.calls(calls, self.reader.is_cut) + stream.close()
                    for sse in done:
                        yield sse
                    final = await self._finished(event)
                    yield self._event(f"response.{final['status']}", response=final)
                elif isinstance(event, Failed):
                    error = {"code": event.code, "message": event.message}
                    yield self._event("response.failed", response=self._object(status="failed", error=error))
        finally:
            handle.cancel()
            self._forget_unfinished()


class _ItemStream:
    """The output items' events, in output order: the message (opened on its first visible text, closed before
    the first call), then each call."""

    def __init__(self, run: ResponseRun) -> None:
        self.run = run
        self.sent = ""  # the message's text so far
        self.is_open = self.is_closed = False
        self.num_calls = 0
        self._blank = LeadingBlank()  # no message item for whitespace before any visible text yet

    def _where(self) -> dict[str, Any]:
        return {"item_id": message_id(self.run.response_id), "output_index": 0, "content_index": 0}

    def open_message(self) -> list[ServerSentEvent]:
        self.is_open = True
        item = message_item(self.run.response_id, "in_progress", None)
        added = self.run._event("response.output_item.added", output_index=0, item=item)
        return [added, self.run._event("response.content_part.added", **self._where(), part=EMPTY_PART)]

    def text(self, text: str, last: bool = False) -> list[ServerSentEvent]:
        text = self._blank.take(text, self.is_open, last, self.num_calls)
        if not text:
            return []
        out = [] if self.is_open else self.open_message()
        self.sent += text
        return [*out, self.run._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])]

    def close(self) -> list[ServerSentEvent]:
        """The message's closing events (an empty message when the reply has neither text nor calls)."""
        out = self.open_message() if not self.is_open and not self.num_calls else []
        if not self.is_open or self.is_closed:
            return out
        self.is_closed = True
        where, text = self._where(), self.sent
        out.append(self.run._event("response.output_text.done", **where, text=text, logprobs=[]))
        out.append(self.run._event("response.content_part.done", **where, part={**EMPTY_PART, "text": text}))
        item = message_item(self.run.response_id, "completed", text)
        out.append(self.run._event("response.output_item.done", output_index=0, item=item))
        return out

    def calls(self, calls: list[dict[str, Any]], is_cut: bool = False) -> list[ServerSentEvent]:
        """Each call's events; with `is_cut`, the last one's arguments are unfinished (its item is incomplete)."""
        out = self.close() if calls and self.is_open else []
        run = self.run
        for number, call in enumerate(calls, 1):
            status = "incomplete" if is_cut and number == len(calls) else "completed"
            index, self.num_calls = self.num_calls, self.num_calls + 1
            position = index + (1 if self.is_open else 0)
            where = {"item_id": call_item_id(run.response_id, index), "output_index": position}
            arguments = call["function"]["arguments"]
            added = {**function_call_item(run.response_id, index, call, "in_progress"), "arguments": ""}
            out.append(run._event("response.output_item.added", output_index=position, item=added))
            out.append(run._event("response.function_call_arguments.delta", **where, delta=arguments))
            out.append(run._event("response.function_call_arguments.done", **where, arguments=arguments))
            done = function_call_item(run.response_id, index, call, status)
            out.append(run._event("response.output_item.done", output_index=position, item=done))
        return out

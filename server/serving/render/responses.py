"""The Responses API on the wire: the Response object, or its stream of events; a stored response's record."""

from __future__ import annotations

import json
from typing import Any

from sse_starlette import ServerSentEvent

from server.engine.request import Failed, Finished, TextDelta, TokenLogprob
from server.openai.errors import ApiError
from server.openai.response_objects import call_item_id, function_call_item, message_id, message_item, response_object
from server.serving.core import Serving
from server.serving.pipeline import Renderer
from server.serving.tool_reader import LeadingBlank, ToolReader
from server.sessions.chat import ToolCall
from server.sessions.record import SessionKey, Turn, Usage

KIND = "response"
EMPTY_PART = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, "response_not_found", f"no stored response {response_id!r}", param)


def result(finish_reason: str, text: str, usage: Usage, calls: list[ToolCall]) -> dict[str, Any]:
    """A finished response's part of its record."""
    return {
        "status": "completed" if finish_reason == "stop" else "incomplete",
        "output_text": text,
        "calls": calls,
        "finish_reason": finish_reason,
        "usage": [usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens],
        "cache_write_tokens": usage.cache_write_tokens,
    }


class ResponseRenderer(Renderer):
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
        self.items = ItemStream(self)

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

    async def body(self, finished: Finished, text: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        self.reader.read_all(text)
        return await self._finished(finished)

    def event(self, kind: str, **fields: Any) -> ServerSentEvent:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return ServerSentEvent(data=json.dumps(data, ensure_ascii=False), event=kind, sep="\n")

    def opening(self) -> list[ServerSentEvent]:
        out = [self.event("response.created", response=self._object())]
        out.append(self.event("response.in_progress", response=self._object()))
        return out if self.reader.reads_calls else out + self.items.open_message()

    def delta(self, event: TextDelta) -> list[ServerSentEvent]:
        if not event.text:
            return []
        text, calls = self.reader.feed(event.text)
        return self.items.text(text) + self.items.calls(calls)

    async def finished(self, event: Finished) -> list[ServerSentEvent]:
        items = self.items
        text, calls = self.reader.finish()
        out = items.text(text, last=True) + items.calls(calls, self.reader.is_cut) + items.close()
        final = await self._finished(event)
        return [*out, self.event(f"response.{final['status']}", response=final)]

    def failed(self, event: Failed) -> list[ServerSentEvent]:
        error = {"code": event.code, "message": event.message}
        return [self.event("response.failed", response=self._object(status="failed", error=error))]

    def close(self) -> None:
        if self.stored is not None and self.session is None and not self.is_finished:
            self.store.delete(self.stored)  # nothing to continue from: a failed or abandoned response is not kept


class ItemStream:
    """The output items' events, in output order: the message (opened on its first visible text, closed before
    the first call), then each call."""

    def __init__(self, run: ResponseRenderer) -> None:
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
        added = self.run.event("response.output_item.added", output_index=0, item=item)
        return [added, self.run.event("response.content_part.added", **self._where(), part=EMPTY_PART)]

    def text(self, text: str, last: bool = False) -> list[ServerSentEvent]:
        text = self._blank.take(text, self.is_open, last, self.num_calls)
        if not text:
            return []
        out = [] if self.is_open else self.open_message()
        self.sent += text
        return [*out, self.run.event("response.output_text.delta", **self._where(), delta=text, logprobs=[])]

    def close(self) -> list[ServerSentEvent]:
        """The message's closing events (an empty message when the reply has neither text nor calls)."""
        out = self.open_message() if not self.is_open and not self.num_calls else []
        if not self.is_open or self.is_closed:
            return out
        self.is_closed = True
        where, text = self._where(), self.sent
        out.append(self.run.event("response.output_text.done", **where, text=text, logprobs=[]))
        out.append(self.run.event("response.content_part.done", **where, part={**EMPTY_PART, "text": text}))
        item = message_item(self.run.response_id, "completed", text)
        out.append(self.run.event("response.output_item.done", output_index=0, item=item))
        return out

    def calls(self, calls: list[ToolCall], is_cut: bool = False) -> list[ServerSentEvent]:
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
            out.append(run.event("response.output_item.added", output_index=position, item=added))
            out.append(run.event("response.function_call_arguments.delta", **where, delta=arguments))
            out.append(run.event("response.function_call_arguments.done", **where, arguments=arguments))
            done = function_call_item(run.response_id, index, call, status)
            out.append(run.event("response.output_item.done", output_index=position, item=done))
        return out

"""The Responses API on the wire: the Response object, or its stream of events; a stored response's record."""

from __future__ import annotations

import json
from typing import Any

from sse_starlette import ServerSentEvent

from server.engine.request import Failed, Finished, TokenLogprob
from server.openai.errors import ApiError
from server.openai.response_objects import call_item_id, function_call_item, message_id, message_item, response_object
from server.serving.core import Serving
from server.serving.render.base import PartsRenderer
from server.serving.tool_reader import ToolReader
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


class ResponseRenderer(PartsRenderer):
    """One response: the Response object, or its events (its message item at output 0, then each call's); its record."""

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
    ) -> None:
        """`stored`: the response's record (None: store=false). Without a `session`, the engine records the turn
        in it; with one, the turn runs on that session and the record is written from its state afterwards."""
        super().__init__(reader)
        self.response_id, self.model, self.record, self.parent = response_id, model, record, parent
        self.store, self.off_loop = serving.store, serving.off_loop  # the store may wait on Redis: off the loop
        self.stored, self.session = stored, session
        self.retention_s = serving.settings.response_retention_s
        self.sequence_number = 0
        self.sent = ""  # the message's text so far

    def _object(self, **state: Any) -> dict[str, Any]:
        return response_object(self.response_id, self.model, {**self.record, **state}, self.parent)

    async def _finished(self, event: Finished) -> dict[str, Any]:
        """The reply its reader read (all of it, by now), recorded and as the final Response object."""
        message = self.reader.message()
        done = result(event.finish_reason, message["content"], event.usage, message.get("tool_calls", []))
        await self.off_loop(self._store_copy, done)
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
        return out if self.reader.reads_calls else out + self.open_text()

    async def finished(self, event: Finished) -> list[ServerSentEvent]:
        out = self.rest()
        if not self.has_text and not self.num_calls:  # a reply with neither text nor calls: an empty message
            out += self.open_text() + self.close_text()
        final = await self._finished(event)
        return [*out, self.event(f"response.{final['status']}", response=final)]

    def failed(self, event: Failed) -> list[ServerSentEvent]:
        error = {"code": event.code, "message": event.message}
        return [self.event("response.failed", response=self._object(status="failed", error=error))]

    def _where(self) -> dict[str, Any]:
        return {"item_id": message_id(self.response_id), "output_index": 0, "content_index": 0}

    def _text_opened(self) -> list[ServerSentEvent]:
        item = message_item(self.response_id, "in_progress", None)
        added = self.event("response.output_item.added", output_index=0, item=item)
        return [added, self.event("response.content_part.added", **self._where(), part=EMPTY_PART)]

    def _text(self, text: str) -> list[ServerSentEvent]:
        self.sent += text
        return [self.event("response.output_text.delta", **self._where(), delta=text, logprobs=[])]

    def _text_closed(self) -> list[ServerSentEvent]:
        where, text = self._where(), self.sent
        out = [self.event("response.output_text.done", **where, text=text, logprobs=[])]
        out.append(self.event("response.content_part.done", **where, part={**EMPTY_PART, "text": text}))
        item = message_item(self.response_id, "completed", text)
        out.append(self.event("response.output_item.done", output_index=0, item=item))
        return out

    def _call(self, call: ToolCall, index: int, position: int, is_cut: bool) -> list[ServerSentEvent]:
        """A cut call's item is incomplete."""
        where = {"item_id": call_item_id(self.response_id, index), "output_index": position}
        arguments = call["function"]["arguments"]
        added = {**function_call_item(self.response_id, index, call, "in_progress"), "arguments": ""}
        out = [self.event("response.output_item.added", output_index=position, item=added)]
        out.append(self.event("response.function_call_arguments.delta", **where, delta=arguments))
        out.append(self.event("response.function_call_arguments.done", **where, arguments=arguments))
        done = function_call_item(self.response_id, index, call, "incomplete" if is_cut else "completed")
        out.append(self.event("response.output_item.done", output_index=position, item=done))
        return out

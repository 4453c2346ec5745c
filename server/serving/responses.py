"""POST/GET/DELETE /v1/responses: the OpenAI Responses API on top of sessions.

A stored response is a record of kind `response` in the session store: its transcript holds
input + output tokens, its messages what it rendered, and its extras (the format is this
module's) the request fields and the result. `previous_response_id` continues from that node:
the prompt is the parent's transcript plus the new input's tokens (token-exact), its K/V
found in the pool by prefix or restored from the parent's snapshot. A retried request with
the same parent branches from the same node again; the parent never changes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import ServerSentEvent

from server.engine.handle import RequestHandle
from server.engine.request import Event, Failed, Finished, SamplingParams, TextDelta
from server.openai.errors import CODE_STATUS, ApiError
from server.openai.responses import ResponseRequest, message_item, response_object
from server.serving import continuation
from server.serving.answers import failure
from server.serving.completions import event_stream
from server.serving.core import Serving, cache_headers, cancel_on_disconnect
from server.serving.prompts import check_text_size, output_budget
from server.sessions.record import CompletedTurn, Session, SessionKey, Usage
from server.sessions.store import SessionStore

KIND = "response"


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, "response_not_found", f"no stored response {response_id!r}", param)


def result(finish_reason: str, text: str, usage: Usage) -> dict[str, Any]:
    """A finished response's part of its record."""
    return {
        "status": "completed" if finish_reason == "stop" else "incomplete",
        "output_text": text,
        "finish_reason": finish_reason,
        "usage": [usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens],
    }


def request_fields(req: ResponseRequest) -> dict[str, Any]:
    """A new response's record: what the Response object repeats of its request, and its status."""
    return {
        "created_at": int(time.time()),
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "metadata": req.metadata or {},
        "user": req.user,
        "store": req.store,
        "status": "in_progress",
    }


def record_turn(extras: dict[str, Any], turn: CompletedTurn) -> None:
    """The store's hook for responses: the result is journaled with the transcript, before the final event."""
    extras.update(result(turn.finish_reason, turn.text, turn.usage))


def drop_unfinished(store: SessionStore) -> None:
    """At start: responses a previous run never finished have nothing to continue from."""
    for key in store.session_keys(KIND):
        view = store.view(key)
        if view is not None and view.extras.get("status") == "in_progress":
            store.delete(key)


class Responses:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.store = serving.store
        self.settings = serving.settings
        self.store.on_turn(KIND, record_turn)
        drop_unfinished(self.store)

    async def _parent(self, req: ResponseRequest, tenant: str, model_id: str) -> Session | None:
        if req.previous_response_id is None:
            return None
        parent = await self.serving.off_loop(self.store.view, SessionKey(tenant, req.previous_response_id, KIND))
        if parent is None or parent.extras.get("status") not in ("completed", "incomplete"):
            raise not_found(req.previous_response_id, "previous_response_id")
        if parent.model_id != model_id:
            message = f"the previous response was made by model {parent.model_id!r}"
            raise ApiError(400, "session_model_mismatch", message, "model")
        return parent

    def _messages(self, req: ResponseRequest, parent: Session | None) -> list[dict[str, Any]]:
        """Instructions apply to this response only; the conversation is the parent's plus the new input."""
        history = []
        if parent is not None:
            history = parent.messages[1:] if parent.extras.get("instructions") is not None else parent.messages
        own = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
        return own + history + req.input_messages()

    async def create(self, req: ResponseRequest, http: Request, tenant: str) -> Any:
        serving, s = self.serving, self.settings
        engine = serving.engine(req.model)
        parent = await self._parent(req, tenant, engine.model_id)
        messages = self._messages(req, parent)
        check_text_size(engine.loaded, [m["content"] for m in messages], "input")
        prompt_ids = await asyncio.to_thread(continuation.prompt_ids, engine.loaded, messages, parent)
        budget = output_budget(
            engine.loaded, len(prompt_ids), req.max_output_tokens, s.default_max_tokens, s.max_tokens_limit
        )
        response_id = "resp_" + uuid.uuid4().hex
        record = request_fields(req)
        key = SessionKey(tenant, response_id, KIND) if req.store else None
        if key is not None:
            serving.check_quota(key, len(prompt_ids) + budget, engine)  # before the record exists
            ttl = s.response_retention_s
            create = self.store.create
            await serving.off_loop(
                create, key, engine.model_id, ttl, parent=req.previous_response_id, extras=dict(record)
            )
        gen = serving.request(
            request_id=response_id,
            prompt_ids=prompt_ids,
            params=SamplingParams(max_tokens=budget, temperature=req.temperature, top_p=req.top_p, seed=req.seed),
            tenant=tenant,
            session=key,
            kv_source=parent.key if parent is not None else None,
            use_cache=req.cache_prompt,
            messages=messages,
        )
        started = time.monotonic()
        try:
            handle, admitted = await serving.start(engine, gen, http)
        except BaseException:
            if key is not None:
                self.store.delete(key)
            raise
        run = _Run(response_id, engine.model_id, record, req.previous_response_id, key, self.store)
        headers = cache_headers(admitted)
        events = serving.metrics.meter(handle, engine.model_id, started)
        if req.stream:
            return event_stream(run.events(handle, events), headers)
        return await run.collect(handle, events, http, headers)

    def get(self, response_id: str, tenant: str) -> dict[str, Any]:
        view = self.store.view(SessionKey(tenant, response_id, KIND))
        if view is None:
            raise not_found(response_id)
        return response_object(response_id, view.model_id, view.extras, view.parent)

    def delete(self, response_id: str, tenant: str) -> dict[str, Any]:
        if not self.store.delete(SessionKey(tenant, response_id, KIND)):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


class _Run:
    """One response being generated: collected into JSON, or streamed as Responses API events."""

    def __init__(
        self,
        response_id: str,
        model: str,
        record: dict[str, Any],
        parent: str | None,
        key: SessionKey | None,
        store: SessionStore,
    ) -> None:
        self.response_id, self.model, self.record, self.parent = response_id, model, record, parent
        self.key, self.store = key, store
        self.sequence_number = 0
        self.is_finished = False

    def _object(self, **state: Any) -> dict[str, Any]:
        return response_object(self.response_id, self.model, {**self.record, **state}, self.parent)

    def _finished(self, text: str, event: Finished) -> dict[str, Any]:
        self.is_finished = True
        return self._object(**result(event.finish_reason, text, event.usage))

    def _forget_unfinished(self) -> None:
        if self.key is not None and not self.is_finished:
            self.store.delete(self.key)  # nothing to continue from: a failed or abandoned response is not kept

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
                    return JSONResponse(self._finished("".join(parts), event), headers=headers)
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
        item_id = "msg_" + self.response_id.removeprefix("resp_")
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        try:
            yield self._event("response.created", response=self._object())
            yield self._event("response.in_progress", response=self._object())
            yield self._event(
                "response.output_item.added", output_index=0, item=message_item(self.response_id, "in_progress", None)
            )
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield self._event("response.content_part.added", **where, part=empty)
            parts = []
            async for event in events:
                if isinstance(event, TextDelta) and event.text:
                    parts.append(event.text)
                    yield self._event("response.output_text.delta", **where, delta=event.text, logprobs=[])
                elif isinstance(event, Finished):
                    text = "".join(parts)
                    yield self._event("response.output_text.done", **where, text=text, logprobs=[])
                    yield self._event("response.content_part.done", **where, part={**empty, "text": text})
                    item = message_item(self.response_id, "completed", text)
                    yield self._event("response.output_item.done", output_index=0, item=item)
                    final = self._finished(text, event)
                    yield self._event(f"response.{final['status']}", response=final)
                elif isinstance(event, Failed):
                    error = {"code": event.code, "message": event.message}
                    yield self._event("response.failed", response=self._object(status="failed", error=error))
        finally:
            handle.cancel()
            self._forget_unfinished()

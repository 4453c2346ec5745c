"""POST/GET/DELETE /v1/responses: the OpenAI Responses API on top of sessions.

A stored response is a node in a session tree: its record holds the token transcript
(input + output) and the chat messages it rendered. `previous_response_id` continues from
that node: the prompt is the parent's transcript plus the new input's tokens (token-exact),
its K/V is found in the device pool by prefix or restored from the parent's snapshot. A
retried request with the same parent branches from the same node again; the parent never
changes, so nothing is appended twice.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from server import continuation
from server.engine.handle import RequestHandle
from server.engine.session import Entry
from server.engine.types import Failed, Finished, GenerationRequest, SamplingParams, SessionKey, TextDelta, Usage
from server.errors import ENGINE_STATUS, ApiError, error_body
from server.prompts import output_budget
from server.response_schemas import ResponseRequest
from server.serving import SEND_TIMEOUT_S, Serving, cache_headers, cancel_on_disconnect


def not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, "response_not_found", f"no stored response {response_id!r}", param)


def usage_dict(usage: Usage | list[int] | None) -> dict | None:
    if usage is None:
        return None
    prompt, completion, cached = (
        (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) if isinstance(usage, Usage) else usage
    )
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def response_object(response_id: str, model: str, record: dict, parent: str | None, **state) -> dict:
    """The Response resource; `state` overrides status, output_text, finish_reason, usage, error."""
    data = {**record, **state}
    status, text = data.get("status", "in_progress"), data.get("output_text")
    output = []
    if text is not None:
        item_status = status if status in ("completed", "incomplete") else "in_progress"
        output.append(message_item(response_id, item_status, text))
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": data.get("created_at", int(time.time())),
        "status": status,
        "model": model,
        "output": output,
        "usage": usage_dict(data.get("usage")),
        "previous_response_id": parent,
        "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "temperature": data.get("temperature", 1.0),
        "top_p": data.get("top_p", 1.0),
        "store": data.get("store", True),
        "metadata": data.get("metadata") or {},
        "user": data.get("user"),
        "incomplete_details": incomplete,
        "error": data.get("error"),
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
    }


def message_item(response_id: str, status: str, text: str | None) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    item_id = "msg_" + response_id.removeprefix("resp_")
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


class Responses:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.store = serving.host.store
        self.settings = serving.settings

    def _parent(self, req: ResponseRequest, tenant: str, model_id: str) -> Entry | None:
        if req.previous_response_id is None:
            return None
        parent = self.store.view(SessionKey(tenant, req.previous_response_id, "response"))
        if parent is None or parent.record.get("status") not in ("completed", "incomplete"):
            raise not_found(req.previous_response_id, "previous_response_id")
        if parent.model_id != model_id:
            message = f"the previous response was made by model {parent.model_id!r}"
            raise ApiError(400, "session_model_mismatch", message, "model")
        return parent

    def _messages(self, req: ResponseRequest, parent: Entry | None) -> list[dict]:
        """Instructions apply to this response only; the conversation is the parent's plus the new input."""
        history = []
        if parent is not None:
            history = parent.messages[1:] if parent.record.get("instructions") is not None else parent.messages
        own = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
        return own + history + req.input_messages()

    async def create(self, req: ResponseRequest, http: Request, tenant: str):
        engine = self.serving.engine(req.model)
        parent = self._parent(req, tenant, engine.model_id)
        messages = self._messages(req, parent)
        prompt_ids = continuation.prompt_ids(engine.loaded, messages, parent)
        s = self.settings
        budget = output_budget(
            engine.loaded, len(prompt_ids), req.max_output_tokens, s.default_max_tokens, s.max_tokens_limit
        )
        params = SamplingParams(max_tokens=budget, temperature=req.temperature, top_p=req.top_p, seed=req.seed)
        response_id = "resp_" + uuid.uuid4().hex
        record = {
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
        key = SessionKey(tenant, response_id, "response") if req.store else None
        if key is not None:
            self.serving.check_quota(key, len(prompt_ids) + budget, engine)  # before the record exists
            ttl = self.settings.response_retention_s
            self.store.create(key, engine.model_id, ttl, parent=req.previous_response_id, record=dict(record))
        timeout = self.settings.request_timeout_s
        gen = GenerationRequest(response_id, prompt_ids, params, key, timeout, tenant, req.cache_prompt, None, messages)
        restore_from = parent.key if parent is not None else None
        started = time.monotonic()
        try:
            handle, admitted = await self.serving.start(engine, gen, http, restore_from)
        except BaseException:
            if key is not None:
                self.store.delete(key)
            raise
        run = _Run(response_id, engine.model_id, record, req.previous_response_id, key, self.store)
        headers = cache_headers(admitted)
        events = self.serving.metrics.meter(handle, engine.model_id, started)
        if req.stream:
            return EventSourceResponse(
                run.events(handle, events), headers=headers, sep="\n", ping=15, send_timeout=SEND_TIMEOUT_S
            )
        return await run.collect(handle, events, http, headers)

    def get(self, response_id: str, tenant: str) -> dict:
        entry = self.store.view(SessionKey(tenant, response_id, "response"))
        if entry is None:
            raise not_found(response_id)
        return response_object(response_id, entry.model_id, entry.record, entry.parent)

    def delete(self, response_id: str, tenant: str) -> dict:
        if not self.store.delete(SessionKey(tenant, response_id, "response")):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


class _Run:
    """One response being generated: collected into JSON, or streamed as Responses API events."""

    def __init__(self, response_id, model, record, parent, key, store) -> None:
        self.response_id, self.model, self.record, self.parent = response_id, model, record, parent
        self.key, self.store = key, store
        self.sequence_number = 0
        self.is_finished = False

    def _object(self, **state) -> dict:
        return response_object(self.response_id, self.model, self.record, self.parent, **state)

    def _finished(self, text: str, event: Finished) -> dict:
        self.is_finished = True
        status = "completed" if event.finish_reason == "stop" else "incomplete"
        return self._object(status=status, output_text=text, usage=event.usage)

    def _failed(self) -> None:
        if self.key is not None and not self.is_finished:
            self.store.delete(self.key)  # nothing to continue from: a failed or abandoned response is not kept

    async def collect(self, handle: RequestHandle, events, http: Request, headers: dict) -> JSONResponse:
        parts = []
        watcher = asyncio.create_task(cancel_on_disconnect(http, handle))
        try:
            async for event in events:
                if isinstance(event, TextDelta):
                    parts.append(event.text)
                elif isinstance(event, Finished):
                    return JSONResponse(self._finished("".join(parts), event), headers=headers)
                elif isinstance(event, Failed):
                    status = ENGINE_STATUS.get(event.code, 500)
                    return JSONResponse(error_body(status, event.code, event.message), status, headers=headers)
        finally:
            watcher.cancel()
            handle.cancel()
            self._failed()
        raise ApiError(500, "internal_error", "generation ended without a result")

    def _event(self, kind: str, **fields) -> ServerSentEvent:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return ServerSentEvent(data=json.dumps(data, ensure_ascii=False), event=kind, sep="\n")

    async def events(self, handle: RequestHandle, events):
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
                    part = {**empty, "text": text}
                    yield self._event("response.output_text.done", **where, text=text, logprobs=[])
                    yield self._event("response.content_part.done", **where, part=part)
                    item = message_item(self.response_id, "completed", text)
                    yield self._event("response.output_item.done", output_index=0, item=item)
                    final = self._finished(text, event)
                    yield self._event(f"response.{final['status']}", response=final)
                elif isinstance(event, Failed):
                    error = {"code": event.code, "message": event.message}
                    yield self._event("response.failed", response=self._object(status="failed", error=error))
        finally:
            handle.cancel()
            self._failed()

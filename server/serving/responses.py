"""POST/GET/DELETE /v1/responses (and its input items): the OpenAI Responses API on top of sessions.

A stored response is a record of kind `response` in the session store: its transcript holds
input + output tokens, its messages what it rendered, and its extras (the format is this
module's) the request fields, the input items and the result. `previous_response_id` continues
from that node: the prompt is the parent's transcript plus the new input's tokens (token-exact),
its K/V found in the pool by prefix or restored from the parent's snapshot. A retried request
with the same parent branches from the same node again; the parent never changes.

A request may also name a session (`session_id`, `X-Session-ID`) or a cache bucket
(`prompt_cache_key`), meaning what they mean on chat completions: the turn runs on that session
(locked, continued token-exactly, recorded there), and the stored response is written from the
session's state once the turn is recorded, before the final event is sent.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from fastapi import Request
from starlette.responses import Response

from server.engine.request import Admitted, SamplingParams
from server.openai.errors import ApiError
from server.openai.response_objects import response_object
from server.openai.responses import RESPONSE_ID_PATTERN, ResponseRequest
from server.serving import structured
from server.serving.core import Serving, session_key
from server.serving.pipeline import Placement, Renderer, Turn, run_turn
from server.serving.prompts import check_text_size
from server.serving.render.responses import KIND, ResponseRenderer, not_found, result
from server.serving.response_items import messages_of, resolve, stored_items
from server.serving.tool_reader import Reading, ToolReader
from server.serving.tools import responses_tool_use
from server.sessions.chat import ChatMessage
from server.sessions.record import CompletedTurn, Session, SessionKey


def request_fields(req: ResponseRequest, items: list[dict[str, Any]]) -> dict[str, Any]:
    """A new response's record: what the Response object repeats of its request, its input, its status."""
    choice = req.tool_choice
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
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
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str) else choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "text_format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt is not None else None,
        "input_items": items,
    }


def record_turn(extras: dict[str, Any], turn: CompletedTurn) -> None:
    """The store's hook for responses: the result is journaled with the transcript, before the final event."""
    reply: ChatMessage = turn.reply or {"role": "assistant", "content": turn.text}
    extras.update(result(turn.finish_reason, reply["content"], turn.usage, reply.get("tool_calls", [])))


class Responses:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.store = serving.store
        self.store.on_turn(KIND, record_turn)
        for key in self.store.session_keys(KIND):  # responses a previous run never finished: nothing to continue from
            view = self.store.view(key)
            if view is not None and view.extras.get("status") == "in_progress":
                self.store.delete(key)

    async def _parent(self, req: ResponseRequest, tenant: str, model_id: str) -> Session | None:
        if req.previous_response_id is None:
            return None
        parent = await self.serving.off_loop(self._stored, tenant, req.previous_response_id)
        if parent is None or parent.extras.get("status") not in ("completed", "incomplete"):
            raise not_found(req.previous_response_id, "previous_response_id")
        if parent.model_id != model_id:
            message = f"the previous response was made by model {parent.model_id!r}"
            raise ApiError(400, "session_model_mismatch", message, "model")
        return parent

    def _stored(self, tenant: str, response_id: str) -> Session | None:
        key = _stored_key(tenant, response_id)
        return self.store.view(key) if key is not None else None

    def _messages(self, req: ResponseRequest, parent: Session | None, items: list[dict[str, Any]]) -> list[ChatMessage]:
        """Instructions apply to this response only; the conversation is the parent's plus the new input."""
        history: list[ChatMessage] = []
        if parent is not None:
            history = parent.messages[1:] if parent.extras.get("instructions") is not None else parent.messages
        if req.instructions is not None:
            history = [{"role": "system", "content": req.instructions}, *history]
        return history + messages_of(items)

    async def create(self, req: ResponseRequest, http: Request, tenant: str) -> Response:
        serving = self.serving
        engine = serving.engine(req.model)
        named = session_key(req, http, tenant)
        session = named if named is not None and not named.is_bucket else None  # the turn runs there
        parent = await self._parent(req, tenant, engine.model_id)
        response_id = "resp_" + uuid.uuid4().hex
        items = stored_items(response_id, req)
        resolved = await serving.off_loop(resolve, items, lambda rid: self._stored(tenant, rid))
        messages = self._messages(req, parent, resolved)
        check_text_size(engine.loaded, [m["content"] for m in messages], "input")
        tools = responses_tool_use(req)
        reading = Reading.of(engine.loaded.tokenizer, tools, response_id, messages)
        base = await serving.session_view(session, engine) if session is not None else parent
        fmt = req.text.format if req.text is not None else None
        record = request_fields(req, items)
        key = SessionKey(tenant, response_id, KIND) if req.store else None  # the stored response's record

        def sampling(budget: int) -> SamplingParams:
            return SamplingParams(max_tokens=budget, temperature=req.temperature, top_p=req.top_p, seed=req.seed)

        async def place(num_tokens: int) -> Placement:
            if key is not None:
                serving.check_quota(key, num_tokens, engine)  # before the record exists
            if session is not None:
                return Placement(serving.session_for(session, num_tokens, engine), session)
            kv_source = parent.key if parent is not None else None
            if key is None:
                return Placement(serving.session_for(named, num_tokens, engine), kv_source)
            # The record is the engine's session: it records the turn; a request the engine refuses leaves none
            ttl = serving.settings.response_retention_s
            await serving.off_loop(
                self.store.create, key, engine.model_id, ttl, parent=req.previous_response_id, extras=dict(record)
            )
            return Placement(key, kv_source, lambda: serving.off_loop(self.store.delete, key))

        def renderer(admitted: Admitted, reader: ToolReader) -> Renderer:
            parent_id = req.previous_response_id
            return ResponseRenderer(response_id, engine.model_id, record, parent_id, serving, reader, key, session)

        turn = Turn(
            engine, tenant, reading, named, messages, req.max_output_tokens, sampling, renderer, req.stream, base=base,
            schema=structured.schema_of(fmt.type, fmt.schema_) if fmt is not None else None,
            schema_param="text.format", use_cache=req.cache_prompt, place=place,
        )  # fmt: skip
        return await run_turn(serving, turn, http)

    def get(self, response_id: str, tenant: str) -> dict[str, Any]:
        view = self._stored(tenant, response_id)
        if view is None:
            raise not_found(response_id)
        return response_object(response_id, view.model_id, view.extras, view.parent)

    def input_items(self, response_id: str, tenant: str, limit: int, order: str, after: str | None) -> dict[str, Any]:
        """The items a stored response was given (references as they were sent), OpenAI's list shape."""
        view = self._stored(tenant, response_id)
        if view is None:
            raise not_found(response_id)
        items = list(view.extras.get("input_items", []))
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item.get("id") for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        first, last = (page[0].get("id"), page[-1].get("id")) if page else (None, None)
        return {"object": "list", "data": page, "first_id": first, "last_id": last, "has_more": len(items) > limit}

    def delete(self, response_id: str, tenant: str) -> dict[str, Any]:
        key = _stored_key(tenant, response_id)
        if key is None or not self.store.delete(key):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _stored_key(tenant: str, response_id: str) -> SessionKey | None:
    """The key a stored response would have; None for an id that was never one of ours (so is not stored: a 404
    like any unknown id, which clients catch as OpenAI's NotFoundError), which reaches no store."""
    return SessionKey(tenant, response_id, KIND) if re.fullmatch(RESPONSE_ID_PATTERN, response_id) else None

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
from dataclasses import dataclass
from functools import partial
from typing import Any

from server.engine.engine import Engine
from server.engine.request import SamplingParams
from server.openai.errors import ApiError
from server.openai.response_objects import response_object
from server.openai.responses import RESPONSE_ID_PATTERN, ResponseRequest
from server.serving import structured
from server.serving.core import Serving
from server.serving.pipeline import (
    Answer,
    Arrival,
    Conversation,
    History,
    Place,
    Placement,
    Started,
    Turn,
    session_key,
)
from server.serving.render.base import Renderer
from server.serving.render.responses import KIND, ResponseRenderer, not_found, result
from server.serving.response_items import messages_of, resolve, stored_items
from server.serving.tool_reader import ToolReader
from server.serving.tools import responses_tool_use
from server.sessions.chat import ChatMessage
from server.sessions.record import CompletedTurn, Session, SessionKey
from server.sessions.store import SessionStore


def request_fields(req: ResponseRequest, items: list[dict[str, Any]], created_at: int) -> dict[str, Any]:
    """A new response's record: what the Response object repeats of its request, its input, its status."""
    choice = req.tool_choice
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return {
        "created_at": created_at,
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
    """The Responses API's resources beside its turns: stored responses read, listed and deleted."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.store = serving.store
        self.store.on_turn(KIND, record_turn)
        for key in self.store.session_keys(KIND):  # responses a previous run never finished: nothing to continue from
            view = self.store.view(key)
            if view is not None and view.extras.get("status") == "in_progress":
                self.store.delete(key)

    def _stored(self, tenant: str, response_id: str) -> Session | None:
        return stored(self.store, tenant, response_id)

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


def stored(store: SessionStore, tenant: str, response_id: str) -> Session | None:
    key = _stored_key(tenant, response_id)
    return store.view(key) if key is not None else None


@dataclass(slots=True, frozen=True)
class ResponseHistory(History):
    """The conversation of a response: its `previous_response_id`'s (instructions apply to one response only), then
    the new input items, references resolved; on a named session, that session's transcript is continued."""

    parent_id: str | None
    instructions: str | None
    items: list[dict[str, Any]]
    session: SessionKey | None  # the named session the turn runs on (None: none, or a bucket)

    async def read(self, serving: Serving, engine: Engine, turn: Turn) -> Conversation:
        parent = await self._parent(serving, turn.tenant, engine.model_id)
        lookup = partial(stored, serving.store, turn.tenant)
        resolved = await serving.off_loop(resolve, self.items, lookup)
        history: list[ChatMessage] = []
        if parent is not None:
            history = parent.messages[1:] if parent.extras.get("instructions") is not None else parent.messages
        if self.instructions is not None:
            history = [{"role": "system", "content": self.instructions}, *history]
        base = await serving.session_view(self.session, engine) if self.session is not None else parent
        return Conversation(history + messages_of(resolved), base, turn.tools)

    async def _parent(self, serving: Serving, tenant: str, model_id: str) -> Session | None:
        if self.parent_id is None:
            return None
        parent = await serving.off_loop(stored, serving.store, tenant, self.parent_id)
        if parent is None or parent.extras.get("status") not in ("completed", "incomplete"):
            raise not_found(self.parent_id, "previous_response_id")
        if parent.model_id != model_id:
            message = f"the previous response was made by model {parent.model_id!r}"
            raise ApiError(400, "session_model_mismatch", message, "model")
        return parent


@dataclass(slots=True, frozen=True)
class ResponsePlace(Place):
    """A stored response (`store`) is a record the engine records the turn in, made now; on a named session the
    turn runs there and the record is written from the session's state once the turn is recorded."""

    stored: SessionKey | None  # the stored response's record (None: store=false)
    parent_id: str | None
    session: SessionKey | None
    record: dict[str, Any]

    async def place(self, serving: Serving, engine: Engine, turn: Turn, num_tokens: int) -> Placement:
        key = self.stored
        if key is not None:
            serving.check_quota(key, num_tokens, engine)  # before the record exists
        if self.session is not None:
            return Placement(serving.session_for(self.session, num_tokens, engine), self.session)
        kv_source = SessionKey(turn.tenant, self.parent_id, KIND) if self.parent_id is not None else None
        if key is None:
            return Placement(serving.session_for(turn.named, num_tokens, engine), kv_source)
        # The record is the engine's session: it records the turn; a request the engine refuses leaves none
        ttl = serving.settings.response_retention_s
        record = dict(self.record)
        await serving.off_loop(serving.store.create, key, engine.model_id, ttl, parent=self.parent_id, extras=record)
        return Placement(key, kv_source, lambda: serving.off_loop(serving.store.delete, key))


@dataclass(slots=True, frozen=True)
class ResponseAnswer(Answer):
    """The Response object, or its events; the stored record (`stored`, `session`: as for ResponsePlace)."""

    record: dict[str, Any]
    parent_id: str | None
    stored: SessionKey | None
    session: SessionKey | None

    async def renderer(self, started: Started, reader: ToolReader) -> Renderer:
        turn, model_id = started.turn, started.engine.model_id
        args = (self.record, self.parent_id, started.serving, reader, self.stored, self.session)
        return ResponseRenderer(turn.request_id, model_id, *args)


def read_response(req: ResponseRequest, arrival: Arrival) -> Turn:
    """A Responses API request as a turn: after its previous response, or on the session it names."""
    named = session_key(req, arrival)
    session = named if named is not None and not named.is_bucket else None  # the turn runs there
    response_id = arrival.request_id
    items = stored_items(response_id, req)
    record = request_fields(req, items, arrival.received_at)
    key = SessionKey(arrival.tenant, response_id, KIND) if req.store else None  # the stored response's record
    fmt = req.text.format if req.text is not None else None
    parent_id = req.previous_response_id
    return Turn(
        req.model, arrival.tenant, response_id, named, ResponseHistory(parent_id, req.instructions, items, session),
        ResponsePlace(key, parent_id, session, record), ResponseAnswer(record, parent_id, key, session),
        tools=responses_tool_use(req),
        sampling=SamplingParams(temperature=req.temperature, top_p=req.top_p, seed=req.seed),
        max_tokens=req.max_output_tokens, stream=req.stream,
        schema=structured.schema_of(fmt.type, fmt.schema_) if fmt is not None else None,
        schema_param="text.format", text_param="input", use_cache=req.cache_prompt,
    )  # fmt: skip


def _stored_key(tenant: str, response_id: str) -> SessionKey | None:
    """The key a stored response would have; None for an id that was never one of ours (so is not stored: a 404
    like any unknown id, which clients catch as OpenAI's NotFoundError), which reaches no store."""
    return SessionKey(tenant, response_id, KIND) if re.fullmatch(RESPONSE_ID_PATTERN, response_id) else None

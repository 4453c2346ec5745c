"""The one turn pipeline: every generation API's request, once read into a `Turn`, runs here.

An API is a reader, a renderer and an entry in `apis.py`. Its reader (completions.py, messages.py, responses.py)
is a pure function of the validated body and how the request arrived (`Arrival`): it gives a `Turn`, data only:
chat's normal form of the new messages, the tools, how it samples, the session it names, and three values that say
what the API means where APIs differ: where the conversation so far comes from (`History`), where the turn runs
(`Place`), and how it is answered (`Answer`, which makes the API's renderer, render/). Between them this module does
the rest, in one place and in one order: the model's engine, the conversation, the size rule, how the reply is read,
the prompt's ids (off the event loop), the grammar, the output budget, the placement, the engine request, admission,
the cache headers, metering, and the collect or stream loop with its cancellation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.responses import Response

from server.engine.engine import Engine
from server.engine.handle import RequestHandle
from server.engine.request import Admitted, Event, Failed, Finished, SamplingParams, TextDelta, TokenLogprob
from server.openai.errors import ApiError
from server.serving import continuation, structured
from server.serving.core import Serving, answer_headers, cancel_on_disconnect
from server.serving.prompts import check_text_size, checked_sampling, completion_ids, output_budget
from server.serving.render.base import Renderer
from server.serving.tool_reader import Reading, ToolReader
from server.serving.tools import ToolUse
from server.sessions.chat import ChatMessage
from server.sessions.record import Session, SessionKey
from server.wire import SESSION_ID_PATTERN

SEND_TIMEOUT_S = 60  # a client that accepts no bytes for this long is disconnected
PING_S = 15


@dataclass(slots=True, frozen=True)
class Arrival:
    """A request as it arrived, apart from its body: who sent it, the X-Session-ID header, the id it was given
    (its response's id too) and when (unix seconds)."""

    tenant: str
    session_header: str | None = None
    request_id: str = ""
    received_at: int = 0


@dataclass(slots=True, frozen=True)
class Turn:
    """One turn, as a request asks for it: data only (a reader's output, compared in tests)."""

    model: str
    tenant: str
    request_id: str
    named: SessionKey | None  # the session or cache bucket the request names
    history: History  # where the conversation so far comes from
    place: Place  # where the turn runs
    answer: Answer  # how it is answered
    # chat's normal form of the request's messages; None: a completion, or items its history reads (Responses')
    messages: list[ChatMessage] | None = None
    prompt: str | list[int] | None = None  # a completion's prompt
    tools: ToolUse | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)  # max_tokens: the budget's, set here
    max_tokens: int | None = None  # its output budget as asked (None: the default, cut to the context)
    stream: bool = False
    schema: dict[str, Any] | None = None  # the output's JSON schema (None: free text)
    schema_param: str = "response_format"  # the API's name of its output format, for errors
    text_param: str = "messages"  # the body's field its prompt text comes from, for size errors
    use_cache: bool = True


@dataclass(slots=True, frozen=True)
class Conversation:
    """What a turn's prompt renders once its history is read: every message (None: a completion), the session
    state it continues token-exactly, and its tools (a thread keeps its own)."""

    messages: list[ChatMessage] | None
    base: Session | None
    tools: ToolUse | None


@dataclass(slots=True, frozen=True)
class Placement:
    """Where a turn runs: the session it locks and records (None: stateless), whose lower-tier copy may hold its
    prompt's K/V, and what to take back (what was made for it) if the engine refuses the turn or it ends unfinished
    (failed, cancelled, its client gone): nothing can continue from a turn that did not complete."""

    session: SessionKey | None
    kv_source: SessionKey | None
    undo: Callable[[], Awaitable[object]] | None = None


@dataclass(slots=True, frozen=True)
class Started:
    """A turn the engine admitted: what its renderer may need."""

    serving: Serving
    engine: Engine
    turn: Turn
    conversation: Conversation
    placement: Placement
    admitted: Admitted


class History(ABC):
    """Where a turn's conversation so far comes from (read once its model's engine is known)."""

    @abstractmethod
    async def read(self, serving: Serving, engine: Engine, turn: Turn) -> Conversation: ...


class Place(ABC):
    """Where a turn runs, given how many tokens it may hold (its prompt and its output budget)."""

    @abstractmethod
    async def place(self, serving: Serving, engine: Engine, turn: Turn, num_tokens: int) -> Placement: ...


class Answer(ABC):
    """How a turn is answered: its API's renderer, made once the engine admitted it."""

    @abstractmethod
    async def renderer(self, started: Started, reader: ToolReader) -> Renderer: ...


@dataclass(slots=True, frozen=True)
class Stateless(History):
    """A completion: its prompt is all there is."""

    async def read(self, serving: Serving, engine: Engine, turn: Turn) -> Conversation:
        return Conversation(None, None, None)


@dataclass(slots=True, frozen=True)
class NamedSession(History):
    """The named session's: the prompt continues its transcript token-exactly, and a system prompt it was made
    with applies to a request that brings none of its own."""

    async def read(self, serving: Serving, engine: Engine, turn: Turn) -> Conversation:
        assert turn.messages is not None
        view = await serving.session_view(turn.named, engine)
        return Conversation(with_session_system(turn.messages, view), view, turn.tools)


@dataclass(slots=True, frozen=True)
class OnNamed(Place):
    """On the named session (locked and recorded), a cache bucket (neither), or nothing."""

    async def place(self, serving: Serving, engine: Engine, turn: Turn, num_tokens: int) -> Placement:
        session = serving.session_for(turn.named, num_tokens, engine)
        return Placement(session, session if session is not None and not session.is_bucket else None)


class NamesSession(Protocol):
    """A request body that may name a session (session_id) or a cache bucket (prompt_cache_key)."""

    @property
    def session_id(self) -> str | None: ...
    @property
    def prompt_cache_key(self) -> str | None: ...


def session_key(req: NamesSession, arrival: Arrival) -> SessionKey | None:
    """The body's session_id or the X-Session-ID header (they must agree), else a prompt_cache_key bucket."""
    header = arrival.session_header
    if header is not None:
        if not re.fullmatch(SESSION_ID_PATTERN, header):
            raise ApiError(400, "invalid_parameter", "session ids are 1-128 characters of [A-Za-z0-9_-]", "session_id")
        if req.session_id is not None and req.session_id != header:
            raise ApiError(400, "invalid_parameter", "body session_id and X-Session-ID header differ", "session_id")
    name = req.session_id or header
    if name is not None:
        return SessionKey(arrival.tenant, name)
    if req.prompt_cache_key is not None:
        return SessionKey(arrival.tenant, req.prompt_cache_key, kind="bucket")
    return None


def with_session_system(messages: list[ChatMessage], view: Session | None) -> list[ChatMessage]:
    """A session created with a system prompt applies it to requests that bring none of their own."""
    if view is None or not view.turns[0].num_messages or (messages and messages[0]["role"] == "system"):
        return messages
    return view.messages[: view.turns[0].num_messages] + messages


async def run_turn(serving: Serving, turn: Turn, http: Request) -> Response:
    """Everything between an API's reader and its renderer."""
    engine = serving.engine(turn.model)
    loaded = engine.loaded
    conversation = await turn.history.read(serving, engine, turn)
    messages = conversation.messages
    if messages is not None:
        check_text_size(loaded, [m["content"] for m in messages], turn.text_param)
        reading = Reading.of(loaded.tokenizer, conversation.tools, turn.request_id, messages)
        ids = await asyncio.to_thread(continuation.prompt_ids, loaded, messages, conversation.base, reading.tools)
    else:
        assert turn.prompt is not None
        if isinstance(turn.prompt, str):
            check_text_size(loaded, [turn.prompt], turn.text_param)
        reading = Reading.plain(turn.request_id)
        ids = await asyncio.to_thread(completion_ids, turn.prompt, loaded)  # tokenizing: off the event loop
    constraint = await structured.constraint(engine, turn.schema, reading.tools, reading.syntax, turn.schema_param)
    budget = output_budget(loaded, len(ids), turn.max_tokens, serving.settings)
    params = dataclasses.replace(checked_sampling(turn.sampling, loaded), max_tokens=budget)
    placement = await turn.place.place(serving, engine, turn, len(ids) + budget)
    gen = serving.request(
        reading=reading,
        prompt_ids=ids,
        params=params,
        tenant=turn.tenant,
        session=placement.session,
        kv_source=placement.kv_source,
        use_cache=turn.use_cache,
        messages=messages,
        constraint=constraint,
    )
    started = time.monotonic()
    try:
        handle, admitted = await serving.start(engine, gen, http)
    except BaseException:
        if placement.undo is not None:
            await placement.undo()
        raise
    try:
        state = Started(serving, engine, turn, conversation, placement, admitted)
        renderer = await turn.answer.renderer(state, reading.reader())
    except BaseException:
        handle.cancel()
        raise
    headers = answer_headers(admitted, turn.named)
    events = serving.metrics.meter(handle, engine.model_id, started)
    ending = Ending(serving, handle, renderer, placement)
    if turn.stream:
        sse = stream(renderer, ending, events)
        return EventSourceResponse(sse, headers=headers, sep="\n", ping=PING_S, send_timeout=SEND_TIMEOUT_S)
    return await collect(renderer, ending, events, http, headers)


@dataclass(slots=True)
class Ending:
    """What ends an admitted turn, whatever happened: its request stopped, its renderer closed, and what was made
    for it taken back when it did not finish."""

    serving: Serving
    handle: RequestHandle
    renderer: Renderer
    placement: Placement
    is_finished: bool = False

    def __call__(self) -> None:
        self.handle.cancel()
        self.renderer.close()
        if not self.is_finished and self.placement.undo is not None:
            self.serving.later(self.placement.undo())


async def collect(
    renderer: Renderer, ending: Ending, events: AsyncIterator[Event], http: Request, headers: dict[str, str]
) -> JSONResponse:
    """The whole answer as one body (the client going away meanwhile cancels the turn)."""
    watcher = asyncio.create_task(cancel_on_disconnect(http, ending.handle))
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    try:
        async for event in events:
            if isinstance(event, TextDelta):
                parts.append(event.text)
                logprobs.extend(event.logprobs or [])
            elif isinstance(event, Finished):
                ending.is_finished = True
                return JSONResponse(await renderer.body(event, "".join(parts), logprobs), headers=headers)
            elif isinstance(event, Failed):
                return JSONResponse(*renderer.error(event), headers=headers)
    finally:
        watcher.cancel()
        ending()
    raise ApiError(500, "internal_error", "generation ended without a result")


async def stream(renderer: Renderer, ending: Ending, events: AsyncIterator[Event]) -> AsyncIterator[ServerSentEvent]:
    """The answer as server-sent events; a client that went away stops its generation at the next step."""
    try:
        for sse in renderer.opening():
            yield sse
        async for event in events:
            if isinstance(event, TextDelta):
                out = renderer.delta(event)
            elif isinstance(event, Finished):
                ending.is_finished = True
                out = await renderer.finished(event)
            elif isinstance(event, Failed):
                out = renderer.failed(event)
            else:
                out = []
            for sse in out:
                yield sse
        for sse in renderer.closing():
            yield sse
    finally:
        ending()

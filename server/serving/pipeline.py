"""The one turn pipeline: every generation API's request, once converted to a `Turn`, runs here.

An API is a converter and a renderer. Its converter (completions.py, messages.py, responses.py)
reads its body into a `Turn`: chat's normal form, the tools, the output schema, how it samples,
the session it names. Its renderer (render/) shows the turn's events in its wire shape. Between
them this module does the rest, in one place and in one order: the prompt's ids (off the event
loop), the grammar, the output budget, where the turn runs (sessions, quotas), the engine request,
admission, the cache headers, metering, and the collect or stream loop with its cancellation.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.responses import Response

from server.engine.engine import Engine
from server.engine.handle import RequestHandle
from server.engine.request import Admitted, Event, Failed, Finished, SamplingParams, TextDelta, TokenLogprob
from server.openai.errors import ApiError, failure_body
from server.serving import continuation, structured
from server.serving.core import Serving, answer_headers, cancel_on_disconnect
from server.serving.prompts import output_budget
from server.serving.tool_reader import Reading, ToolReader
from server.sessions.chat import ChatMessage, ToolCall
from server.sessions.record import Session, SessionKey

SEND_TIMEOUT_S = 60  # a client that accepts no bytes for this long is disconnected
PING_S = 15


@dataclass(slots=True, frozen=True)
class Placement:
    """Where a turn runs: the session it locks and records (None: stateless), whose lower-tier copy may hold its
    prompt's K/V, and what to take back if the engine refuses it (a record made for it)."""

    session: SessionKey | None
    kv_source: SessionKey | None
    undo: Callable[[], Awaitable[object]] | None = None


class Renderer(ABC):
    """One API's answer on the wire. A collected turn is `body` (or `error`); a streamed one is `opening`, then
    `delta` per text event, `finished` or `failed`, then `closing`. `close` runs last, whatever happened."""

    @abstractmethod
    async def body(self, finished: Finished, text: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        """The collected answer: `text` and `logprobs` are all the deltas'."""

    def error(self, failed: Failed) -> tuple[dict[str, Any], int]:
        """A collected turn's failure: its body and status (OpenAI's envelope unless the API has its own)."""
        return failure_body(failed.code, failed.message)

    def opening(self) -> list[ServerSentEvent]:
        return []

    @abstractmethod
    def delta(self, event: TextDelta) -> list[ServerSentEvent]:
        """The events for new text (none while a tool call or a leading blank is still being read)."""

    @abstractmethod
    async def finished(self, event: Finished) -> list[ServerSentEvent]:
        """The rest of the reply's events and its end (with usage)."""

    @abstractmethod
    def failed(self, event: Failed) -> list[ServerSentEvent]:
        """A failure after the stream opened, in the API's own error event."""

    def closing(self) -> list[ServerSentEvent]:
        return []

    def close(self) -> None:  # noqa: B027 (a hook: only an API that keeps a record of the turn has work here)
        pass


class PartsRenderer(Renderer):
    """A reply streamed as its parts, in order (Messages' content blocks, Responses' output items): the text,
    opened on its first visible text and closed before the first call, then each call. Whitespace before any
    visible text is held back: if calls follow, it is no content (the answer's rule, `content_beside_calls`); a
    reply that is only whitespace and makes no call keeps it."""

    def __init__(self, reader: ToolReader) -> None:
        self.reader = reader
        self.has_text = self.is_text_closed = False
        self.num_calls = 0
        self._blank = ""  # whitespace held back

    def delta(self, event: TextDelta) -> list[ServerSentEvent]:
        if not event.text:
            return []
        text, calls = self.reader.feed(event.text)
        return self.text(text) + self.calls(calls)

    def rest(self) -> list[ServerSentEvent]:
        """At the reply's end: what the reader still held, then the text's end."""
        text, calls = self.reader.finish()
        return self.text(text, last=True) + self.calls(calls, self.reader.is_cut) + self.close_text()

    def text(self, text: str, last: bool = False) -> list[ServerSentEvent]:
        text, self._blank = self._blank + text, ""
        if not text or not (self.has_text or text.strip() or (last and not self.num_calls)):
            self._blank = text
            return []
        return (self.open_text() if not self.has_text else []) + self._text(text)

    def open_text(self) -> list[ServerSentEvent]:
        self.has_text = True
        return self._text_opened()

    def close_text(self) -> list[ServerSentEvent]:
        if not self.has_text or self.is_text_closed:
            return []
        self.is_text_closed = True
        return self._text_closed()

    def calls(self, calls: list[ToolCall], is_cut: bool = False) -> list[ServerSentEvent]:
        """Each call's events, the text closed first; with `is_cut`, the last one's arguments are unfinished."""
        out = self.close_text() if calls else []
        for number, call in enumerate(calls, 1):
            position = self.num_calls + (1 if self.has_text else 0)  # among the parts: after the text, if any
            out += self._call(call, self.num_calls, position, is_cut and number == len(calls))
            self.num_calls += 1
        return out

    @abstractmethod
    def _text_opened(self) -> list[ServerSentEvent]: ...

    @abstractmethod
    def _text(self, text: str) -> list[ServerSentEvent]: ...

    @abstractmethod
    def _text_closed(self) -> list[ServerSentEvent]: ...

    @abstractmethod
    def _call(self, call: ToolCall, index: int, position: int, is_cut: bool) -> list[ServerSentEvent]:
        """A call's events: `index` among the calls, `position` among the parts."""


@dataclass(slots=True)
class Turn:
    """One turn, as every API asks for it."""

    engine: Engine
    tenant: str
    reading: Reading  # its id, its tools and how its reply is read
    named: SessionKey | None  # the session or cache bucket the request names
    messages: list[ChatMessage] | None  # chat's normal form (recorded with the turn); None: a plain completion
    max_tokens: int | None  # its output budget as asked (None: the default, cut to the context)
    sampling: Callable[[int], SamplingParams]  # its sampling, given its output budget
    renderer: Callable[[Admitted, ToolReader], Renderer]  # its wire shape, once admitted
    stream: bool
    prompt_ids: list[int] | None = None  # a completion's; chat's are rendered from `messages`, continuing `base`
    base: Session | None = None  # the session state the prompt continues token-exactly
    schema: dict[str, Any] | None = None  # the output's JSON schema (None: free text)
    schema_param: str = "response_format"  # the API's name of its output format, for errors
    use_cache: bool = True
    place: Callable[[int], Awaitable[Placement]] | None = None  # where it runs, given its tokens (else `named`)


async def run_turn(serving: Serving, turn: Turn, http: Request) -> Response:
    """Everything between an API's converter and its renderer."""
    engine, reading = turn.engine, turn.reading
    ids = turn.prompt_ids
    if ids is None:
        assert turn.messages is not None
        ids = await asyncio.to_thread(continuation.prompt_ids, engine.loaded, turn.messages, turn.base, reading.tools)
    constraint = await structured.constraint(engine, turn.schema, reading.tools, reading.style, turn.schema_param)
    params = turn.sampling(output_budget(engine.loaded, len(ids), turn.max_tokens, serving.settings))
    num_tokens = len(ids) + params.max_tokens
    if turn.place is not None:
        placement = await turn.place(num_tokens)
    else:
        session = serving.session_for(turn.named, num_tokens, engine)
        placement = Placement(session, session if session is not None and not session.is_bucket else None)
    gen = serving.request(
        reading=reading,
        prompt_ids=ids,
        params=params,
        tenant=turn.tenant,
        session=placement.session,
        kv_source=placement.kv_source,
        use_cache=turn.use_cache,
        messages=turn.messages,
        constraint=constraint,
    )
    started = time.monotonic()
    try:
        handle, admitted = await serving.start(engine, gen, http)
    except BaseException:
        if placement.undo is not None:
            await placement.undo()
        raise
    renderer = turn.renderer(admitted, reading.reader())
    headers = answer_headers(admitted, turn.named)
    events = serving.metrics.meter(handle, engine.model_id, started)
    if turn.stream:
        sse = stream(renderer, handle, events)
        return EventSourceResponse(sse, headers=headers, sep="\n", ping=PING_S, send_timeout=SEND_TIMEOUT_S)
    return await collect(renderer, handle, events, http, headers)


async def collect(
    renderer: Renderer, handle: RequestHandle, events: AsyncIterator[Event], http: Request, headers: dict[str, str]
) -> JSONResponse:
    """The whole answer as one body (the client going away meanwhile cancels the turn)."""
    watcher = asyncio.create_task(cancel_on_disconnect(http, handle))
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    try:
        async for event in events:
            if isinstance(event, TextDelta):
                parts.append(event.text)
                logprobs.extend(event.logprobs or [])
            elif isinstance(event, Finished):
                return JSONResponse(await renderer.body(event, "".join(parts), logprobs), headers=headers)
            elif isinstance(event, Failed):
                return JSONResponse(*renderer.error(event), headers=headers)
    finally:
        watcher.cancel()
        handle.cancel()
        renderer.close()
    raise ApiError(500, "internal_error", "generation ended without a result")


async def stream(
    renderer: Renderer, handle: RequestHandle, events: AsyncIterator[Event]
) -> AsyncIterator[ServerSentEvent]:
    """The answer as server-sent events; a client that went away stops its generation at the next step."""
    try:
        for sse in renderer.opening():
            yield sse
        async for event in events:
            if isinstance(event, TextDelta):
                out = renderer.delta(event)
            elif isinstance(event, Finished):
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
        handle.cancel()
        renderer.close()

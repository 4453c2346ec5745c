"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API on the same engine and sessions.

A request becomes chat's normal form: `system` a system message, text blocks content, an assistant's
`tool_use` blocks its tool calls, a user's `tool_result` blocks tool messages (before its text). So
a session (`X-Session-ID`, or kvserve's `session_id`) continues token-exactly as on chat, tools go
through the same rendering and grammar, and the reply read back is the message the session records.

`cache_control` needs nothing set up: every prompt's K/V is kept by prefix. A breakpoint says where
the cached part ends for the accounting Anthropic's clients read: tokens up to the last breakpoint
that were computed now are `cache_creation_input_tokens`, reused ones `cache_read_input_tokens`, the
rest `input_tokens`. Its `ttl` becomes the TTL of a session the request creates.

Message threads (`thread`) are in threads.py: a thread's turn reads `ThreadHistory` and runs in a `ThreadNode`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from server.anthropic.schemas import Conversation as Body
from server.anthropic.schemas import CountTokensRequest, MessagesRequest, ToolResultBlock, ToolUseBlock
from server.engine.engine import Engine
from server.engine.request import SamplingParams
from server.models.loader import LoadedModel
from server.openai.errors import ApiError
from server.serving import continuation, threads
from server.serving.core import Serving
from server.serving.pipeline import (
    Answer,
    Arrival,
    History,
    NamedSession,
    OnNamed,
    Place,
    Placement,
    Started,
    Turn,
    session_key,
)
from server.serving.prompts import check_text_size
from server.serving.render.base import Renderer
from server.serving.render.messages import MessageRenderer
from server.serving.tool_reader import ToolReader
from server.serving.tools import NO_PARAMETERS, ToolSpec, ToolUse, assistant_message, tool_call
from server.sessions.chat import ChatMessage
from server.sessions.errors import SessionBusy, SessionError
from server.sessions.record import Session, SessionKey
from server.sessions.store import SessionStore


class Messages:
    """The Messages API's resources beside its turns: count_tokens; and its threads' nodes, kept in the store."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        threads.keep_nodes(serving.store)

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        loaded = self.serving.engine(req.model).loaded
        messages, _ends = chat_of(req)
        check_text_size(loaded, [m["content"] for m in messages], "messages")
        ids = await asyncio.to_thread(continuation.prompt_ids, loaded, messages, None, tool_use_of(req))
        return {"input_tokens": len(ids)}


@dataclass(slots=True, frozen=True)
class MessageAnswer(Answer):
    """The message object, or Anthropic's events; `num_marked`: the request's messages up to its last cache_control
    breakpoint (None: no breakpoint), whose prompt tokens are the cached part its usage reports, kept for `ttl_s`."""

    num_marked: int | None
    ttl_s: float | None

    async def renderer(self, started: Started, reader: ToolReader) -> Renderer:
        boundary = 0
        messages, turn = started.conversation.messages, started.turn
        if self.num_marked is not None and messages is not None and turn.messages is not None:
            before = len(messages) - len(turn.messages)  # the session's system prompt, a thread's history
            prefix = messages[: before + self.num_marked]
            boundary = await asyncio.to_thread(prefix_len, started.engine.loaded, prefix, started.conversation.tools)
        model_id, admitted = started.engine.model_id, started.admitted
        return MessageRenderer(turn.request_id, model_id, reader, boundary, admitted, self.ttl_s)


@dataclass(slots=True, frozen=True)
class WithTtl(Place):
    """The named session, made now with the breakpoint's TTL when it is new (it keeps its own TTL otherwise)."""

    ttl_s: float

    async def place(self, serving: Serving, engine: Engine, turn: Turn, num_tokens: int) -> Placement:
        session = serving.session_for(turn.named, num_tokens, engine)
        if session is None or session.is_bucket:
            return Placement(session, None)
        # Made only now, every check passed (the store checks the session quota again, under its lock); a request
        # the engine refuses takes it away again, so no empty leftover of it stays.
        made = await serving.off_loop(_create, serving.store, session, engine.model_id, self.ttl_s)
        if made is None:
            return Placement(session, session)
        return Placement(session, session, lambda: _discard(serving, made))


async def _discard(serving: Serving, made: Session) -> None:
    with contextlib.suppress(SessionError):  # best effort: the refusal is what the client hears
        await serving.off_loop(serving.store.discard_unused, made)


def _create(store: SessionStore, key: SessionKey, model_id: str, ttl_s: float) -> Session | None:
    """The session `key`, made with the breakpoint's TTL; None when it exists already (it keeps its own)."""
    try:
        return store.create(key, model_id, ttl_s)
    except SessionBusy:  # there already (another request may have made it meanwhile): as wanted
        return None


def read_message(req: MessagesRequest, arrival: Arrival) -> Turn:
    """A Messages API request as a turn: its conversation in chat's normal form, on the session it names, or as
    a node of a message thread (created, or continued from a previous message)."""
    named = session_key(req, arrival)
    if req.thread is not None and named is not None:
        message = "a thread holds its conversation itself: name a session or send a thread, not both"
        raise ApiError(400, "invalid_parameter", message, "thread")
    messages, ends = chat_of(req)
    ttl = req.cache_ttl()
    history: History = NamedSession()
    place: Place = WithTtl(ttl) if ttl is not None else OnNamed()
    if req.thread is not None:
        previous = req.continues
        history = threads.ThreadHistory(previous, *_choice(req)) if previous is not None else history
        place = threads.ThreadNode(previous)
    fmt = req.output_config.format if req.output_config is not None else None
    sampling = SamplingParams(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k or 0, stop=list(req.stop_sequences or [])
    )
    return Turn(
        req.model, arrival.tenant, arrival.request_id, named, history, place, MessageAnswer(num_marked(req, ends), ttl),
        messages=messages, tools=tool_use_of(req), sampling=sampling, max_tokens=req.max_tokens, stream=req.stream,
        schema=fmt.schema_ if fmt is not None else None, schema_param="output_config.format",
    )  # fmt: skip


def chat_of(req: Body) -> tuple[list[ChatMessage], list[int]]:
    """Chat's normal form of the conversation, and after each request message how many chat messages there are."""
    messages: list[ChatMessage] = []
    if req.system:
        text = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        messages.append({"role": "system", "content": text})
    ends = []
    for message in req.messages:
        blocks = message.content
        if isinstance(blocks, str):
            messages.append({"role": message.role, "content": blocks})
        elif message.role == "assistant":
            text = "".join(b.text for b in blocks if b.type == "text")
            calls = [tool_call(b.id, b.name, b.input) for b in blocks if isinstance(b, ToolUseBlock)]
            messages.append(assistant_message(text, calls))
        else:
            results = [b for b in blocks if isinstance(b, ToolResultBlock)]
            messages += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()} for b in results]
            text = "".join(b.text for b in blocks if b.type == "text")
            if text or not results:
                messages.append({"role": "user", "content": text})
        ends.append(len(messages))
    return messages, ends


def tool_use_of(req: Body) -> ToolUse | None:
    if not req.tools:
        return None
    specs = tuple(ToolSpec(t.name, t.description, t.input_schema or NO_PARAMETERS) for t in req.tools)
    return ToolUse(specs, *_choice(req))


def _choice(req: Body) -> tuple[str, str | None, bool]:
    """The request's tool_choice as ToolUse's (choice, function, parallel)."""
    choice, parallel = req.tool_choice, not (req.tool_choice and req.tool_choice.disable_parallel_tool_use)
    if choice is None or choice.type == "auto":
        return "auto", None, parallel
    if choice.type == "tool":
        return "function", choice.name, parallel
    return "required" if choice.type == "any" else "none", None, parallel


def num_marked(req: Body, ends: list[int]) -> int | None:
    """How many of the request's chat messages come before its last cache_control breakpoint (None: none)."""
    marked = [i for i, m in enumerate(req.messages) if not isinstance(m.content, str) and _has_mark(m.content)]
    if isinstance(req, MessagesRequest) and req.cache_control is not None:  # on the last block: all of it
        marked = [len(req.messages) - 1]
    if marked:
        return ends[marked[-1]]
    if (isinstance(req.system, list) and _has_mark(req.system)) or any(t.cache_control for t in req.tools or []):
        return 1 if req.system else 0
    return None


def prefix_len(loaded: LoadedModel, prefix: list[ChatMessage], tools: ToolUse | None) -> int:
    """The prefix's prompt tokens, rendered as the prompt renders them."""
    try:
        return len(continuation.tokenize(loaded, continuation.render(loaded, prefix, False, tools)))
    except ApiError:  # a template that cannot render the prefix alone: nothing is claimed
        return 0


def _has_mark(blocks: list[Any]) -> bool:
    return any(getattr(b, "cache_control", None) is not None for b in blocks)

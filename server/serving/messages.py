"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API on the same engine and sessions.

A request becomes chat's normal form: `system` a system message, text blocks content, an assistant's
`tool_use` blocks its tool calls, a user's `tool_result` blocks tool messages (before its text). So
a session (`X-Session-ID`, or kvserve's `session_id`) continues token-exactly as on chat, tools go
through the same rendering and grammar, and the reply read back is the message the session records.

`cache_control` needs nothing set up: every prompt's K/V is kept by prefix. A breakpoint says where
the cached part ends for the accounting Anthropic's clients read: tokens up to the last breakpoint
that were computed now are `cache_creation_input_tokens`, reused ones `cache_read_input_tokens`, the
rest `input_tokens`. Its `ttl` becomes the TTL of a session the request creates.

Message threads (`thread`, Anthropic's `message-threads` beta, which both of its SDKs' tool runners send): a
`create` keeps the turn as a node of the store (kind `message`, keyed by the answer's id, the tenant's, journaled
and shared like a stored response); a `continue` names a previous answer and sends only the new messages: the
node's conversation, `system` and tools are the prompt's start, continued token-exactly from its transcript and
K/V. Each message is continued once; unknown, foreign or unfinished ones are 404 `thread_not_found` (the SDKs then
replay the conversation as a new thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass
from typing import Any

from server.anthropic.schemas import Conversation as Body
from server.anthropic.schemas import CountTokensRequest, MessagesRequest, ToolResultBlock, ToolUseBlock
from server.engine.engine import Engine
from server.engine.request import SamplingParams
from server.models.loader import LoadedModel
from server.openai.errors import ApiError
from server.serving import continuation
from server.serving.core import Serving
from server.serving.pipeline import (
    Answer,
    Arrival,
    Conversation,
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
from server.sessions.errors import SessionBusy, SessionError, SessionNotFound
from server.sessions.record import CompletedTurn, Session, SessionKey
from server.sessions.store import SessionStore

THREAD_KIND = "message"  # a thread's node in the store: the answer it holds, keyed by that answer's id
MESSAGE_ID = r"^msg_[0-9a-f]{32}$"  # the ids this server gives answers (apis.py: its prefix and a uuid's hex)


class Messages:
    """The Messages API's resources beside its turns: count_tokens; and its threads' nodes, kept in the store."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        store = serving.store
        store.on_turn(THREAD_KIND, record_node)
        for key in store.session_keys(THREAD_KIND):  # nodes a previous run never finished: nothing continues them
            view = store.view(key)
            if view is not None and view.extras.get("status") == "in_progress":
                store.delete(key)

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
class ThreadHistory(History):
    """A thread continued (Anthropic's message threads): the conversation its node holds, `system` and the tools
    included, then the request's new messages; the prompt continues the node's transcript token-exactly. The tool
    choice is the request's own (a turn may change it), over the thread's tools."""

    previous_id: str
    choice: str = "auto"  # as ToolUse's
    function: str | None = None
    parallel: bool = True

    async def read(self, serving: Serving, engine: Engine, turn: Turn) -> Conversation:
        assert turn.messages is not None
        node = await serving.off_loop(thread_node, serving.store, turn.tenant, self.previous_id)
        if node is None or node.extras.get("status") != "completed":
            raise thread_not_found(self.previous_id)
        if node.model_id != engine.model_id:
            message = f"the thread was made with model {node.model_id!r}: continue it with that model"
            raise ApiError(400, "thread_fingerprint_mismatch", message, "model")
        return Conversation(node.messages + turn.messages, node, self._tools(node.tools))

    def _tools(self, definitions: list[dict[str, Any]] | None) -> ToolUse | None:
        specs = tuple(
            ToolSpec(d["function"]["name"], d["function"].get("description"), d["function"]["parameters"])
            for d in definitions or []
        )
        if self.choice in ("required", "function") and not any(
            self.choice == "required" or spec.name == self.function for spec in specs
        ):
            message = "tool_choice names a tool the thread does not have" if specs else "the thread has no tools"
            raise ApiError(400, "invalid_parameter", message, "tool_choice")
        return ToolUse(specs, self.choice, self.function, self.parallel) if specs else None


@dataclass(slots=True, frozen=True)
class ThreadNode(Place):
    """A thread's turn is a node of the store (kind `message`, keyed by the answer's id, the tenant's, kept like a
    stored response), the engine's session: it records the turn. A continue first marks its parent continued by
    this node: each message is continued once (a second continue is refused, and the client's SDK replays the
    conversation as a new thread)."""

    parent_id: str | None

    async def place(self, serving: Serving, engine: Engine, turn: Turn, num_tokens: int) -> Placement:
        store, key = serving.store, SessionKey(turn.tenant, turn.request_id, THREAD_KIND)
        serving.check_quota(key, num_tokens, engine)  # before the node exists
        parent = None
        if self.parent_id is not None:
            parent = SessionKey(turn.tenant, self.parent_id, THREAD_KIND)
            await serving.off_loop(claim, store, parent, key.name)
        ttl, extras = serving.settings.response_retention_s, {"status": "in_progress"}
        await serving.off_loop(store.create, key, engine.model_id, ttl, parent=self.parent_id, extras=extras)
        # A node whose turn did not complete goes (a parent it claimed is then free again: it names no node).
        return Placement(key, parent, lambda: serving.off_loop(store.delete, key))


def thread_node(store: SessionStore, tenant: str, message_id: str) -> Session | None:
    if not re.fullmatch(MESSAGE_ID, message_id):
        return None  # never one of ours: found nowhere
    return store.view(SessionKey(tenant, message_id, THREAD_KIND))


def claim(store: SessionStore, parent: SessionKey, child: str) -> None:
    """Mark the node `parent` continued by `child`, once: refused while another continue of it runs, and once one
    completed. A mark naming a node that no longer exists (its turn failed) is free."""
    node = store.view(parent)
    if node is None or node.extras.get("status") != "completed":
        raise thread_not_found(parent.name)
    held = node.extras.get("continued_by")
    other = store.view(SessionKey(parent.tenant, held, THREAD_KIND)) if isinstance(held, str) else None
    if other is not None and other.extras.get("status") == "in_progress":
        raise continue_in_flight(parent.name)
    if other is not None:
        message = f"message {parent.name!r} was continued already (by {held!r}); continue from the thread's latest"
        raise ApiError(400, "thread_already_continued", message, "thread.previous_message_id")
    try:
        store.mark(parent, "continued_by", child, held)
    except SessionNotFound as exc:
        raise thread_not_found(parent.name) from exc
    except SessionBusy as exc:  # another request marked it meanwhile (here or on another replica)
        raise continue_in_flight(parent.name) from exc


def record_node(extras: dict[str, Any], turn: CompletedTurn) -> None:
    """The store's hook for thread nodes: the turn completed, so the node can be continued."""
    extras.update(status="completed", finish_reason=turn.finish_reason)


def thread_not_found(message_id: str) -> ApiError:
    message = f"no thread holds message {message_id!r}; send the whole conversation with thread.type 'create'"
    return ApiError(404, "thread_not_found", message, "thread.previous_message_id")


def continue_in_flight(message_id: str) -> ApiError:
    message = f"another request is continuing message {message_id!r}; continue from its answer when it ends"
    return ApiError(400, "thread_continue_in_flight", message, "thread.previous_message_id")


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
        history = ThreadHistory(previous, *_choice(req)) if previous is not None else history
        place = ThreadNode(previous)
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

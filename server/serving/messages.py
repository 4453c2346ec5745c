"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API on the same engine and sessions.

A request becomes chat's normal form: `system` a system message, text blocks content, an assistant's
`tool_use` blocks its tool calls, a user's `tool_result` blocks tool messages (before its text). So
a session (`X-Session-ID`, or kvserve's `session_id`) continues token-exactly as on chat, tools go
through the same rendering and grammar, and the reply read back is the message the session records.

`cache_control` needs nothing set up: every prompt's K/V is kept by prefix. A breakpoint says where
the cached part ends for the accounting Anthropic's clients read: tokens up to the last breakpoint
that were computed now are `cache_creation_input_tokens`, reused ones `cache_read_input_tokens`, the
rest `input_tokens`. Its `ttl` becomes the TTL of a session the request creates.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

from fastapi import Request
from starlette.responses import Response

from server.anthropic.schemas import Conversation, CountTokensRequest, MessagesRequest, ToolResultBlock, ToolUseBlock
from server.engine.request import Admitted, SamplingParams
from server.models.loader import LoadedModel
from server.openai.errors import ApiError
from server.serving import continuation
from server.serving.core import Serving, session_key
from server.serving.pipeline import Placement, Renderer, Turn, run_turn
from server.serving.prompts import check_text_size
from server.serving.render.messages import MessageRenderer
from server.serving.tool_reader import Reading, ToolReader
from server.serving.tools import NO_PARAMETERS, ToolSpec, ToolUse, assistant_message, tool_call
from server.sessions.chat import ChatMessage
from server.sessions.errors import SessionBusy, SessionError
from server.sessions.record import Session, SessionKey


class Messages:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.store = serving.store

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        loaded = self.serving.engine(req.model).loaded
        messages, _ends = chat_of(req)
        check_text_size(loaded, [m["content"] for m in messages], "messages")
        ids = await asyncio.to_thread(continuation.prompt_ids, loaded, messages, None, tool_use_of(req))
        return {"input_tokens": len(ids)}

    async def create(self, req: MessagesRequest, http: Request, tenant: str) -> Response:
        serving = self.serving
        engine = serving.engine(req.model)
        loaded = engine.loaded
        key = session_key(req, http, tenant)
        ttl = req.cache_ttl()
        view = await serving.session_view(key, engine)
        messages, ends = chat_of(req)
        check_text_size(loaded, [m["content"] for m in messages], "messages")
        tools = tool_use_of(req)
        reading = Reading.of(loaded.tokenizer, tools, "msg_" + uuid.uuid4().hex, messages)
        prefix = marked_prefix(req, messages, ends)  # the prompt up to the last breakpoint (None: none)
        boundary = await asyncio.to_thread(prefix_len, loaded, prefix, tools) if prefix is not None else 0
        fmt = req.output_config.format if req.output_config is not None else None

        def sampling(budget: int) -> SamplingParams:
            return SamplingParams(
                max_tokens=budget, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k or 0,
                stop=list(req.stop_sequences or []),
            )  # fmt: skip

        async def place(num_tokens: int) -> Placement:
            session = serving.session_for(key, num_tokens, engine)
            named = session if session is not None and not session.is_bucket else None
            # Made only now, every check passed (the store checks the session quota again, under its lock); a
            # request the engine refuses takes it away again, so no empty leftover of it stays.
            made = None
            if named is not None and ttl is not None:
                made = await serving.off_loop(self._create, named, engine.model_id, ttl)
            return Placement(session, named, (lambda: self._discard(made)) if made is not None else None)

        def renderer(admitted: Admitted, reader: ToolReader) -> Renderer:
            return MessageRenderer(reading.request_id, engine.model_id, reader, boundary, admitted, ttl)

        turn = Turn(
            engine, tenant, reading, key, messages, req.max_tokens, sampling, renderer, req.stream, base=view,
            schema=fmt.schema_ if fmt is not None else None, schema_param="output_config.format", place=place,
        )  # fmt: skip
        return await run_turn(serving, turn, http)

    async def _discard(self, made: Session) -> None:
        with contextlib.suppress(SessionError):  # best effort: the refusal is what the client hears
            await self.serving.off_loop(self.store.discard_unused, made)

    def _create(self, key: SessionKey, model_id: str, ttl_s: float) -> Session | None:
        """The session `key`, made with the breakpoint's TTL; None when it exists already (it keeps its own)."""
        try:
            return self.store.create(key, model_id, ttl_s)
        except SessionBusy:  # there already (another request may have made it meanwhile): as wanted
            return None


def chat_of(req: Conversation) -> tuple[list[ChatMessage], list[int]]:
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


def tool_use_of(req: Conversation) -> ToolUse | None:
    if not req.tools:
        return None
    specs = tuple(ToolSpec(t.name, t.description, t.input_schema or NO_PARAMETERS) for t in req.tools)
    choice, parallel = req.tool_choice, not (req.tool_choice and req.tool_choice.disable_parallel_tool_use)
    if choice is None or choice.type == "auto":
        return ToolUse(specs, "auto", None, parallel)
    if choice.type == "tool":
        return ToolUse(specs, "function", choice.name, parallel)
    return ToolUse(specs, "required" if choice.type == "any" else "none", None, parallel)


def marked_prefix(req: Conversation, messages: list[ChatMessage], ends: list[int]) -> list[ChatMessage] | None:
    """The messages up to the last cache_control breakpoint (None: no breakpoint)."""
    marked = [i for i, m in enumerate(req.messages) if not isinstance(m.content, str) and _has_mark(m.content)]
    if isinstance(req, MessagesRequest) and req.cache_control is not None:  # on the last block: all of it
        marked = [len(req.messages) - 1]
    if marked:
        return messages[: ends[marked[-1]]]
    if (isinstance(req.system, list) and _has_mark(req.system)) or any(t.cache_control for t in req.tools or []):
        return messages[:1] if req.system else []
    return None


def prefix_len(loaded: LoadedModel, prefix: list[ChatMessage], tools: ToolUse | None) -> int:
    """The prefix's prompt tokens, rendered as the prompt renders them."""
    try:
        return len(continuation.tokenize(loaded, continuation.render(loaded, prefix, False, tools)))
    except ApiError:  # a template that cannot render the prefix alone: nothing is claimed
        return 0


def _has_mark(blocks: list[Any]) -> bool:
    return any(getattr(b, "cache_control", None) is not None for b in blocks)

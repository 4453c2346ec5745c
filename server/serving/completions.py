"""/v1/completions and /v1/chat/completions: prompt ids in, one JSON body or an SSE stream out."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fastapi import Request
from sse_starlette import EventSourceResponse, ServerSentEvent

from server.engine.engine import Engine
from server.engine.grammar import Constraint
from server.openai import chunks
from server.openai.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from server.serving import continuation, structured
from server.serving.answers import Answer
from server.serving.core import Serving, answer_headers, session_key
from server.serving.prompts import chat_messages, check_text_size, completion_ids, sampling_params
from server.serving.tool_reader import Reading
from server.serving.tools import tool_use
from server.sessions.record import Session, SessionKey

SEND_TIMEOUT_S = 60  # a client that accepts no bytes for this long is disconnected
PING_S = 15


@dataclass(slots=True, frozen=True)
class Ask:
    """What a chat or completion request asks of one model."""

    engine: Engine
    tenant: str
    key: SessionKey | None  # the session or bucket it names
    prompt_ids: list[int]
    messages: list[dict[str, Any]] | None  # chat: what the ids render (kept in the session record)
    reading: Reading  # how its reply is read (tool calls)
    constraint: Constraint | None = None  # its structured output's grammar (or the forced tool calls')


class Completions:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def completion(self, req: CompletionRequest, http: Request, tenant: str) -> Any:
        """OpenAI's semantics on a session too: the prompt is the whole text; the cached prefix it shares with
        the session's transcript is reused, and the transcript becomes this prompt and its completion."""
        engine = self.serving.engine(req.model)
        key = session_key(req, http, tenant)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            check_text_size(engine.loaded, [prompt], "prompt")
        ids = await asyncio.to_thread(completion_ids, req, engine.loaded)  # tokenizing: off the event loop
        constraint = await structured.constraint(engine, structured.format_schema(req.response_format), None, "")
        ask = Ask(engine, tenant, key, ids, None, Reading(None, "", "cmpl-" + uuid.uuid4().hex), constraint)
        return await self._run(req, http, ask, req.max_tokens, req.logprobs)

    async def chat(self, req: ChatCompletionRequest, http: Request, tenant: str) -> Any:
        engine = self.serving.engine(req.model)
        key = session_key(req, http, tenant)
        view = await self.serving.session_view(key, engine)
        messages = with_session_system(chat_messages(req), view)
        check_text_size(engine.loaded, [m["content"] for m in messages], "messages")
        tools = tool_use(req)
        ids = await asyncio.to_thread(continuation.prompt_ids, engine.loaded, messages, view, tools)  # off the loop
        reading = Reading.of(engine.loaded.tokenizer, tools, "chatcmpl-" + uuid.uuid4().hex)
        schema = structured.format_schema(req.response_format)
        constraint = await structured.constraint(engine, schema, tools, reading.style)
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        ask = Ask(engine, tenant, key, ids, messages, reading, constraint)
        return await self._run(req, http, ask, req.output_limit(), num_logprobs)

    async def _run(
        self, req: SamplingFields, http: Request, ask: Ask, max_tokens: int | None, num_logprobs: int | None
    ) -> Any:
        serving, s, engine = self.serving, self.serving.settings, ask.engine
        is_chat = ask.messages is not None
        num_prompt = len(ask.prompt_ids)
        params = sampling_params(
            req, engine.loaded, num_prompt, max_tokens, s.default_max_tokens, num_logprobs, s.max_tokens_limit
        )
        key = serving.session_for(ask.key, num_prompt + params.max_tokens, engine)
        request_id = ask.reading.request_id
        gen = serving.request(
            reading=ask.reading,
            prompt_ids=ask.prompt_ids,
            params=params,
            tenant=ask.tenant,
            session=key,
            kv_source=key if key is not None and not key.is_bucket else None,
            use_cache=req.cache_prompt,
            messages=ask.messages,
            constraint=ask.constraint,
        )
        started = time.monotonic()
        handle, admitted = await serving.start(engine, gen, http)
        events = serving.metrics.meter(handle, engine.model_id, started)
        meta = chunks.Meta(request_id, int(time.time()), engine.model_id, is_chat)
        headers = answer_headers(admitted, key)
        answer = Answer(handle, events, meta, _token_texts(engine.loaded.tokenizer), ask.reading.reader())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return event_stream(answer.stream(include_usage), headers)
        return await answer.collect(http, headers)


def event_stream(events: AsyncIterator[ServerSentEvent], headers: dict[str, str]) -> EventSourceResponse:
    return EventSourceResponse(events, headers=headers, sep="\n", ping=PING_S, send_timeout=SEND_TIMEOUT_S)


def with_session_system(messages: list[dict[str, Any]], view: Session | None) -> list[dict[str, Any]]:
    """A session created with a system prompt applies it to requests that bring none of their own."""
    if view is None or not view.turns[0].num_messages or messages[0]["role"] == "system":
        return messages
    return view.messages[: view.turns[0].num_messages] + messages


def _token_texts(tokenizer: Any) -> Callable[[int], str]:
    @lru_cache(maxsize=4096)
    def token_text(token_id: int) -> str:
        return str(tokenizer.decode([token_id]))

    return token_text

"""/v1/completions and /v1/chat/completions: prompt ids in, one JSON body or an SSE stream out."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from server.engine.engine import Engine
from server.engine.handle import RequestHandle
from server.engine.request import Event, Failed, Finished, TextDelta, TokenLogprob
from server.openai import chunks
from server.openai.errors import CODE_STATUS, ApiError, error_body
from server.openai.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from server.serving import continuation
from server.serving.core import SESSION_HEADER, Serving, cache_headers, cancel_on_disconnect, session_key
from server.serving.prompts import chat_messages, check_text_size, completion_ids, sampling_params
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


class Completions:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def completion(self, req: CompletionRequest, http: Request, tenant: str) -> Any:
        engine = self.serving.engine(req.model)
        key = session_key(req, http, tenant)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            check_text_size(engine.loaded, [prompt], "prompt")
        ids = await asyncio.to_thread(completion_ids, req, engine.loaded)  # tokenizing: off the event loop
        return await self._run(req, http, Ask(engine, tenant, key, ids, None), req.max_tokens, req.logprobs)

    async def chat(self, req: ChatCompletionRequest, http: Request, tenant: str) -> Any:
        engine = self.serving.engine(req.model)
        key = session_key(req, http, tenant)
        view = await self._view(key, engine)
        messages = with_session_system(chat_messages(req), view)
        check_text_size(engine.loaded, [m["content"] for m in messages], "messages")
        ids = await asyncio.to_thread(continuation.prompt_ids, engine.loaded, messages, view)  # off the loop
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        ask = Ask(engine, tenant, key, ids, messages)
        return await self._run(req, http, ask, req.output_limit(), num_logprobs)

    async def _view(self, key: SessionKey | None, engine: Engine) -> Session | None:
        """The named session as it is (None: no session, a bucket, or another model's: admission says so)."""
        is_named = key is not None and not key.is_bucket
        view = await self.serving.off_loop(self.serving.store.view, key) if is_named else None
        return view if view is not None and view.model_id == engine.model_id else None

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
        request_id = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex
        gen = serving.request(
            request_id=request_id,
            prompt_ids=ask.prompt_ids,
            params=params,
            tenant=ask.tenant,
            session=key,
            kv_source=key if key is not None and not key.is_bucket else None,
            use_cache=req.cache_prompt,
            messages=ask.messages,
        )
        started = time.monotonic()
        handle, admitted = await serving.start(engine, gen, http)
        events = serving.metrics.meter(handle, engine.model_id, started)
        meta = chunks.Meta(request_id, int(time.time()), engine.model_id, is_chat)
        headers = cache_headers(admitted)
        if key is not None and not key.is_bucket:
            headers[SESSION_HEADER] = key.name
        token_text = _token_texts(engine.loaded.tokenizer)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return event_stream(_sse(handle, events, meta, token_text, include_usage), headers)
        return await _collect(handle, events, http, meta, token_text, headers)


def event_stream(events: AsyncIterator[ServerSentEvent], headers: dict[str, str]) -> EventSourceResponse:
    return EventSourceResponse(events, headers=headers, sep="\n", ping=PING_S, send_timeout=SEND_TIMEOUT_S)


def failure(event: Failed) -> dict[str, Any]:
    return error_body(CODE_STATUS.get(event.code, 500), event.code, event.message)


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


async def _collect(
    handle: RequestHandle,
    events: AsyncIterator[Event],
    http: Request,
    meta: chunks.Meta,
    token_text: Callable[[int], str],
    headers: dict[str, str],
) -> JSONResponse:
    watcher = asyncio.create_task(cancel_on_disconnect(http, handle))
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    try:
        async for event in events:
            if isinstance(event, TextDelta):
                parts.append(event.text)
                logprobs.extend(event.logprobs or [])
            elif isinstance(event, Finished):
                lp = chunks.choice_logprobs(meta, logprobs if logprobs else None, token_text, 0)
                body = chunks.full_response(meta, "".join(parts), event.finish_reason, event.usage, lp)
                return JSONResponse(body, headers=headers)
            elif isinstance(event, Failed):
                return JSONResponse(failure(event), CODE_STATUS.get(event.code, 500), headers=headers)
    finally:
        watcher.cancel()
        handle.cancel()
    raise ApiError(500, "internal_error", "generation ended without a result")


async def _sse(
    handle: RequestHandle,
    events: AsyncIterator[Event],
    meta: chunks.Meta,
    token_text: Callable[[int], str],
    include_usage: bool,
) -> AsyncIterator[ServerSentEvent]:
    offset = 0
    try:
        if meta.is_chat:
            yield _data(chunks.delta_chunk(meta, "", role=True))
        async for event in events:
            if isinstance(event, TextDelta):
                lp = chunks.choice_logprobs(meta, event.logprobs, token_text, offset)
                offset += len(event.text)
                yield _data(chunks.delta_chunk(meta, event.text, logprobs=lp))
            elif isinstance(event, Finished):
                yield _data(chunks.delta_chunk(meta, None if meta.is_chat else "", event.finish_reason))
                if include_usage:
                    yield _data(chunks.usage_chunk(meta, event.usage))
            elif isinstance(event, Failed):
                yield _data(failure(event))
        yield ServerSentEvent(data="[DONE]", sep="\n")
    finally:
        handle.cancel()  # a client that went away stops its generation at the next step


def _data(obj: dict[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(obj, separators=(",", ":"), ensure_ascii=False), sep="\n")

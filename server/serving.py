"""Between the routes and the engine: admit a request, then answer as one JSON body or as SSE."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from functools import lru_cache

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse, ServerSentEvent

from server import continuation, formats
from server.engine.handle import RequestHandle
from server.engine.session import Entry
from server.engine.types import Admitted, EngineError, Failed, Finished, GenerationRequest, SessionKey, TextDelta
from server.engine.worker import Engine
from server.errors import ENGINE_STATUS, ApiError, error_body
from server.hosting import ModelHost
from server.metrics import Metrics
from server.prompts import Prompt, chat_messages, completion_ids, sampling_params
from server.schemas import SESSION_ID_PATTERN, ChatCompletionRequest, CompletionRequest, SamplingFields

log = logging.getLogger("kvserve.requests")
SESSION_HEADER = "X-Session-ID"
RETRY_AFTER_S = 1
SEND_TIMEOUT_S = 60  # a client that accepts no bytes for this long is disconnected


class Serving:
    def __init__(self, host: ModelHost, metrics: Metrics) -> None:
        self.host = host
        self.settings = host.settings
        self.metrics = metrics

    async def completion(self, req: CompletionRequest, http: Request, tenant: str):
        engine = self.engine(req.model)
        session = session_key(req, http, tenant)
        prompt = Prompt(completion_ids(req, engine.loaded), None)
        return await self._run(req, http, tenant, engine, session, prompt, req.max_tokens, req.logprobs)

    async def chat(self, req: ChatCompletionRequest, http: Request, tenant: str):
        engine = self.engine(req.model)
        session = session_key(req, http, tenant)
        view = self.host.store.view(session) if session and not session.is_bucket else None
        if view is not None and view.model_id != engine.model_id:
            view = None  # the engine answers session_model_mismatch
        messages = with_session_system(chat_messages(req), view)
        prompt = Prompt(continuation.prompt_ids(engine.loaded, messages, view), messages)
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return await self._run(req, http, tenant, engine, session, prompt, req.output_limit(), num_logprobs)

    def engine(self, model: str) -> Engine:
        state = self.host.states.get(model)
        if state is None:
            raise ApiError(404, "model_not_found", f"model {model!r} does not exist", "model")
        engine = self.host.engines.get(model)
        if engine is None:
            raise ApiError(503, "not_ready", f"model {model!r} is {state.status}: {state.detail}".rstrip(": "))
        return engine

    async def _run(self, req: SamplingFields, http, tenant, engine, session, prompt: Prompt, max_tokens, logprobs):
        is_chat = prompt.messages is not None
        loaded = engine.loaded
        num_prompt = len(prompt.ids)
        s = self.settings
        params = sampling_params(
            req, loaded, num_prompt, max_tokens, s.default_max_tokens, logprobs, s.max_tokens_limit
        )
        request_id = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex
        gen = GenerationRequest(
            request_id, prompt.ids, params, session, self.settings.request_timeout_s, tenant, req.cache_prompt
        )
        gen.messages = prompt.messages
        restore_from = session if session and not session.is_bucket else None
        started = time.monotonic()
        handle, admitted = await self.start(engine, gen, http, restore_from)
        events = self.metrics.meter(handle, engine.model_id, started)
        meta = formats.Meta(request_id, int(time.time()), engine.model_id, is_chat)
        headers = cache_headers(admitted)
        if session and not session.is_bucket:
            headers[SESSION_HEADER] = session.name
        token_text = _token_texts(loaded.tokenizer)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = _sse(handle, events, meta, token_text, include_usage)
            return EventSourceResponse(chunks, headers=headers, sep="\n", ping=15, send_timeout=SEND_TIMEOUT_S)
        return await _collect(handle, events, http, meta, token_text, headers)

    async def start(
        self, engine, gen: GenerationRequest, http: Request | None, restore_from: SessionKey | None
    ) -> tuple[RequestHandle, Admitted]:
        """Submit, and wait until the engine admits the request (so the cache headers can be honest).

        `restore_from`: the session whose lower-tier snapshot may hold this prompt's K/V.
        """
        if self.host.is_draining:
            raise ApiError(503, "shutting_down", "the server is shutting down; retry on another instance")
        if gen.session is not None and gen.session.is_bucket:
            gen.session = self._bucket_within_quota(gen.session)
        elif gen.session is not None:
            self.check_quota(gen.session, len(gen.prompt_ids) + gen.params.max_tokens, engine)
        gen.max_unread_events = self.settings.max_unread_events
        if restore_from is not None and gen.use_cache:
            gen.snapshot = await self._snapshot(engine, restore_from, gen)
        try:
            handle = engine.submit(gen)
        except EngineError as exc:
            status = ENGINE_STATUS.get(exc.code, 500)
            headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
            raise ApiError(status, exc.code, exc.message, headers=headers) from exc
        watcher = asyncio.create_task(cancel_on_disconnect(http, handle)) if http is not None else None
        try:
            first = await anext(handle)
        except BaseException:  # cancelled while queued (client gone, server stopping): stop the request too
            handle.cancel()
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
        if isinstance(first, Failed):
            raise ApiError(ENGINE_STATUS.get(first.code, 500), first.code, first.message)
        session = gen.session.name if gen.session else "-"
        log.info(
            "request %s admitted: tenant=%s session=%s prompt_tokens=%d cached=%d source=%s",
            gen.request_id,
            gen.tenant,
            session,
            first.num_prompt,
            first.num_cached,
            first.source,
        )  # ids and counts only: prompts are the tenants' data
        if self.settings.log_prompts:
            log.debug("request %s prompt ids: %s", gen.request_id, gen.prompt_ids)
        return handle, first

    def _bucket_within_quota(self, key: SessionKey) -> SessionKey | None:
        """A prompt_cache_key is a hint: past the tenant's limit of buckets the request just runs without one."""
        store = self.host.store
        num_buckets, _ = store.tenant_usage(key.tenant, exclude=key)
        is_new = not store.is_live(key)
        return None if is_new and num_buckets >= self.settings.max_sessions_per_tenant else key

    def check_quota(self, key: SessionKey, num_new_tokens: int, engine) -> None:
        """429 quota_exceeded when this session (new or growing) would take the tenant past its limits."""
        store, s = self.host.store, self.settings
        num_sessions, num_tokens = store.tenant_usage(key.tenant, exclude=key)
        if not store.is_live(key) and num_sessions >= s.max_sessions_per_tenant:
            message = (
                f"this tenant already has {num_sessions} sessions (limit {s.max_sessions_per_tenant}); delete some"
            )
            raise ApiError(429, "quota_exceeded", message)
        num_bytes = (num_tokens + num_new_tokens) * engine.token_bytes
        if num_bytes > s.max_tenant_kv_bytes:
            message = (
                f"this tenant's sessions would hold {num_bytes} bytes of K/V (limit {s.max_tenant_kv_bytes}); "
                "delete or rewind sessions"
            )
            raise ApiError(429, "quota_exceeded", message)

    async def _snapshot(self, engine, key: SessionKey, gen: GenerationRequest):
        """A snapshot worth restoring: one holding more of the prompt than the device pool does."""
        store, tiers = self.host.store, self.host.store.tiers
        info = store.info(key)
        if info is None or info.model_id != engine.model_id:
            return None  # another model's session: admission answers session_model_mismatch
        if tiers.peek_tokens(key) <= engine.cached_tokens(gen.tenant, gen.prompt_ids):
            return None
        return await asyncio.to_thread(tiers.fetch, key, engine.model_id, engine.fingerprint)


def with_session_system(messages: list[dict], view: Entry | None) -> list[dict]:
    """A session created with a system prompt applies it to requests that bring none of their own."""
    if view is None or not view.turns[0].num_messages or messages[0]["role"] == "system":
        return messages
    return view.messages[: view.turns[0].num_messages] + messages


def cache_headers(admitted: Admitted) -> dict[str, str]:
    """X-Cache: hit when every prompt token but the last was cached, miss when none was, partial otherwise."""
    if admitted.num_cached == 0:
        verdict = "miss"
    elif admitted.num_cached >= admitted.num_prompt - 1:
        verdict = "hit"
    else:
        verdict = "partial"
    return {"X-Cache": verdict, "X-Cache-Source": admitted.source}


def session_key(req: SamplingFields, http: Request, tenant: str) -> SessionKey | None:
    header = http.headers.get(SESSION_HEADER)
    if header is not None:
        if not re.fullmatch(SESSION_ID_PATTERN, header):
            raise ApiError(400, "invalid_parameter", "session ids are 1-128 characters of [A-Za-z0-9_-]", "session_id")
        if req.session_id is not None and req.session_id != header:
            raise ApiError(400, "invalid_parameter", "body session_id and X-Session-ID header differ", "session_id")
    name = req.session_id or header
    if name is not None:
        return SessionKey(tenant, name)
    if req.prompt_cache_key is not None:
        return SessionKey(tenant, req.prompt_cache_key, kind="bucket")
    return None


def _token_texts(tokenizer):
    @lru_cache(maxsize=4096)
    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return token_text


async def _collect(handle: RequestHandle, events, http: Request, meta, token_text, headers) -> JSONResponse:
    watcher = asyncio.create_task(cancel_on_disconnect(http, handle))
    parts, logprobs, offset = [], [], 0
    try:
        async for event in events:
            if isinstance(event, TextDelta):
                parts.append(event.text)
                logprobs.extend(event.logprobs or [])
            elif isinstance(event, Finished):
                lp = formats.choice_logprobs(meta, logprobs if logprobs else None, token_text, offset)
                body = formats.full_response(meta, "".join(parts), event.finish_reason, event.usage, lp)
                return JSONResponse(body, headers=headers)
            elif isinstance(event, Failed):
                status = ENGINE_STATUS.get(event.code, 500)
                return JSONResponse(error_body(status, event.code, event.message), status, headers=headers)
    finally:
        watcher.cancel()
        handle.cancel()
    raise ApiError(500, "internal_error", "generation ended without a result")


async def cancel_on_disconnect(http: Request, handle: RequestHandle) -> None:
    """The body is already read, so the next ASGI message is the client going away."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    handle.cancel()


async def _sse(handle: RequestHandle, events, meta, token_text, include_usage: bool) -> AsyncIterator[ServerSentEvent]:
    offset = 0
    try:
        if meta.is_chat:
            yield _data(formats.delta_chunk(meta, "", role=True))
        async for event in events:
            if isinstance(event, TextDelta):
                lp = formats.choice_logprobs(meta, event.logprobs, token_text, offset)
                offset += len(event.text)
                yield _data(formats.delta_chunk(meta, event.text, logprobs=lp))
            elif isinstance(event, Finished):
                yield _data(formats.delta_chunk(meta, None if meta.is_chat else "", event.finish_reason))
                if include_usage:
                    yield _data(formats.usage_chunk(meta, event.usage))
            elif isinstance(event, Failed):
                yield _data(error_body(ENGINE_STATUS.get(event.code, 500), event.code, event.message))
        yield ServerSentEvent(data="[DONE]", sep="\n")
    finally:
        handle.cancel()  # a client that went away stops its generation at the next step


def _data(obj: dict) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(obj, separators=(",", ":"), ensure_ascii=False), sep="\n")

"""What every generation endpoint shares: the model's engine, building the request, quotas, admission.

`Serving.request` is the one place a GenerationRequest is built. `Serving.start` submits it and
waits for the engine's Admitted event, so the cache headers are facts and a request refused at
admission gets a real status code instead of a stream that opens and fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request

from server.engine.engine import Engine
from server.engine.grammar import Constraint
from server.engine.handle import RequestHandle
from server.engine.request import Admitted, Failed, GenerationRequest, SamplingParams
from server.errors import Refused
from server.hosting import ModelHost
from server.metrics import Metrics
from server.openai.errors import ApiError
from server.serving.tool_reader import Reading
from server.sessions.chat import ChatMessage
from server.sessions.record import Session, SessionKey

log = logging.getLogger("kvserve.requests")
SESSION_HEADER = "X-Session-ID"

T = TypeVar("T")


class Serving:
    def __init__(self, host: ModelHost, metrics: Metrics) -> None:
        self.host = host
        self.settings = host.settings
        self.store = host.store
        self.metrics = metrics
        self._later: set[asyncio.Task[object]] = set()  # held until done: the loop keeps only weak references

    def later(self, work: Awaitable[object]) -> None:
        """Run `work` on the event loop without waiting for it (what a turn that ended unfinished takes back)."""

        async def run() -> object:
            return await work

        task = asyncio.get_running_loop().create_task(run())
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A session-store call, on a worker thread when the store is shared (it may wait on Redis), inline
        otherwise (one process: memory only, no thread hop)."""
        if self.store.is_shared:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    def engine(self, model: str) -> Engine:
        state = self.host.states.get(model)
        if state is None:
            raise ApiError(404, "model_not_found", f"model {model!r} does not exist", "model")
        engine = self.host.engines.get(model)
        if engine is None and state.status == "failed":  # for good: its files or settings need a person
            raise ApiError(503, "model_failed", state.detail or f"model {model!r} failed to load")
        if engine is None:
            raise ApiError(503, "not_ready", f"model {model!r} is {state.status}: {state.detail}".rstrip(": "))
        return engine

    def request(
        self,
        *,
        reading: Reading,
        prompt_ids: list[int],
        params: SamplingParams,
        tenant: str,
        session: SessionKey | None = None,
        kv_source: SessionKey | None = None,
        use_cache: bool = True,
        messages: list[ChatMessage] | None = None,
        constraint: Constraint | None = None,
    ) -> GenerationRequest:
        """The request the engine runs; `reading`: its id, and how its reply is read (a chat reply, with
        `messages`, is recorded as the message read out of it); `kv_source`: whose lower-tier snapshot may hold
        the prompt's K/V."""
        return GenerationRequest(
            request_id=reading.request_id,
            prompt_ids=prompt_ids,
            params=params,
            tenant=tenant,
            session=session,
            kv_source=kv_source if use_cache else None,
            use_cache=use_cache,
            messages=messages,
            timeout_s=self.settings.request_timeout_s,
            max_unread_events=self.settings.max_unread_events,
            constraint=constraint,
            tools=reading.tools.definitions() if reading.tools is not None else None,
            reply=reading.reply if messages is not None else None,
            shown_special_ids=reading.markers,
            reply_watch=reading.watch if reading.watches_repeats else None,
            banned_openings=reading.banned_openings,
        )

    async def start(
        self, engine: Engine, gen: GenerationRequest, http: Request | None
    ) -> tuple[RequestHandle, Admitted]:
        """Submit, and wait until the engine admits the request (its cached prefix is then known)."""
        if self.host.is_draining:
            raise ApiError(503, "shutting_down", "the server is shutting down; retry on another instance")
        try:
            handle = await engine.submit_async(gen)
        except Refused as exc:  # the engine's (queue full, too large) or the session store's (busy, other model)
            refused = ApiError.of(exc.code, exc.message)
            if gen.session is not None and not gen.session.is_bucket and refused.headers is not None:
                refused.headers[SESSION_HEADER] = gen.session.name  # the session to retry on
            raise refused from exc
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
            raise ApiError.of(first.code, first.message)
        assert isinstance(first, Admitted)
        log.info(
            "request %s admitted: tenant=%s session=%s prompt_tokens=%d cached=%d source=%s",
            gen.request_id,
            gen.tenant,
            gen.session.name if gen.session else "-",
            first.num_prompt,
            first.num_cached,
            first.source,
        )  # ids and counts only: prompts are the tenants' data
        if self.settings.log_prompts:
            log.debug("request %s prompt ids: %s", gen.request_id, gen.prompt_ids)
        return handle, first

    async def session_view(self, key: SessionKey | None, engine: Engine) -> Session | None:
        """The named session as it is (None: no session, a bucket, or another model's: admission says so)."""
        if key is None or key.is_bucket:
            return None
        view = await self.off_loop(self.store.view, key)
        return view if view is not None and view.model_id == engine.model_id else None

    def session_for(self, key: SessionKey | None, num_new_tokens: int, engine: Engine) -> SessionKey | None:
        """The session a request may use: a bucket past the tenant's limit is dropped, a session checked."""
        if key is None:
            return None
        if key.is_bucket:
            num_buckets, _ = self.store.tenant_usage(key.tenant, exclude=key)
            is_new = not self.store.is_live(key)
            return None if is_new and num_buckets >= self.settings.max_sessions_per_tenant else key
        self.check_quota(key, num_new_tokens, engine)
        return key

    def check_quota(self, key: SessionKey, num_new_tokens: int, engine: Engine) -> None:
        """429 quota_exceeded when this session (new or growing) would take the tenant past its limits."""
        s = self.settings
        num_sessions, num_tokens = self.store.tenant_usage(key.tenant, exclude=key)
        if not self.store.is_live(key) and num_sessions >= s.max_sessions_per_tenant:
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


def answer_headers(admitted: Admitted, session: SessionKey | None) -> dict[str, str]:
    """X-Cache: hit when every prompt token but the last was cached, miss when none was, partial otherwise; and
    the session the answer used (a bucket is not one)."""
    if admitted.num_cached == 0:
        verdict = "miss"
    elif admitted.num_cached >= admitted.num_prompt - 1:
        verdict = "hit"
    else:
        verdict = "partial"
    headers = {"X-Cache": verdict, "X-Cache-Source": admitted.source}
    if session is not None and not session.is_bucket:
        headers[SESSION_HEADER] = session.name
    return headers


async def cancel_on_disconnect(http: Request, handle: RequestHandle) -> None:
    """The body is already read, so the next ASGI message is the client going away."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    handle.cancel()

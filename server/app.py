"""The FastAPI application: state built in the lifespan from one Settings object, no globals."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI

from server import __version__
from server.hosting import ModelHost
from server.http import errors, openapi
from server.http.auth import KeyRing, announce, load_keys
from server.http.connections import throttle_accept_errors
from server.http.gate import Gate
from server.http.routes import (
    generation,
    health,
    messages,
    metrics,
    models,
    playground,
    responses,
    sessions,
    tokens,
)
from server.metrics import Metrics
from server.models.loader import ModelSpec
from server.serving.apis import GENERATION_PATHS
from server.serving.core import Serving
from server.serving.messages import Messages
from server.serving.responses import Responses
from server.serving.sessions import Sessions
from server.serving.tokens import Tokens
from server.settings import Settings
from server.startup import Startup

log = logging.getLogger("kvserve")
Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def lifespan_of(settings: Settings, specs: list[ModelSpec] | None, keys: KeyRing, startup: Startup | None) -> Lifespan:
    """Everything the app holds, built at start-up in app.state and closed at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        throttle_accept_errors(asyncio.get_running_loop())
        host = ModelHost(settings, specs, startup)
        app.state.host = host
        app.state.metrics = metrics = Metrics(host, GENERATION_PATHS)
        announce(keys, settings.host)
        app.state.serving = serving = Serving(host, metrics)
        app.state.sessions = Sessions(serving)
        app.state.responses = Responses(serving)
        app.state.tokens = Tokens(serving)
        app.state.messages = Messages(serving)
        host.start()
        try:
            yield
        finally:
            host.close()

    return lifespan


def create_app(
    settings: Settings | None = None,
    specs: list[ModelSpec] | None = None,
    keys: KeyRing | None = None,
    startup: Startup | None = None,
) -> FastAPI:
    """`specs` overrides what the settings name (tests pass a tiny local model); `keys`: the settings' API keys,
    loaded already (`kvserve serve` checks them with the other settings; else loaded here: KeysRefused);
    `startup`: the start-up the process's signals stop (server/startup.py)."""
    settings = settings or Settings()
    keys = keys if keys is not None else load_keys(settings.api_keys, settings.api_keys_file)
    app = FastAPI(
        title="kvserve",
        version=__version__,
        description="OpenAI-compatible text generation that continues sessions from their cached K/V.",
        lifespan=lifespan_of(settings, specs, keys, startup),
        docs_url=None,  # ours, served from a package: openapi.install
        redoc_url=None,
    )
    errors.install(app)
    open_paths = set(openapi.OPEN_PATHS) | (set() if settings.metrics_needs_key else {"/metrics"})
    open_paths |= playground.OPEN_PATHS if settings.playground else set()

    def count(route: str, status: int, seconds: float) -> None:
        if hasattr(app.state, "metrics"):
            app.state.metrics.on_response(route, status, seconds)

    app.add_middleware(
        Gate,
        keys=keys,
        max_body_bytes=settings.max_request_bytes,
        body_timeout_s=settings.body_timeout_s,
        open_paths=open_paths,
        on_response=count,
        replica=settings.replica_id,
    )
    openapi.install(app, settings.max_tokens_limit)
    if settings.playground:
        playground.install(app)
    routers = (generation, responses, messages, models, sessions, tokens, health, metrics)
    for router in (module.router for module in routers):
        app.include_router(router)
    return app

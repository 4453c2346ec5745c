"""The FastAPI application: state built in the lifespan from one Settings object, no globals."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from server import __version__
from server.api import chat, completions, errors, health, models, responses, sessions
from server.engine.registry import ModelSpec
from server.hosting import ModelHost
from server.responses import Responses
from server.serving import Serving
from server.sessions import Sessions
from server.settings import Settings

log = logging.getLogger("kvserve")


def create_app(settings: Settings | None = None, specs: list[ModelSpec] | None = None) -> FastAPI:
    """`specs` overrides what the settings name (tests pass a tiny local model)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        host = ModelHost(settings, specs)
        app.state.host = host
        app.state.serving = serving = Serving(host)
        app.state.sessions = Sessions(serving)
        app.state.responses = Responses(serving)
        host.start()
        try:
            yield
        finally:
            host.close()

    app = FastAPI(
        title="kvserve",
        version=__version__,
        description="OpenAI-compatible text generation that continues sessions from their cached K/V.",
        lifespan=lifespan,
    )
    errors.install(app)
    for router in (completions.router, chat.router, responses.router, models.router, sessions.router, health.router):
        app.include_router(router)
    return app

"""Per-request dependencies: the serving layer and the caller's tenant."""

from __future__ import annotations

from fastapi import Request

from server.hosting import ModelHost
from server.responses import Responses
from server.serving import Serving
from server.sessions import Sessions

DEFAULT_TENANT = "default"


def serving(request: Request) -> Serving:
    return request.app.state.serving


def sessions(request: Request) -> Sessions:
    return request.app.state.sessions


def responses(request: Request) -> Responses:
    return request.app.state.responses


def host(request: Request) -> ModelHost:
    return request.app.state.host


def tenant(request: Request) -> str:
    """One default tenant until API keys exist; every session lookup is already namespaced by it."""
    return DEFAULT_TENANT

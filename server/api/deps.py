"""Per-request dependencies: the serving layer and the caller's tenant."""

from __future__ import annotations

from fastapi import Request

from server.auth import DEFAULT_TENANT
from server.hosting import ModelHost
from server.responses import Responses
from server.serving import Serving
from server.sessions import Sessions


def serving(request: Request) -> Serving:
    return request.app.state.serving


def sessions(request: Request) -> Sessions:
    return request.app.state.sessions


def responses(request: Request) -> Responses:
    return request.app.state.responses


def host(request: Request) -> ModelHost:
    return request.app.state.host


def tenant(request: Request) -> str:
    """Set by the gate from the API key (the one default tenant when no keys are configured)."""
    return getattr(request.state, "tenant", DEFAULT_TENANT)

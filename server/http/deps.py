"""Per-request dependencies: the serving layer and the caller's tenant."""

from __future__ import annotations

from fastapi import Request

from server.hosting import ModelHost
from server.http.auth import DEFAULT_TENANT
from server.serving.core import Serving
from server.serving.messages import Messages
from server.serving.responses import Responses
from server.serving.sessions import Sessions
from server.serving.tokens import Tokens


def serving(request: Request) -> Serving:
    return request.app.state.serving


def sessions(request: Request) -> Sessions:
    return request.app.state.sessions


def responses(request: Request) -> Responses:
    return request.app.state.responses


def messages(request: Request) -> Messages:
    return request.app.state.messages


def tokens(request: Request) -> Tokens:
    return request.app.state.tokens


def host(request: Request) -> ModelHost:
    return request.app.state.host


def tenant(request: Request) -> str:
    """Set by the gate from the API key (the one default tenant when no keys are configured)."""
    return getattr(request.state, "tenant", DEFAULT_TENANT)

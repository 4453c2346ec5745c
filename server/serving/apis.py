"""The generation APIs, one spec each: every table that lists them (the routes, their error envelope, the OpenAPI
document's streams and session header, the metrics' generation routes) reads `APIS`.

Adding an API format is its wire schema (a folder like openai/ or anthropic/), its reader (a pure function of the
body into a `Turn`), its renderer (render/), one entry here, and its page in docs/api.md.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from server.anthropic.schemas import MessagesRequest
from server.openai.responses import ResponseRequest
from server.openai.schemas import ChatCompletionRequest, CompletionRequest
from server.serving.completions import read_chat, read_completion
from server.serving.messages import read_message
from server.serving.pipeline import Arrival, Turn
from server.serving.responses import read_response

Envelope = Literal["openai", "anthropic"]


@dataclass(slots=True, frozen=True)
class ApiSpec:
    name: str  # the operation's name (OpenAPI), e.g. create_chat_completion
    path: str  # POST here makes a turn; its resource routes (count_tokens, stored responses) live under it
    body: type[BaseModel]  # the request body, validated at the edge
    read: Callable[[Any, Arrival], Turn]  # the body and its arrival -> the turn (pure: no I/O)
    id_prefix: str  # of the request's id, which its answer carries
    summary: str
    streams: str  # what `stream: true` answers, in words
    envelope: Envelope = "openai"  # the error body its clients parse (on its resource routes too)
    tags: tuple[str, ...] = ()

    def new_id(self) -> str:
        return self.id_prefix + uuid.uuid4().hex


CHUNKS = "with stream: true, `data: {chunk}` events, then `data: [DONE]`"
APIS: tuple[ApiSpec, ...] = (
    ApiSpec(
        "create_completion", "/v1/completions", CompletionRequest, read_completion, "cmpl-",
        "Text completion (JSON or SSE), continuing a session's cached K/V", CHUNKS,
    ),
    ApiSpec(
        "create_chat_completion", "/v1/chat/completions", ChatCompletionRequest, read_chat, "chatcmpl-",
        "Chat completion (JSON or SSE), continuing a session's cached K/V", CHUNKS,
    ),
    ApiSpec(
        "create_response", "/v1/responses", ResponseRequest, read_response, "resp_",
        "Create a response (JSON or SSE events), continuing a previous one's K/V",
        "with stream: true, `event: <type>` / `data: {event}` pairs (response.created ... response.completed)",
        tags=("responses",),
    ),
    ApiSpec(
        "create_message", "/v1/messages", MessagesRequest, read_message, "msg_",
        "Anthropic Messages API (JSON or SSE), continuing a session's cached K/V",
        "with stream: true, Anthropic's events (message_start ... message_stop)", "anthropic", ("anthropic",),
    ),
)  # fmt: skip
GENERATION_PATHS = tuple(api.path for api in APIS)


def api_under(path: str) -> ApiSpec | None:
    """The API a request path belongs to (its turns' path or a resource route under it), if any."""
    return next((api for api in APIS if path == api.path or path.startswith(api.path + "/")), None)


def envelope_of(path: str) -> Envelope:
    api = api_under(path)
    return api.envelope if api is not None else "openai"

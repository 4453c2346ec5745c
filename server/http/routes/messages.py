"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API (errors in its envelope)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from server.anthropic.schemas import CountTokensRequest, MessagesRequest
from server.http import deps
from server.serving.messages import Messages

router = APIRouter(tags=["anthropic"])


@router.post("/v1/messages", summary="Anthropic Messages API (JSON or SSE), continuing a session's cached K/V")
async def create_message(
    body: MessagesRequest,
    request: Request,
    messages: Messages = Depends(deps.messages),
    tenant: str = Depends(deps.tenant),
):
    request.state.model = body.model  # the failure series' label, should it be refused
    return await messages.create(body, request, tenant)


@router.post("/v1/messages/count_tokens", summary="The input tokens a Messages API request would have")
async def count_tokens(body: CountTokensRequest, messages: Messages = Depends(deps.messages)) -> dict:
    return await messages.count_tokens(body)

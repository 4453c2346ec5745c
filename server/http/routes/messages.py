"""POST /v1/messages/count_tokens: the Anthropic Messages API's token count (its messages are a generation route)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from server.anthropic.schemas import CountTokensRequest
from server.http import deps
from server.serving.messages import Messages

router = APIRouter(tags=["anthropic"])


@router.post("/v1/messages/count_tokens", summary="The input tokens a Messages API request would have")
async def count_tokens(body: CountTokensRequest, messages: Messages = Depends(deps.messages)) -> dict:
    return await messages.count_tokens(body)

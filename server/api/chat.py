from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from server.api import deps
from server.schemas import ChatCompletionRequest
from server.serving import Serving

router = APIRouter()


@router.post("/v1/chat/completions", summary="Chat completion (JSON or SSE), continuing a session's cached K/V")
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    serving: Serving = Depends(deps.serving),
    tenant: str = Depends(deps.tenant),
):
    return await serving.chat(body, request, tenant)

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from server.http import deps
from server.openai.schemas import ChatCompletionRequest
from server.serving.completions import Completions

router = APIRouter()


@router.post("/v1/chat/completions", summary="Chat completion (JSON or SSE), continuing a session's cached K/V")
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    completions: Completions = Depends(deps.completions),
    tenant: str = Depends(deps.tenant),
):
    request.state.model = body.model  # the failure series' label, should it be refused
    return await completions.chat(body, request, tenant)

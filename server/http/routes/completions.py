from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from server.http import deps
from server.openai.schemas import CompletionRequest
from server.serving.completions import Completions

router = APIRouter()


@router.post("/v1/completions", summary="Text completion (JSON or SSE), continuing a session's cached K/V")
async def create_completion(
    body: CompletionRequest,
    request: Request,
    completions: Completions = Depends(deps.completions),
    tenant: str = Depends(deps.tenant),
):
    request.state.model = body.model  # the failure series' label, should it be refused
    return await completions.completion(body, request, tenant)

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from server.api import deps
from server.schemas import CompletionRequest
from server.serving import Serving

router = APIRouter()


@router.post("/v1/completions", summary="Text completion (JSON or SSE), continuing a session's cached K/V")
async def create_completion(
    body: CompletionRequest,
    request: Request,
    serving: Serving = Depends(deps.serving),
    tenant: str = Depends(deps.tenant),
):
    return await serving.completion(body, request, tenant)

"""/v1/responses/{id}: stored responses, read, listed and deleted (creating one is a generation route)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Path, Query

from server.http import deps
from server.serving.responses import Responses

router = APIRouter(tags=["responses"])
# Any id that is not stored is a 404, as OpenAI answers (clients catch NotFoundError); only its length is bounded.
ResponsePath = Path(..., max_length=256, description="the response id")


@router.get("/v1/responses/{response_id}", summary="A stored response")
def get_response(  # a plain def: FastAPI runs it on a worker thread (the store may wait on Redis)
    response_id: str = ResponsePath,
    responses: Responses = Depends(deps.responses),
    tenant: str = Depends(deps.tenant),
) -> dict:
    return responses.get(response_id, tenant)


@router.get("/v1/responses/{response_id}/input_items", summary="The input items a stored response was given")
def list_input_items(  # a plain def: FastAPI runs it on a worker thread (the store may wait on Redis)
    response_id: str = ResponsePath,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = Query("desc", description="desc: newest first (OpenAI's default)"),
    after: str | None = Query(None, max_length=256, description="an item id: list the ones after it"),
    responses: Responses = Depends(deps.responses),
    tenant: str = Depends(deps.tenant),
) -> dict:
    return responses.input_items(response_id, tenant, limit, order, after)


@router.delete("/v1/responses/{response_id}", summary="Delete a stored response and its K/V snapshots")
def delete_response(  # a plain def: FastAPI runs it on a worker thread (the store may wait on Redis)
    response_id: str = ResponsePath,
    responses: Responses = Depends(deps.responses),
    tenant: str = Depends(deps.tenant),
) -> dict:
    return responses.delete(response_id, tenant)

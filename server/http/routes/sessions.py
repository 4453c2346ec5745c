"""/v1/sessions: explicit sessions with a prefilled system prompt, per-tier memory reports, fork and rewind."""

from __future__ import annotations

from fastapi import APIRouter, Body, Depends, Path, Query, Response

from server.http import deps
from server.openai.schemas import SessionCreate, SessionFork, SessionRewind
from server.serving.sessions import MAX_LIST, Sessions
from server.sessions.record import SessionKey
from server.wire import SESSION_ID_PATTERN

router = APIRouter(tags=["sessions"])
SESSION_EXAMPLE = {
    "id": "sess_3f0c9a7e5b1d4c2e8f6a0b1c2d3e4f50",
    "object": "session",
    "model": "smollm2-135m-instruct",
    "created_at": 1795958056,
    "last_used_at": 1795958061.2,
    "expires_at": 1795961661,
    "turns": 2,
    "transcript_tokens": 88,
    "system_tokens": 21,
    "cached_tokens": 87,
    "in_use": False,
    "parent": None,
    "cache": {
        "device": {"tokens": 87, "bytes": 98304, "exclusive_bytes": 49152, "shared_bytes": 49152},
        "host": {"tokens": 0, "bytes": 0, "exclusive_bytes": 0, "shared_bytes": 0},
        "disk": {"tokens": 87, "bytes": 4096512, "exclusive_bytes": 4096512, "shared_bytes": 0},
    },
}


def _example(status: int, example: dict) -> dict:
    return {status: {"content": {"application/json": {"example": example}}}}


LIST_EXAMPLE = {"object": "list", "data": [SESSION_EXAMPLE], "has_more": False, "last_id": SESSION_EXAMPLE["id"]}
DELETED_EXAMPLE = {"id": SESSION_EXAMPLE["id"], "object": "session.deleted", "deleted": True}
SessionPath = Path(..., pattern=SESSION_ID_PATTERN, description="the session id")


@router.post(
    "/v1/sessions", status_code=201, summary="Create a session (server-generated id), prefilling its system prompt"
)
async def create_session(
    body: SessionCreate = Body(default_factory=SessionCreate),
    sessions: Sessions = Depends(deps.sessions),
    tenant: str = Depends(deps.tenant),
) -> dict:
    return await sessions.create(body, tenant)


@router.get("/v1/sessions", summary="The caller's sessions, oldest first", responses=_example(200, LIST_EXAMPLE))
async def list_sessions(
    limit: int = Query(100, ge=1, le=MAX_LIST),
    after: str | None = Query(None, pattern=SESSION_ID_PATTERN, description="a session id: list the ones after it"),
    sessions: Sessions = Depends(deps.sessions),
    tenant: str = Depends(deps.tenant),
) -> Response:
    return Response(await sessions.list_page(tenant, limit, after), media_type="application/json")


@router.get(
    "/v1/sessions/{session_id}",
    summary="A session: turns, cached tokens and bytes per tier, expiry",
    responses=_example(200, SESSION_EXAMPLE),
)
async def get_session(
    session_id: str = SessionPath,
    sessions: Sessions = Depends(deps.sessions),
    tenant: str = Depends(deps.tenant),
) -> dict:
    return await sessions.describe(SessionKey(tenant, session_id))


@router.delete(
    "/v1/sessions/{session_id}",
    summary="Forget a session: transcript and K/V on every tier",
    responses=_example(200, DELETED_EXAMPLE),
)
def delete_session(  # a plain def: FastAPI runs it on a worker thread (the store may wait on Redis)
    session_id: str = SessionPath,
    sessions: Sessions = Depends(deps.sessions),
    tenant: str = Depends(deps.tenant),
) -> dict:
    return sessions.delete(SessionKey(tenant, session_id))


@router.post(
    "/v1/sessions/{session_id}/fork",
    status_code=201,
    summary="Branch a new session after turn k",
    responses=_example(201, SESSION_EXAMPLE | {"parent": "sess_0a1b2c3d4e5f60718293a4b5c6d7e8f9"}),
)
async def fork_session(
    session_id: str = SessionPath,
    body: SessionFork = Body(default_factory=SessionFork),
    sessions: Sessions = Depends(deps.sessions),
    tenant: str = Depends(deps.tenant),
) -> dict:
    return await sessions.fork(SessionKey(tenant, session_id), body.turn, body.ttl_s)


@router.post(
    "/v1/sessions/{session_id}/rewind", summary="Drop the turns after turn k", responses=_example(200, SESSION_EXAMPLE)
)
async def rewind_session(
    body: SessionRewind,
    session_id: str = SessionPath,
    sessions: Sessions = Depends(deps.sessions),
    tenant: str = Depends(deps.tenant),
) -> dict:
    return await sessions.rewind(SessionKey(tenant, session_id), body.turn)

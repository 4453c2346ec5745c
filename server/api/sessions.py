"""/v1/sessions: explicit sessions with a prefilled system prompt, per-tier memory reports, fork and rewind."""

from __future__ import annotations

from fastapi import APIRouter, Body, Depends, Path, Query

from server.api import deps
from server.engine.types import SessionKey
from server.schemas import SESSION_ID_PATTERN, SessionCreate, SessionFork, SessionRewind
from server.sessions import MAX_LIST, Sessions

router = APIRouter(tags=["sessions"])
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


@router.get("/v1/sessions", summary="The caller's sessions, oldest first")
async def list_sessions(
    limit: int = Query(100, ge=1, le=MAX_LIST),
    after: str | None = Query(None, pattern=SESSION_ID_PATTERN, description="a session id: list the ones after it"),
    sessions: Sessions = Depends(deps.sessions),
    tenant: str = Depends(deps.tenant),
) -> dict:
    return sessions.list(tenant, limit, after)


@router.get("/v1/sessions/{session_id}", summary="A session: turns, cached tokens and bytes per tier, expiry")
async def get_session(
    session_id: str = SessionPath,
    sessions: Sessions = Depends(deps.sessions),
    tenant: str = Depends(deps.tenant),
) -> dict:
    return sessions.describe(SessionKey(tenant, session_id))


@router.delete("/v1/sessions/{session_id}", summary="Forget a session: transcript and K/V on every tier")
async def delete_session(
    session_id: str = SessionPath,
    sessions: Sessions = Depends(deps.sessions),
    tenant: str = Depends(deps.tenant),
) -> dict:
    return sessions.delete(SessionKey(tenant, session_id))


@router.post("/v1/sessions/{session_id}/fork", status_code=201, summary="Branch a new session after turn k")
async def fork_session(
    session_id: str = SessionPath,
    body: SessionFork = Body(default_factory=SessionFork),
    sessions: Sessions = Depends(deps.sessions),
    tenant: str = Depends(deps.tenant),
) -> dict:
    return sessions.fork(SessionKey(tenant, session_id), body.turn, body.ttl_s)


@router.post("/v1/sessions/{session_id}/rewind", summary="Drop the turns after turn k")
async def rewind_session(
    body: SessionRewind,
    session_id: str = SessionPath,
    sessions: Sessions = Depends(deps.sessions),
    tenant: str = Depends(deps.tenant),
) -> dict:
    return sessions.rewind(SessionKey(tenant, session_id), body.turn)

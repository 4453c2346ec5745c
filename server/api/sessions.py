from __future__ import annotations

from fastapi import APIRouter, Depends, Path

from server.api import deps
from server.engine.types import SessionKey
from server.errors import ApiError
from server.hosting import ModelHost
from server.schemas import SESSION_ID_PATTERN

router = APIRouter()
SessionPath = Path(..., pattern=SESSION_ID_PATTERN, description="the session id")


def _not_found(session_id: str) -> ApiError:
    # Unknown and foreign ids answer alike: no way to probe another tenant's sessions.
    return ApiError(404, "session_not_found", f"no session {session_id!r}", "session_id")


@router.get("/v1/sessions/{session_id}", summary="A session's cached tokens, bytes, turns and last use")
async def get_session(
    session_id: str = SessionPath,
    host: ModelHost = Depends(deps.host),
    tenant: str = Depends(deps.tenant),
) -> dict:
    key = SessionKey(tenant, session_id)
    info = host.store.info(key)
    if info is None:
        raise _not_found(session_id)
    engine = host.engines.get(info.model_id)
    num_cached, nbytes = engine.residency(key, host.store.transcript(key)) if engine else (0, 0)
    return {
        "id": info.session_id,
        "object": "session",
        "model": info.model_id,
        "turns": info.num_turns,
        "transcript_tokens": info.num_transcript_tokens,
        "cached_tokens": num_cached,
        "bytes": nbytes,
        "in_use": info.is_in_use,
        "last_used_at": round(info.last_use, 3),
    }


@router.delete("/v1/sessions/{session_id}", summary="Forget a session: transcript and cached K/V")
async def delete_session(
    session_id: str = SessionPath,
    host: ModelHost = Depends(deps.host),
    tenant: str = Depends(deps.tenant),
) -> dict:
    if not host.store.delete(SessionKey(tenant, session_id)):
        raise _not_found(session_id)
    return {"id": session_id, "object": "session.deleted", "deleted": True}

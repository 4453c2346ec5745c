from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from server.hosting import ModelHost, ModelState
from server.http import deps
from server.openai.errors import error_body

router = APIRouter()


@router.get("/health", summary="Liveness: the process answers")
async def health() -> dict:
    return {"status": "ok"}


@router.get(
    "/ready",
    summary="Readiness: 200 once every model has loaded or failed and one at least serves ('degraded' when one "
    "failed), else 503 saying why",
)
async def ready(host: ModelHost = Depends(deps.host)) -> JSONResponse:
    models = {mid: {"status": s.status, "detail": s.detail or None} for mid, s in host.states.items()}
    if host.is_draining:
        body = error_body(503, "shutting_down", "shutting down: finishing the requests already running")
        return JSONResponse({**body, "models": models}, status_code=503)
    if host.is_ready:
        # A model that failed to load does not hold the others back: restarting would not load it either (its
        # files or settings are wrong), and they serve. The body names it and why.
        failed = host.failures
        answer: dict = {"status": "degraded" if failed else "ready", "models": models}
        if failed:
            answer["message"] = f"serving {len(models) - len(failed)} of {len(models)} models; " + "; ".join(
                failed.values()
            )
        shared = host.store.leases.is_up
        if shared is not None:  # a replica without its shared store still serves what needs none of it
            answer["shared_store"] = "up" if shared else "down"
        return JSONResponse(answer)
    body = error_body(503, "not_ready", "not ready: " + "; ".join(_why(mid, s) for mid, s in host.states.items()))
    return JSONResponse({**body, "models": models}, status_code=503)


def _why(model_id: str, state: ModelState) -> str:
    if state.status == "failed" and state.detail:  # names the model, its source and the cause
        return state.detail
    return f"{model_id} is {state.status}" + (f" ({state.detail})" if state.detail else "")

from __future__ import annotations

from fastapi import APIRouter, Depends

from server.hosting import ModelHost
from server.http import deps

router = APIRouter()


@router.get("/v1/models", summary="Configured models and whether each is ready")
async def list_models(host: ModelHost = Depends(deps.host)) -> dict:
    data = []
    for model_id, state in host.states.items():
        engine = host.engines.get(model_id)
        data.append(
            {
                "id": model_id,
                "object": "model",
                "created": 0,
                "owned_by": "kvserve",
                "status": state.status,
                "max_model_len": engine.loaded.max_context if engine else None,
            }
        )
    return {"object": "list", "data": data}

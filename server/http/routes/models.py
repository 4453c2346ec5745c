from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from server import memory
from server.engine.engine import Engine
from server.hosting import ModelHost
from server.http import deps
from server.openai.errors import ApiError

router = APIRouter()
FINGERPRINT_PARTS = ("kv_fingerprint", "kv_layout", "weights_digest", "config_digest", "tokenizer_digest")


@router.get("/v1/models", summary="Configured models and whether each is ready")
async def list_models(host: ModelHost = Depends(deps.host)) -> dict:
    return {"object": "list", "data": [model_object(host, model_id) for model_id in host.states]}


@router.get(
    "/v1/models/{model_id:path}",
    summary="One model: readiness, context length, dtype, K/V size and fingerprint, the memory it holds",
)
async def get_model(model_id: str, host: ModelHost = Depends(deps.host)) -> dict:
    if model_id not in host.states:
        raise ApiError(404, "model_not_found", f"model {model_id!r} does not exist", "model")
    engine = host.engines.get(model_id)
    # off the event loop: which of the pool's pages are in RAM is asked of the OS (2 ms for a 4 GiB pool here)
    resident = await asyncio.to_thread(_resident, engine) if engine else None
    return model_object(host, model_id) | {"resident_bytes": resident}


def _resident(engine: Engine) -> dict[str, int | None]:
    """What the model holds in memory by part, their total, and the whole process's resident set beside them."""
    return engine.resident().as_dict() | {"process_rss": memory.process_rss()}


def model_object(host: ModelHost, model_id: str) -> dict:
    """OpenAI's model object, plus what a client sizing its requests wants to know (null until loaded)."""
    engine = host.engines.get(model_id)
    loaded = engine.loaded if engine else None
    return {
        "id": model_id,
        "object": "model",
        "created": 0,
        "owned_by": "kvserve",
        "status": host.states[model_id].status,
        "detail": host.states[model_id].detail or None,  # why it failed, or what loading is doing
        "max_model_len": loaded.max_context if loaded else None,
        "dtype": str(loaded.dtype).removeprefix("torch.") if loaded else None,
        "dtype_reason": loaded.dtype_reason if loaded else None,
        "device": loaded.device.type if loaded else None,
        "kv_bytes_per_token": engine.token_bytes if engine else None,
        "kv_dtype": _name(engine.runner.layout.storage_dtype) if engine else None,
        "tier_kv_dtypes": {t: _name(x.storage_dtype) for t, x in engine.offloader.layouts.items()} if engine else None,
        "deterministic": engine.runner.deterministic_detail if engine else None,
        "attention": _attention(engine) if engine else None,
        "compiled": engine.runner.compiled is not None if engine else None,  # what really runs its steps
        "compile_detail": engine.runner.compile_detail if engine else None,
        "cuda_graphs": engine.runner.graphs_detail if engine else None,
        **_fingerprint(host, model_id),
    }


def _attention(engine: Engine) -> dict:
    """How its steps attend (server/kv/backends.py): the backend chosen at load, and what it does."""
    backend = engine.runner.backend
    return {"backend": backend.name, "detail": backend.detail}


def _name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _fingerprint(host: ModelHost, model_id: str) -> dict:
    """The K/V fingerprint and its parts (null until loaded), and the other replicas that serve this id, as this
    one last saw them in the shared store (null without one): a replica with another fingerprint shares no K/V."""
    engine = host.engines.get(model_id)
    parts: dict = engine.fingerprint_parts if engine else dict.fromkeys(FINGERPRINT_PARTS)
    shared = engine.offloader.shared_fingerprint if engine else None  # what its blocks in Redis are addressed by
    board = host.fingerprints
    peers = board.peers(model_id) if board is not None and engine else None
    return parts | {"shared_kv_fingerprint": shared, "other_replicas": peers}

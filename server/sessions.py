"""Sessions as a resource: create (with a prefilled system prompt), list, describe, fork, rewind, delete."""

from __future__ import annotations

import secrets
import uuid

from server import continuation
from server.engine.types import EngineError, Failed, GenerationRequest, SamplingParams, SessionKey
from server.errors import ENGINE_STATUS, ApiError
from server.schemas import SessionCreate
from server.serving import Serving

MAX_LIST = 1000


def new_session_id() -> str:
    return "sess_" + secrets.token_hex(16)  # 128 random bits


def not_found(session_id: str) -> ApiError:
    # Unknown and foreign ids answer alike: no way to probe another tenant's sessions.
    return ApiError(404, "session_not_found", f"no session {session_id!r}", "session_id")


class Sessions:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.host = serving.host
        self.store = serving.host.store

    async def create(self, body: SessionCreate, tenant: str) -> dict:
        model = body.model or next(iter(self.host.states))
        engine = self.serving.engine(model)
        key = SessionKey(tenant, new_session_id())
        self.serving.check_quota(key, 0, engine)
        if body.system is None:
            self.store.create(key, engine.model_id, body.ttl_s)
            return self.describe(key)
        loaded = engine.loaded
        messages = [{"role": "system", "content": body.system}]
        ids = continuation.tokenize(loaded, continuation.render(loaded, messages, add_generation_prompt=False))
        if len(ids) >= loaded.max_context:
            message = f"the system prompt has {len(ids)} tokens; this model's context is {loaded.max_context}"
            raise ApiError(400, "context_length_exceeded", message, "system")
        self.store.create(key, engine.model_id, body.ttl_s)
        try:
            await self._prefill(engine, key, ids, messages)
        except BaseException:
            self.store.delete(key)
            raise
        return self.describe(key)

    async def _prefill(self, engine, key: SessionKey, ids: list[int], messages: list[dict]) -> None:
        """Compute the system prompt's K/V now: a request that generates nothing and sets the session's base."""
        timeout = self.host.settings.request_timeout_s
        gen = GenerationRequest(f"prefill-{uuid.uuid4().hex}", ids, SamplingParams(max_tokens=0), key, timeout)
        gen.tenant, gen.messages = key.tenant, messages
        handle, _admitted = await self.serving.start(engine, gen, None, None)
        try:
            async for event in handle:
                if isinstance(event, Failed):
                    raise ApiError(ENGINE_STATUS.get(event.code, 500), event.code, event.message)
        finally:
            handle.cancel()  # a no-op once finished; stops the prefill when this request is cancelled

    def describe(self, key: SessionKey, with_sharing: bool = True) -> dict:
        """`with_sharing=False` (lists) skips the exclusive/shared split, which walks the tenant's other sessions."""
        info = self.store.info(key)
        if info is None or info.key.kind != key.kind:
            raise not_found(key.name)
        engine = self.host.engines.get(info.model_id)
        transcript = self.store.transcript(key)
        if engine is not None:
            others = self.store.others(key, info.model_id) if with_sharing else []
            device = engine.residency(key, transcript, others)
            device_tokens, exclusive, shared = device.num_tokens, device.exclusive_bytes, device.shared_bytes
        else:
            device_tokens = exclusive = shared = 0
        lower = self.store.tiers.usage(key)
        device_usage = _tier(device_tokens, exclusive, shared)
        if not with_sharing:
            device_usage["exclusive_bytes"] = device_usage["shared_bytes"] = None
        return {
            "id": key.name,
            "object": "session",
            "model": info.model_id,
            "created_at": int(info.created_at),
            "last_used_at": round(info.last_use, 3),
            "expires_at": int(info.expires_at),
            "turns": info.num_turns,
            "transcript_tokens": info.num_transcript_tokens,
            "system_tokens": info.num_base_tokens,
            "cached_tokens": max(device_tokens, lower.host_tokens, lower.disk_tokens),
            "in_use": info.is_in_use,
            "parent": info.parent,
            "cache": {
                "device": device_usage,
                "host": _tier(lower.host_tokens, lower.host_bytes, 0),  # snapshots are per session
                "disk": _tier(lower.disk_tokens, lower.disk_bytes, 0),
            },
        }

    def list(self, tenant: str, limit: int, after: str | None) -> dict:
        infos = self.store.list(tenant)
        if after is not None:
            names = [i.key.name for i in infos]
            infos = infos[names.index(after) + 1 :] if after in names else []
        page = infos[:limit]
        return {
            "object": "list",
            "data": [self.describe(i.key, with_sharing=False) for i in page],
            "has_more": len(infos) > limit,
            "last_id": page[-1].key.name if page else None,
        }

    def fork(self, key: SessionKey, turn: int | None, ttl_s: float | None) -> dict:
        info = self.store.info(key)
        if info is None:
            raise not_found(key.name)
        new_key = SessionKey(key.tenant, new_session_id())
        engine = self.host.engines.get(info.model_id)
        if engine is not None:
            self.serving.check_quota(new_key, info.num_transcript_tokens, engine)
        self._engine_call(self.store.fork, key, new_key, info.num_turns if turn is None else turn, ttl_s)
        return self.describe(new_key)

    def rewind(self, key: SessionKey, turn: int) -> dict:
        self._engine_call(self.store.rewind, key, turn)
        return self.describe(key)

    def delete(self, key: SessionKey) -> dict:
        if not self.store.delete(key):
            raise not_found(key.name)
        return {"id": key.name, "object": "session.deleted", "deleted": True}

    def _engine_call(self, fn, key: SessionKey, *args):
        try:
            return fn(key, *args)
        except EngineError as exc:
            if exc.code == "session_not_found":
                raise not_found(key.name) from exc
            raise ApiError(ENGINE_STATUS.get(exc.code, 400), exc.code, exc.message, "turn") from exc


def _tier(num_tokens: int, exclusive: int, shared: int) -> dict:
    return {"tokens": num_tokens, "bytes": exclusive + shared, "exclusive_bytes": exclusive, "shared_bytes": shared}

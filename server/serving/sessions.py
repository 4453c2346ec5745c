"""Sessions as a resource: create (with a prefilled system prompt), list, describe, fork, rewind, delete.

A session's device K/V is reported by its model's engine (asked on its thread, never read from
here); its host and disk snapshots by the tiers.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from server.engine.engine import Engine
from server.engine.request import Failed, SamplingParams
from server.models.loader import LoadedModel
from server.openai.errors import ApiError
from server.openai.schemas import SessionCreate
from server.serving import continuation
from server.serving.core import Serving
from server.serving.prompts import check_text_size
from server.serving.tool_reader import Reading
from server.sessions.chat import ChatMessage
from server.sessions.errors import SessionError
from server.sessions.index import Reach
from server.sessions.record import SessionInfo, SessionKey, Turn

MAX_LIST = 1000
T = TypeVar("T")
Asked = tuple[SessionKey, list[int], Reach | None]  # a session, its transcript, whom it shares blocks with


class Device(NamedTuple):
    """A session's K/V in its engine's pool, as the sessions API reports it."""

    num_tokens: int
    exclusive_bytes: int
    shared_bytes: int


def new_session_id() -> str:
    return "sess_" + secrets.token_hex(16)  # 128 random bits


def not_found(session_id: str) -> ApiError:
    # Unknown and foreign ids answer alike: no way to probe another tenant's sessions.
    return ApiError(404, "session_not_found", f"no session {session_id!r}", "session_id")


class Sessions:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.host = serving.host
        self.store = serving.store

    async def create(self, body: SessionCreate, tenant: str) -> dict[str, Any]:
        model = body.model or next(iter(self.host.states))
        engine = self.serving.engine(model)
        key = SessionKey(tenant, new_session_id())
        self.serving.check_quota(key, 0, engine)
        if body.system is None:
            await self.serving.off_loop(self.store.create, key, engine.model_id, body.ttl_s)
            return await self.describe(key)
        loaded = engine.loaded
        messages: list[ChatMessage] = [{"role": "system", "content": body.system}]
        check_text_size(loaded, [body.system], "system")
        ids = await asyncio.to_thread(_render_ids, loaded, messages)  # off the event loop
        if len(ids) >= loaded.max_context:
            message = f"the system prompt has {len(ids)} tokens; this model's context is {loaded.max_context}"
            raise ApiError(400, "context_length_exceeded", message, "system")
        self.serving.check_quota(key, len(ids), engine)  # the system prompt's K/V counts toward the tenant's
        # The base is recorded with the session: a prefill-only request makes no turn and changes no record.
        base = {"transcript_ids": list(ids), "messages": messages, "turns": [Turn(len(ids), len(messages))]}
        await self.serving.off_loop(self.store.create, key, engine.model_id, body.ttl_s, **base)
        try:
            await self._prefill(engine, key, ids, messages)
        except BaseException:
            self.store.delete(key)
            raise
        return await self.describe(key)

    async def _prefill(self, engine: Engine, key: SessionKey, ids: list[int], messages: list[ChatMessage]) -> None:
        """Compute the system prompt's K/V now (the session's base): a request that generates nothing."""
        gen = self.serving.request(
            reading=Reading.plain(f"prefill-{uuid.uuid4().hex}"),
            prompt_ids=ids,
            params=SamplingParams(max_tokens=0),
            tenant=key.tenant,
            session=key,
            messages=messages,
        )
        handle, _admitted = await self.serving.start(engine, gen, None)
        try:
            async for event in handle:
                if isinstance(event, Failed):
                    raise ApiError.of(event.code, event.message)
        finally:
            handle.cancel()  # a no-op once finished; stops the prefill when this request is cancelled

    async def describe(self, key: SessionKey) -> dict[str, Any]:
        info = await self.serving.off_loop(self.store.info, key)
        if info is None or info.key.kind != key.kind:
            raise not_found(key.name)
        (device,) = await self._residency([info], with_sharing=True)
        return self._body(info, device, with_sharing=True)

    async def list_page(self, tenant: str, limit: int, after: str | None) -> bytes:
        """A page of the tenant's sessions, as JSON. Up to 1,000 records: read, rendered and encoded on worker
        threads, so that a lister holds the event loop for no longer than a thread switch."""
        page, has_more = await asyncio.to_thread(self.store.page, tenant, "session", limit, after)
        devices = await self._residency(page, with_sharing=False)

        def encode() -> bytes:
            data = [self._body(info, device, with_sharing=False) for info, device in zip(page, devices, strict=True)]
            last_id = page[-1].key.name if page else None
            body = {"object": "list", "data": data, "has_more": has_more, "last_id": last_id}
            return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()

        return await asyncio.to_thread(encode)

    async def _residency(self, infos: list[SessionInfo], with_sharing: bool) -> list[Device]:
        """Each session's K/V in its engine's pool; one question per engine, asked on its thread.

        `with_sharing=False` (lists) does not ask who else reaches the blocks: shared bytes are not reported.
        """
        found = [Device(0, 0, 0)] * len(infos)
        by_model: dict[str, list[int]] = {}
        for index, info in enumerate(infos):
            by_model.setdefault(info.model_id, []).append(index)
        for model_id, indices in by_model.items():
            engine = self.host.engines.get(model_id)
            if engine is None:
                continue
            keys = [infos[i].key for i in indices]
            items = await asyncio.to_thread(self._residency_items, keys, model_id, with_sharing)
            for index, usage in zip(indices, await engine.residency(items), strict=True):
                bb = engine.block_bytes
                found[index] = Device(usage.num_tokens, usage.num_exclusive * bb, usage.num_shared * bb)
        return found

    def _residency_items(self, keys: list[SessionKey], model_id: str, with_sharing: bool) -> list[Asked]:
        """What the engine needs to measure each session's K/V (its transcript; whom it shares blocks with)."""
        items = []
        for key in keys:
            transcript = self.store.transcript(key)
            items.append((key, transcript, self.store.reach(key, model_id, transcript) if with_sharing else None))
        return items

    def _body(self, info: SessionInfo, device: Device, with_sharing: bool) -> dict[str, Any]:
        lower = self.host.tiers.usage(info.key)
        device_usage = _tier(device.num_tokens, device.exclusive_bytes, device.shared_bytes)
        if not with_sharing:
            device_usage["exclusive_bytes"] = device_usage["shared_bytes"] = None
        return {
            "id": info.key.name,
            "object": "session",
            "model": info.model_id,
            "created_at": int(info.created_at),
            "last_used_at": round(info.last_use, 3),
            "expires_at": int(info.expires_at),
            "turns": info.num_turns,
            "transcript_tokens": info.num_transcript_tokens,
            "system_tokens": info.num_base_tokens,
            "cached_tokens": max(device.num_tokens, lower.host_tokens, lower.disk_tokens),
            "in_use": info.is_in_use,
            "parent": info.parent,
            "cache": {
                "device": device_usage,
                "host": _tier(lower.host_tokens, lower.host_bytes, 0),  # host snapshots are per session
                "disk": _tier(lower.disk_tokens, lower.disk_bytes, lower.disk_shared_bytes),  # blocks: shared ones too
            },
        }

    async def fork(self, key: SessionKey, turn: int | None, ttl_s: float | None) -> dict[str, Any]:
        """A new session holding `key`'s first turns; its K/V is found by prefix (blocks shared with the parent)."""
        parent = await self.serving.off_loop(self.store.view, key)
        if parent is None:
            raise not_found(key.name)
        new_key = SessionKey(key.tenant, new_session_id())
        engine = self.host.engines.get(parent.model_id)
        if engine is not None:
            self.serving.check_quota(new_key, len(parent.transcript_ids), engine)
        fields = _refusing(lambda: parent.branch(parent.num_turns if turn is None else turn), key)
        ttl = parent.ttl_s if ttl_s is None else ttl_s
        await self.serving.off_loop(_refusing, lambda: self.store.create(new_key, parent.model_id, ttl, **fields), key)
        return await self.describe(new_key)

    async def rewind(self, key: SessionKey, turn: int) -> dict[str, Any]:
        await self.serving.off_loop(_refusing, lambda: self.store.rewind(key, turn), key)
        return await self.describe(key)

    def delete(self, key: SessionKey) -> dict[str, Any]:
        if not self.store.delete(key):
            raise not_found(key.name)
        return {"id": key.name, "object": "session.deleted", "deleted": True}


def _render_ids(loaded: LoadedModel, messages: list[ChatMessage]) -> list[int]:
    return continuation.tokenize(loaded, continuation.render(loaded, messages, add_generation_prompt=False))


def _refusing(change: Callable[[], T], key: SessionKey) -> T:
    """A store change, its refusals as API errors (a busy session 409, a turn out of range 400)."""
    try:
        return change()
    except SessionError as exc:
        if exc.code == "session_not_found":
            raise not_found(key.name) from exc
        raise ApiError.of(exc.code, exc.message, "turn" if exc.code == "invalid_parameter" else None) from exc


def _tier(num_tokens: int, exclusive: int, shared: int) -> dict[str, Any]:
    return {"tokens": num_tokens, "bytes": exclusive + shared, "exclusive_bytes": exclusive, "shared_bytes": shared}

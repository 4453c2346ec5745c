"""The engine of one model: its thread, and what the event loop may ask of it.

The thread runs an EngineLoop (server/engine/loop.py), which owns the model, its K/V pool and
the block bookkeeping. The event loop talks to the engine only through `submit`, `query` and the
published `stats`: it never takes a lock of the pool's or reads the scheduler's state.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from server.engine.config import EngineConfig
from server.engine.handle import RequestHandle
from server.engine.inbox import Inbox, Query, Submission
from server.engine.loop import EngineLoop, EngineStats
from server.engine.model_runner import ForwardCounter, ModelRunner
from server.engine.request import EngineStopped, GenerationRequest, QueueFull, TooLarge
from server.engine.scheduler import Scheduler
from server.kv.blocks import BlockManager, Residency
from server.kv.offload import Offloader
from server.kv.tiers import TierStore
from server.models.loader import LoadedModel
from server.sessions.record import SessionKey
from server.sessions.store import SessionStore

log = logging.getLogger("kvserve.engine")
T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class DeviceUsage:
    num_tokens: int
    exclusive_bytes: int
    shared_bytes: int


class Engine:
    def __init__(self, loaded: LoadedModel, store: SessionStore, tiers: TierStore, config: EngineConfig) -> None:
        self.loaded, self.model_id, self.store, self.config = loaded, loaded.spec.id, store, config
        self.runner = ModelRunner(loaded, config.budget_bytes, config.block_size)
        self.fingerprint = self.runner.fingerprint
        self.token_bytes = self.runner.layout.bytes_per_token
        self.block_bytes = self.token_bytes * config.block_size
        self.blocks = BlockManager(self.runner.pool.num_blocks, config.block_size)
        self.offloader = Offloader(self.runner.pool, self.blocks, store, tiers, self.model_id, self.fingerprint)
        self.scheduler = Scheduler(self.blocks, config, self.offloader)
        self._inbox = Inbox()
        self.loop = EngineLoop(loaded, store, self.runner, self.blocks, self.offloader, self.scheduler, self._inbox)
        self._num_submitted = 0  # written by the event loop only
        self._thread = threading.Thread(target=self.loop.run, name=f"engine-{self.model_id}", daemon=True)
        pool = self.runner.pool
        log.info(
            "model %s: paged K/V pool of %d blocks x %d tokens (%.0f MiB)",
            self.model_id,
            pool.num_blocks,
            pool.block_size,
            pool.nbytes / 2**20,
        )

    # -- any thread --------------------------------------------------------------------------
    @property
    def counter(self) -> ForwardCounter:
        return self.runner.counter

    @property
    def stats(self) -> EngineStats:
        return self.loop.stats

    @property
    def num_active(self) -> int:
        """Requests submitted and not answered for good yet (queued, waiting or running)."""
        return self._num_submitted - self.loop.num_done

    # -- the event loop ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Lock the request's session and queue it. Raises at once what can be known at once."""
        if self._inbox.is_closed:
            raise EngineStopped("the server is shutting down")
        num_tokens = len(request.prompt_ids) + request.params.max_tokens
        if -(-num_tokens // self.config.block_size) > self.blocks.num_blocks:
            raise TooLarge(f"{num_tokens} tokens need more K/V memory than the pool holds")
        if self._inbox.qsize() + self.stats.num_waiting >= self.config.max_queue:
            raise QueueFull(f"{self.config.max_queue} requests are already waiting; retry shortly")
        session = self.store.acquire(request.session, self.model_id) if request.session else None
        handle = RequestHandle(request.request_id, asyncio.get_running_loop(), request.max_unread_events)
        self._inbox.put(Submission(request, session, handle))
        self._num_submitted += 1
        return handle

    async def query(self, fn: Callable[[], T]) -> T:
        """`fn()` run on the engine thread between steps (or here, once the engine has stopped)."""
        if not self._thread.is_alive():
            return fn()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._inbox.put(Query(fn, future))
        return await future

    async def residency(self, items: list[tuple[SessionKey, list[int], list[list[int]]]]) -> list[DeviceUsage]:
        """For each (session, transcript, the tenant's other transcripts): its K/V in the pool, in tokens and
        bytes split into exclusive and shared (held by another running sequence or reached by another session).
        """
        found: list[Residency] = await self.query(lambda: [self.blocks.residency(k.tenant, t, o) for k, t, o in items])
        return [
            DeviceUsage(r.num_tokens, r.num_exclusive * self.block_bytes, r.num_shared * self.block_bytes)
            for r in found
        ]

    def stop(self, timeout_s: float = 30.0) -> None:
        self._inbox.close()
        self._thread.join(timeout_s)

    def save_sessions(self) -> int:
        """Once stopped: every idle session's K/V in the pool goes down to the tiers."""
        if self._thread.is_alive():
            raise RuntimeError("save_sessions needs a stopped engine: the engine thread owns the pool")
        return self.offloader.save_all()

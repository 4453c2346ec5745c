"""The engine of one model: its thread, and what the event loop may ask of it.

The thread runs an EngineLoop (server/engine/loop.py), which owns the model, its K/V pool and
the block bookkeeping. The event loop talks to the engine only through `submit`, `query`, the
published `stats` and `residency` (the block books read while at rest, `BlockManager.read`): it never
takes a lock of the pool's or reads the scheduler's state.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from server import memory
from server.engine.config import EngineConfig
from server.engine.grammar import Grammars
from server.engine.handle import RequestHandle
from server.engine.inbox import Inbox, Query, Submission
from server.engine.loop import EngineLoop, EngineStats
from server.engine.model_runner import ForwardCounter, ModelRunner
from server.engine.openings import OpeningBans
from server.engine.request import EngineBusy, EngineStopped, GenerationRequest, QueueFull, TooLarge
from server.engine.resident import ResidentBytes
from server.engine.scheduler import Scheduler
from server.kv.blocks import BlockManager, BooksBusy, Residency
from server.kv.offload import Offloader
from server.kv.pool import stored_dtype
from server.kv.tiers import TierStore
from server.models.loader import LoadedModel
from server.sessions.index import Reach
from server.sessions.record import Session, SessionKey
from server.sessions.store import SessionStore
from server.startup import Startup

log = logging.getLogger("kvserve.engine")
QUERY_TIMEOUT_S = 30.0
T = TypeVar("T")


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        store: SessionStore,
        tiers: TierStore,
        config: EngineConfig,
        startup: Startup | None = None,
    ) -> None:
        """`startup`: what may ask the engine's construction to stop between its phases (StartupStopped)."""
        self.loaded, self.model_id, self.store, self.config = loaded, loaded.spec.id, store, config
        kv_dtype = stored_dtype(config.kv_dtype, loaded.dtype, loaded.device)
        self.runner = ModelRunner(
            loaded,
            config.budget_bytes,
            config.block_size,
            config.compile_dir,
            kv_dtype,
            config.deterministic,
            config.attention,
            config.max_batch_tokens if config.cuda_graphs else 0,
            startup,
        )
        self.fingerprint = self.runner.fingerprint
        self.token_bytes = self.runner.layout.bytes_per_token
        self.block_bytes = self.token_bytes * config.block_size
        self.blocks = BlockManager(self.runner.pool.num_blocks, config.block_size)
        digests = self.runner.digests.text
        self.offloader = Offloader(self.runner.pool, self.blocks, store, tiers, self.model_id, digests)
        self.scheduler = Scheduler(self.blocks, config, self.offloader)
        self._inbox = Inbox()
        self.grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_ids)
        self.loop = EngineLoop(loaded, store, self.runner, self.blocks, self.offloader, self.scheduler, self._inbox)
        self.loop.grammars = self.grammars
        self.openings = OpeningBans(loaded.tokenizer, loaded.vocab_size, loaded.eos_ids, loaded.device)
        self.loop.openings = self.openings
        self._num_submitted = 0  # written by the event loop only
        self.query_timeout_s = QUERY_TIMEOUT_S
        self._thread = threading.Thread(target=self.loop.run, name=f"engine-{self.model_id}", daemon=True)
        pool = self.runner.pool
        self._tiers = tiers
        self._pool_bytes = pool.nbytes
        self._pool_regions = tuple(pool.host_regions())  # fixed: the pool is allocated once, for the engine's life
        log.info(
            "model %s: paged K/V pool of %d blocks x %d tokens (%.0f MiB); K/V fingerprint %s (%s, %s)",
            self.model_id,
            pool.num_blocks,
            pool.block_size,
            pool.nbytes / 2**20,
            self.fingerprint,
            self.runner.layout.describe,
            self.runner.digests.text,
        )

    # -- any thread --------------------------------------------------------------------------
    @property
    def counter(self) -> ForwardCounter:
        return self.runner.counter

    @property
    def fingerprint_parts(self) -> dict[str, str]:
        """The K/V fingerprint and what it digests: GET /v1/models/{id} shows it, replicas announce it."""
        digests = self.runner.digests
        return {
            "kv_fingerprint": self.fingerprint,
            "kv_layout": self.runner.layout.describe,
            "weights_digest": digests.weights,
            "config_digest": digests.config,
            "tokenizer_digest": digests.tokenizer,
        }

    @property
    def shared_parts(self) -> dict[str, str]:
        """What this replica's K/V blocks in Redis are addressed by, beyond the model: the fingerprint of the form
        the shared tier keeps them in, that form, and the block size. Replicas share blocks where all three are
        equal (their K/V fingerprints may differ: an 8-bit pool's blocks are a bf16 pool's blocks kept in int8)."""
        return {
            "shared_kv_fingerprint": self.offloader.shared_fingerprint,
            "shared_kv_layout": self.offloader.layouts["shared"].describe,
            "block_size": str(self.config.block_size),
        }

    @property
    def is_running(self) -> bool:
        """Its thread runs: started, and not stopped yet."""
        return self._thread.is_alive()

    @property
    def stats(self) -> EngineStats:
        return self.loop.stats

    def resident(self) -> ResidentBytes:
        """What this model holds in memory now, by part: the weights as they were at load, the pool (and which of
        its pages are in RAM: the OS is asked, 2 ms for a 4 GiB pool here, so call it off the event loop), the kept
        head layouts the engine thread last published, this model's snapshots in host RAM."""
        weights = self.runner.weights
        touched = memory.resident_bytes(self._pool_regions) if self._pool_regions else None
        return ResidentBytes(
            weights=weights.dense,
            packed_weights=weights.packed,
            gemv_weights=weights.gemv,
            kv_pool=self._pool_bytes,
            head_layouts=self.stats.head_layout_bytes,
            host_tier=self._tiers.host_bytes(self.model_id),
            kv_pool_touched=touched,
        )

    @property
    def num_active(self) -> int:
        """Requests submitted and not answered for good yet (queued, waiting or running); never less than the truth:
        the engine thread publishes what it answered after each step."""
        return self._num_submitted - self.stats.num_done

    @property
    def num_queued(self) -> int:
        """Submitted and not running yet: in the inbox, waiting for blocks or reading a snapshot."""
        return max(0, self.num_active - self.stats.num_running)

    # -- the event loop ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Lock the request's session and queue it. Raises at once what can be known at once."""
        self._check(request)
        is_chat = request.messages is not None
        session = self.store.acquire(request.session, self.model_id, is_chat) if request.session else None
        return self._queue(request, session)

    async def submit_async(self, request: GenerationRequest) -> RequestHandle:
        """`submit`, with the session locked on a worker thread when that needs the shared store (Redis round
        trips stay off the event loop). A caller cancelled meanwhile leaves the session released. The first
        request that bans openings has every token's text read on a worker thread, not the engine's."""
        if request.banned_openings and not self.openings.is_ready(request.banned_openings):
            await asyncio.to_thread(self.openings.prepare, request.banned_openings)
        if request.session is None or request.session.is_bucket or not self.store.is_shared:
            return self.submit(request)
        self._check(request)
        is_chat = request.messages is not None
        locking = asyncio.ensure_future(asyncio.to_thread(self.store.acquire, request.session, self.model_id, is_chat))
        try:
            session = await asyncio.shield(locking)
        except asyncio.CancelledError:
            locking.add_done_callback(self._release_unused)
            raise
        return self._queue(request, session)

    def _release_unused(self, locking: asyncio.Future[Session | None]) -> None:
        session = None if locking.cancelled() or locking.exception() is not None else locking.result()
        if session is not None:
            self.store.release(session)

    def _check(self, request: GenerationRequest) -> None:
        if self._inbox.is_closed:
            raise EngineStopped("the server is shutting down")
        num_tokens = len(request.prompt_ids) + request.params.max_tokens
        if -(-num_tokens // self.config.block_size) > self.blocks.num_blocks:
            raise TooLarge(f"{num_tokens} tokens need more K/V memory than the pool holds")
        if self.num_queued >= self.config.max_queue:
            raise QueueFull(f"{self.config.max_queue} requests are already waiting; retry shortly")

    def _queue(self, request: GenerationRequest, session: Session | None) -> RequestHandle:
        handle = RequestHandle(request.request_id, asyncio.get_running_loop(), request.max_unread_events)
        self._num_submitted += 1  # before the engine thread can answer it
        self._inbox.put(Submission(request, session, handle))
        return handle

    async def query(self, fn: Callable[[], T]) -> T:
        """`fn()` run on the engine thread between steps (or here, once the engine has stopped).

        The answer waits for the step in progress (a long prefill chunk can take a second on a CPU);
        an engine that does not answer within `query_timeout_s` raises EngineBusy (503).
        """
        if not self._thread.is_alive():
            return fn()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._inbox.put(Query(fn, future))
        try:
            return await asyncio.wait_for(future, self.query_timeout_s)
        except asyncio.TimeoutError:
            message = f"the engine of model {self.model_id!r} did not answer within {self.query_timeout_s:g} s"
            raise EngineBusy(message) from None

    async def residency(self, items: list[tuple[SessionKey, list[int], Reach | None]]) -> list[Residency]:
        """For each (session, transcript, how much of it another transcript shares): its K/V in the pool, in
        tokens and in blocks only it reaches or shared (`BlockManager.residency`); transcripts with no tokens
        hold nothing and are not asked about.

        Read on a worker thread while the books are at rest, never waiting for the step in progress (a
        prefill can hold the engine thread for seconds): each session's answer is of one moment at rest,
        a page's answers of moments a few steps apart at most.
        """
        asked = [i for i, (_, transcript, _) in enumerate(items) if transcript]
        found = [Residency(0, 0, 0)] * len(items)
        if asked:
            blocks, deadline_s = self.blocks, self.query_timeout_s

            def read(index: int) -> Residency:
                key, transcript, reach = items[index]
                return blocks.read(lambda: blocks.residency(key.tenant, transcript, reach), deadline_s)

            try:
                answers = await asyncio.to_thread(lambda: [read(i) for i in asked])
            except BooksBusy:
                message = f"the engine of model {self.model_id!r} kept its books busy for {deadline_s:g} s"
                raise EngineBusy(message) from None
            for index, answer in zip(asked, answers, strict=True):
                found[index] = answer
        return found

    def close(self) -> None:
        """Ask the engine thread to stop after its current step (requests still there answer 503)."""
        self._inbox.close()

    def stop(self, timeout_s: float = 30.0) -> None:
        self.close()
        self._thread.join(timeout_s)

    def save_sessions(self) -> int:
        """Once stopped: every idle session's K/V in the pool goes down to the tiers."""
        if self._thread.is_alive():
            raise RuntimeError("save_sessions needs a stopped engine: the engine thread owns the pool")
        return self.offloader.save_all()

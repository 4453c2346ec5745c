"""The engine: one thread per model owns the model, its K/V pool and its block bookkeeping.

A step is: schedule (admit what fits, plan one packed row), run (one forward pass), post-process
(sample each sequence, push its text), finish (journal completed turns, give blocks back). The
event loop talks to it only through `submit`, `query` and `stats`: it never takes a lock of the
pool's or reads the scheduler's state.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from server.engine.handle import RequestHandle
from server.engine.inbox import WAKE, Inbox, Query, Submission
from server.engine.model_runner import ForwardCounter, ModelRunner
from server.engine.request import (
    CANCELLED,
    SHUTTING_DOWN,
    SLOW_READER,
    Admitted,
    EngineStopped,
    Failed,
    Finished,
    GenerationRequest,
    QueueFull,
    TooLarge,
)
from server.engine.scheduler import Admission, Row, Scheduler, SchedulerConfig
from server.engine.sequence import Sequence
from server.kv import offload
from server.kv.blocks import BlockManager
from server.kv.offload import Offloader
from server.kv.tiers import TierStore
from server.models.loader import LoadedModel
from server.sessions.record import Session, SessionKey
from server.sessions.store import SessionStore

log = logging.getLogger("kvserve.engine")
RECORD_FAILED = Failed("internal_error", "the turn could not be recorded; the session is as before it")
T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    budget_bytes: int  # the paged pool's size
    block_size: int = 16
    max_batch_tokens: int = 256
    max_queue: int = 64
    is_prefix_caching: bool = True


@dataclass(slots=True, frozen=True)
class EngineStats:
    """What the engine thread last published about itself (read by metrics and the drain)."""

    num_running: int = 0
    num_waiting: int = 0  # admitted to the engine, waiting for blocks or a snapshot
    num_blocks: int = 0
    num_blocks_used: int = 0  # held by running sequences
    num_blocks_cached: int = 0  # idle, holding reusable K/V
    num_evictions: int = 0
    num_spilled: int = 0
    max_batch_seen: int = 0


@dataclass(slots=True, frozen=True)
class DeviceUsage:
    num_tokens: int
    exclusive_bytes: int
    shared_bytes: int


@dataclass(slots=True, frozen=True)
class StepRecord:
    decode: list[str]  # request ids that fed one decode token
    prefill: list[tuple[str, int]]  # (request id, chunk length)


class Engine:
    def __init__(self, loaded: LoadedModel, store: SessionStore, tiers: TierStore, config: EngineConfig) -> None:
        self.loaded, self.model_id, self.store, self.config = loaded, loaded.spec.id, store, config
        self.runner = ModelRunner(loaded, config.budget_bytes, config.block_size)
        self.fingerprint = self.runner.fingerprint
        self.token_bytes = self.runner.layout.bytes_per_token
        self.block_bytes = self.token_bytes * config.block_size
        self.blocks = BlockManager(self.runner.pool.num_blocks, config.block_size)
        self.offloader = Offloader(self.runner.pool, self.blocks, store, tiers, self.model_id, self.fingerprint)
        scheduling = SchedulerConfig(config.block_size, config.max_batch_tokens, config.is_prefix_caching)
        self.scheduler = Scheduler(self.blocks, scheduling, self.offloader)
        self.step_log: deque[StepRecord] = deque(maxlen=4096)
        self.max_batch_seen = 0
        self._inbox = Inbox()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix=f"kv-loader-{self.model_id}")
        self._stats = EngineStats(num_blocks=self.blocks.num_blocks)
        self._num_submitted = 0  # written by the event loop only
        self._num_done = 0  # written by the engine thread only
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.model_id}", daemon=True)
        pool = self.runner.pool
        log.info(
            "model %s: paged K/V pool of %d blocks x %d tokens (%.0f MiB)",
            self.model_id,
            pool.num_blocks,
            pool.block_size,
            pool.nbytes / 2**20,
        )

    # -- any thread ----------------------------------------------------------------------
    @property
    def counter(self) -> ForwardCounter:
        return self.runner.counter

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def num_active(self) -> int:
        """Requests submitted and not answered yet (queued, waiting or running)."""
        return self._num_submitted - self._num_done

    # -- event loop side -----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Lock the request's session and queue it. Raises at once what can be known at once."""
        if self._inbox.is_closed:
            raise EngineStopped("the server is shutting down")
        num_tokens = len(request.prompt_ids) + request.params.max_tokens
        if -(-num_tokens // self.config.block_size) > self.blocks.num_blocks:
            raise TooLarge(f"{num_tokens} tokens need more K/V memory than the pool holds")
        if self._inbox.qsize() + self._stats.num_waiting >= self.config.max_queue:
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
        """For each (session, transcript, the tenant's other transcripts): its K/V in the pool.

        Bytes split into exclusive and shared: a block is shared when a running sequence besides this
        one holds it or another of the tenant's sessions reaches it by prefix.
        """
        return await self.query(lambda: [self._residency(*item) for item in items])

    def _residency(self, key: SessionKey, transcript: list[int], others: list[list[int]]) -> DeviceUsage:
        blocks, num_tokens = self.blocks.chain(key.tenant, transcript)
        elsewhere = {b.block_id for ids in others for b in self.blocks.chain(key.tenant, ids)[0]}
        num_shared = sum(1 for b in blocks if b.block_id in elsewhere or b.ref_count > 1)
        return DeviceUsage(num_tokens, (len(blocks) - num_shared) * self.block_bytes, num_shared * self.block_bytes)

    def stop(self, timeout_s: float = 30.0) -> None:
        self._inbox.close()
        self._thread.join(timeout_s)
        self._loader.shutdown(wait=False, cancel_futures=True)

    def save_sessions(self) -> int:
        """Once stopped: every idle session's K/V in the pool goes down to the tiers."""
        if self._thread.is_alive():
            raise RuntimeError("save_sessions needs a stopped engine: the engine thread owns the pool")
        return self.offloader.save_all()

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._inbox.is_closed:
            try:
                self._take()
                self._step()
            except Exception:  # a bug in scheduling or bookkeeping: fail what runs, keep the engine alive
                log.exception("engine step failed")
                for seq in list(self.scheduler.running):
                    self._finish(seq, Failed("internal_error", "the engine failed this step"), is_complete=False)
            self._publish_stats()
        for seq in self.scheduler.sequences():
            self._finish(seq, SHUTTING_DOWN, is_complete=False)
        for item in self._inbox.take(block=False):
            self._reject(item)

    def _take(self) -> None:
        items = self._inbox.take(block=not (self.scheduler.running or self.scheduler.waiting))
        if not items and self.scheduler.is_idle:
            self.store.expire()  # the idle tick
        for item in items:
            if isinstance(item, Query):
                item.answer()
                continue
            try:
                self.scheduler.add(Sequence(item.request, item.session, item.handle, self.loaded))
            except Exception:
                log.exception("request %s could not start", item.request.request_id)
                self._reject(item, Failed("internal_error", "the request could not start"))

    def _reject(self, item: Submission | Query, event: Failed = SHUTTING_DOWN) -> None:
        if isinstance(item, Query):
            item.answer()
            return
        if item.session is not None:
            self.store.release(item.session)
        item.handle.push(event)
        self._num_done += 1

    def _step(self) -> None:
        self.offloader.discard_forgotten()
        self._drop_ended()
        for admission in self.scheduler.admit():
            self._start(admission)
        rows = self.scheduler.schedule()
        if not rows:
            return
        decode = [r.seq.request.request_id for r in rows if r.seq.is_prefilled]
        prefill = [(r.seq.request.request_id, len(r.token_ids)) for r in rows if not r.seq.is_prefilled]
        self.step_log.append(StepRecord(decode, prefill))
        self.max_batch_seen = max(self.max_batch_seen, len(rows))
        try:
            logits = self.runner.run(rows)  # [R, V]
        except Exception as exc:
            self._fail_step(rows, exc)
            return
        self.scheduler.commit(rows)
        self._postprocess(rows, logits)

    def _drop_ended(self) -> None:
        for seq in self.scheduler.sequences():
            if seq.handle.is_cancelled:
                self._finish(seq, CANCELLED, is_complete=False)
            elif seq.handle.is_overflowing:
                self._finish(seq, SLOW_READER, is_complete=False)
            elif seq.is_past_deadline():
                message = f"request exceeded its time limit of {seq.request.timeout_s:g} s"
                self._finish(seq, Failed("request_timeout", message), is_complete=False)

    def _start(self, admission: Admission) -> None:
        """Carry out an admission: read a snapshot first, or put the reused K/V in place and say so."""
        seq, bs = admission.seq, self.config.block_size
        if admission.load is not None:
            fetch = self.offloader.tiers.fetch
            seq.loading = self._loader.submit(fetch, admission.load, self.model_id, self.fingerprint)
            seq.loading.add_done_callback(lambda _: self._inbox.put(WAKE))
            return
        num_cached, source = admission.num_cached, admission.source
        pool = self.runner.pool
        try:
            if admission.restore is not None:
                shared = list(admission.shared)
                restored = offload.restore(pool, self.blocks, seq.salt, shared, admission.restore, num_cached)
                seq.blocks += restored
                seq.num_reserved -= len(restored)
            elif admission.partial is not None:
                self.scheduler.allocate(seq, num_cached)
                pool.copy_slots(admission.partial.block_id, seq.blocks[-1].block_id, admission.num_partial)
                seq.num_computed = num_cached
                self.scheduler.publish(seq, len(seq.blocks) - 1)
        except Exception:  # e.g. out of memory: compute what the snapshot would have given
            log.exception("request %s: restoring K/V from a snapshot failed", seq.request.request_id)
            num_cached = len(admission.shared) * bs
            source = "device" if num_cached else "none"
        seq.num_cached = seq.num_computed = num_cached
        seq.handle.push(Admitted(seq.num_prompt, num_cached, source))

    def _fail_step(self, rows: list[Row], exc: Exception) -> None:
        log.exception("forward pass failed for %d requests", len(rows), exc_info=exc)
        if isinstance(exc, torch.OutOfMemoryError):
            failed = Failed("out_of_memory", "the device ran out of memory")
            if self.loaded.device.type == "cuda":
                # The pool is allocated up front: dropping cached blocks would free no device memory,
                # only every tenant's prefix cache. The allocator's cached activations go here.
                torch.cuda.empty_cache()
        else:
            failed = Failed("internal_error", "the forward pass failed")
        for row in rows:
            self._finish(row.seq, failed, is_complete=False)

    def _postprocess(self, rows: list[Row], logits: torch.Tensor) -> None:
        sampled = [row for row in rows if row.is_sampled]
        for index, row in enumerate(sampled):
            self._sample(row.seq, logits[index])
        for row in rows:
            if row.seq.request.is_prefill_only and row.seq.is_prefilled:
                self._finish(row.seq, Finished("length", row.seq.usage()), is_complete=True)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> None:
        try:
            delta = seq.accept(*seq.sampler.sample(logits))
        except torch.OutOfMemoryError:
            self._finish(seq, Failed("out_of_memory", "the device ran out of memory"), is_complete=False)
            return
        except Exception:
            log.exception("request %s failed while sampling", seq.request.request_id)
            self._finish(seq, Failed("internal_error", "sampling or detokenizing failed"), is_complete=False)
            return
        if delta is not None:
            seq.handle.push(delta)
        if seq.finish_reason is not None:
            self._finish(seq, Finished(seq.finish_reason, seq.usage()), is_complete=True)

    def _finish(self, seq: Sequence, event: Finished | Failed, is_complete: bool) -> None:
        if not self.scheduler.remove(seq):
            return  # already finished
        if seq.session is not None:  # the transcript is journaled here, before the client hears of the end
            event = self._record(seq, seq.session, event if is_complete else None) or event
        seq.handle.push(event)
        self._num_done += 1
        log.debug("request %s done: %s in %.3f s", seq.request.request_id, event, time.monotonic() - seq.started)

    def _record(self, seq: Sequence, session: Session, finished: Finished | Failed | None) -> Failed | None:
        """Release the session, with the completed turn when there is one; a failure fails the request."""
        failed = None
        try:
            turn = seq.completed_turn(finished.finish_reason) if isinstance(finished, Finished) else None
        except Exception:
            log.exception("request %s: its turn could not be built", seq.request.request_id)
            turn, failed = None, RECORD_FAILED
        try:
            self.store.release(session, turn)  # releases the session even when journaling raises
        except Exception:
            log.exception("request %s: its turn could not be recorded", seq.request.request_id)
            failed = RECORD_FAILED
        return failed

    def _publish_stats(self) -> None:
        self._stats = EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.loading),
            num_blocks=self.blocks.num_blocks,
            num_blocks_used=self.blocks.num_used,
            num_blocks_cached=self.blocks.num_cached_idle,
            num_evictions=self.blocks.num_evictions,
            num_spilled=self.offloader.num_spilled,
            max_batch_seen=self.max_batch_seen,
        )

"""The batching engine: one thread per model, one packed forward pass per step over every
running sequence, K/V in a paged pool shared by prefix. Admission reserves the blocks a
request can ever need (prompt + max_tokens), so a running stream is never preempted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch

from server.engine import offload
from server.engine.batch_step import (  # noqa: F401 - PoolConfig, QueueFull, TooLarge: the engine's API
    DeviceUsage,
    PagedSequence,
    PoolConfig,
    QueueFull,
    StepRecord,
    TooLarge,
    layout,
    plan,
    record,
    run_forward,
)
from server.engine.block_manager import BlockManager
from server.engine.generate import ForwardCounter
from server.engine.handle import RequestHandle
from server.engine.inbox import SHUTTING_DOWN, SLOW_READER, Inbox
from server.engine.kv_cache import bytes_per_token, kv_layout
from server.engine.kv_store import KVStore
from server.engine.paged_attention import KVPool, install
from server.engine.registry import LoadedModel
from server.engine.session import common_prefix_len
from server.engine.snapshot import fingerprint
from server.engine.types import Admitted, Failed, Finished, GenerationRequest, SessionKey

log = logging.getLogger("kvserve.engine")


class BatchEngine:
    def __init__(self, loaded: LoadedModel, store: KVStore, config: PoolConfig) -> None:
        self.loaded, self.model_id, self.store, self.config = loaded, loaded.spec.id, store, config
        self.counter = ForwardCounter()
        self.token_bytes = bytes_per_token(loaded.model.config, loaded.dtype)
        self.block_bytes = self.token_bytes * config.block_size
        num_blocks = max(1, config.budget_bytes // self.block_bytes)
        self.blocks = BlockManager(num_blocks, config.block_size)
        layout = kv_layout(loaded.model.config)  # (layers, kv_heads, head_dim)
        self.pool = KVPool(*layout, num_blocks, config.block_size, loaded.dtype, loaded.device)
        install(loaded.model)
        self.fingerprint = fingerprint(*layout, loaded.dtype, loaded.model)
        self.offloader = offload.Offloader(self.pool, self.blocks, store, self.model_id, self.fingerprint)
        self.step_log: deque[StepRecord] = deque(maxlen=4096)
        self.max_batch_seen = 0
        self._inbox = Inbox(store)
        self._waiting: deque[PagedSequence] = deque()
        self._running: list[PagedSequence] = []
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.model_id}", daemon=True)
        log.info(
            "model %s: paged K/V pool of %d blocks x %d tokens (%.0f MiB)",
            self.model_id,
            num_blocks,
            config.block_size,
            self.pool.nbytes / 2**20,
        )

    # -- event loop side ----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        num_tokens = len(request.prompt_ids) + request.params.max_tokens
        if -(-num_tokens // self.config.block_size) > self.blocks.num_blocks:
            raise TooLarge(f"{num_tokens} tokens need more K/V memory than the pool holds")
        if self._inbox.qsize() + len(self._waiting) >= self.config.max_queue:
            raise QueueFull(f"{self.config.max_queue} requests are already waiting; retry shortly")
        return self._inbox.submit(request, self.model_id)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._inbox.close()
        self._thread.join(timeout_s)

    @property
    def num_queued(self) -> int:
        return self._inbox.qsize()

    @property
    def num_active(self) -> int:
        return len(self._running) + len(self._waiting)

    @property
    def num_waiting(self) -> int:
        """Admitted to the engine but waiting for K/V blocks (part of num_active)."""
        return len(self._waiting)

    def residency(self, key: SessionKey, transcript_ids: list[int], others: list[list[int]]) -> DeviceUsage:
        """A transcript's K/V in the pool: tokens, and bytes of its blocks split into exclusive and shared.

        A block is shared when a running sequence besides this one holds it or another of the
        tenant's sessions (`others`: their transcripts) reaches it by prefix.
        """
        with self.blocks.lock:
            blocks, num_tokens = offload.chain_blocks(self.blocks, key.tenant, transcript_ids)
            elsewhere: set[int] = set()
            for ids in others:
                elsewhere.update(b.block_id for b in offload.chain_blocks(self.blocks, key.tenant, ids)[0])
            num_shared = sum(1 for b in blocks if b.block_id in elsewhere or b.ref_count > 1)
        return DeviceUsage(num_tokens, (len(blocks) - num_shared) * self.block_bytes, num_shared * self.block_bytes)

    def cached_tokens(self, salt: str, prompt_ids: list[int]) -> int:
        """Prompt tokens the pool can serve right now (a hint: whether a snapshot is worth reading)."""
        return self.blocks.cached_prefix(salt, prompt_ids)[0]

    # -- engine thread ------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._inbox.is_closed:
            is_idle = not self._running and not self._waiting
            try:
                self._waiting += self._inbox.take(is_idle, self._new_sequence)
                self.offloader.discard_forgotten()
                self._drop_cancelled()
                self._admit()
                if self._running:
                    self._step()
            except Exception:  # a bug in scheduling or bookkeeping: fail what runs, keep the engine alive
                log.exception("engine step failed")
                for seq in list(self._running):
                    self._finish(seq, Failed("internal_error", "the engine failed this step"), is_complete=False)
        for seq in list(self._running) + list(self._waiting):
            self._finish(seq, SHUTTING_DOWN, is_complete=False)
        self._inbox.reject_all()

    def _new_sequence(self, request, entry, handle) -> PagedSequence:
        return PagedSequence(request, entry, handle, self.loaded, is_prefix_caching=self.config.is_prefix_caching)

    def _drop_cancelled(self) -> None:
        for seq in list(self._running) + list(self._waiting):
            if seq.handle.is_cancelled:
                self._finish(seq, Failed("cancelled", "the client went away"), is_complete=False)
            elif seq.handle.is_overflowing:
                self._finish(seq, SLOW_READER, is_complete=False)
            elif seq.is_past_deadline():
                message = f"request exceeded its time limit of {seq.request.timeout_s:g} s"
                self._finish(seq, Failed("request_timeout", message), is_complete=False)

    def _admit(self) -> None:
        """First come, first served: the head of the queue waits until its blocks can be reserved."""
        with self.blocks.lock:
            while self._waiting and self._try_reserve(self._waiting[0]):
                self._running.append(self._waiting.popleft())

    def _try_reserve(self, seq: PagedSequence) -> bool:
        prompt, bs = seq.request.prompt_ids, self.config.block_size
        match = self.blocks.match(seq.salt, prompt, len(prompt) - 1) if seq.use_cache else None
        shared = match.shared if match else []
        num_restore = self._restorable(seq, match.num_tokens if match else 0)
        if num_restore:
            shared = shared[: num_restore // bs]
        need = -(-(len(prompt) + seq.request.params.max_tokens) // bs) - len(shared)
        self.offloader.spill(need)
        if not self.blocks.can_reserve(need, shared):
            return False
        self.blocks.reserve(need)
        self.blocks.pin(shared)
        seq.blocks, seq.num_reserved = list(shared), need
        if num_restore:
            snapshot = seq.request.snapshot
            try:
                restored = offload.restore(self.pool, self.blocks, seq.salt, shared, snapshot, num_restore)
            except Exception:  # e.g. out of memory: compute what the snapshot would have given
                log.exception("request %s: restoring K/V from a snapshot failed", seq.request.request_id)
                seq.num_cached = len(shared) * bs
                seq.fed_ids = prompt[: seq.num_cached]
                seq.handle.push(Admitted(len(prompt), seq.num_cached, "device" if shared else "none"))
                return True
            seq.blocks += restored
            seq.num_reserved -= len(restored)
            seq.num_cached, seq.fed_ids = num_restore, prompt[:num_restore]
            seq.handle.push(Admitted(len(prompt), num_restore, snapshot.origin))
            return True
        if match and match.partial is not None:
            block = self.blocks.allocate(shared[-1].block_id + 1 if shared else None)
            seq.num_reserved -= 1
            self.pool.copy_slots(match.partial.block_id, block.block_id, match.num_partial)
            parent = shared[-1].hash if shared else self.blocks.root(seq.salt)
            start = len(shared) * bs
            self.blocks.record(block, parent, prompt[start : start + match.num_partial])
            seq.blocks.append(block)
        seq.num_cached = match.num_tokens if match else 0
        seq.fed_ids = prompt[: seq.num_cached]
        seq.handle.push(Admitted(len(prompt), seq.num_cached, "device" if seq.num_cached else "none"))
        return True

    def _restorable(self, seq: PagedSequence, num_in_pool: int) -> int:
        """Prompt tokens a lower-tier snapshot can supply beyond what the pool holds (0: use the pool)."""
        snapshot = seq.request.snapshot
        if snapshot is None or not seq.use_cache or snapshot.fingerprint != self.fingerprint:
            return 0
        prompt = seq.request.prompt_ids
        num_tokens = min(common_prefix_len(snapshot.token_ids, prompt), len(prompt) - 1)
        return num_tokens if num_tokens > num_in_pool else 0

    def save_sessions(self) -> int:
        """At shutdown (engine stopped): every idle session's K/V in the pool goes to the tiers."""
        with self.blocks.lock:
            return self.offloader.save_all()

    def _step(self) -> None:
        rows = plan(self._running, self.config.max_batch_tokens)
        self.step_log.append(
            StepRecord(
                [r.seq.request.request_id for r in rows if r.seq.is_prefilled],
                [(r.seq.request.request_id, len(r.token_ids)) for r in rows if not r.seq.is_prefilled],
            )
        )
        self.max_batch_seen = max(self.max_batch_seen, len(rows))
        try:
            with self.blocks.lock:
                meta, input_ids, position_ids, sampled_at = layout(rows, self.blocks, self.pool)
            logits = run_forward(self.loaded.model, meta, input_ids, position_ids, sampled_at)  # [R, V]
        except Exception as exc:
            is_oom = isinstance(exc, torch.OutOfMemoryError)
            log.exception("forward pass failed for %d requests", len(rows))
            failed = (
                Failed("out_of_memory", "the device ran out of memory")
                if is_oom
                else Failed("internal_error", "the forward pass failed")
            )
            if is_oom and self.loaded.device.type == "cuda":
                # The pool is allocated up front: dropping cached blocks would free no device memory,
                # only every tenant's prefix cache. The failed step's blocks go back below; the
                # allocator's cached activations go here.
                torch.cuda.empty_cache()
            for row in rows:
                self._finish(row.seq, failed, is_complete=False)
            return
        self._count(rows)
        with self.blocks.lock:
            record(rows, self.blocks)
        sampled = [row for row in rows if row.is_sampled]
        for index, row in enumerate(sampled):
            self._sample(row.seq, logits[index])
        for row in rows:
            if row.seq.request.is_prefill_only and row.seq.is_prefilled:
                self._finish(row.seq, Finished("length", row.seq.usage()), is_complete=True)

    def _count(self, rows) -> None:
        for row in rows:
            if row.seq.is_prefilled:
                self.counter.num_decode_tokens += len(row.token_ids)
            else:
                self.counter.num_prefill_tokens += len(row.token_ids)
        self.counter.num_forwards += 1

    def _sample(self, seq: PagedSequence, logits: torch.Tensor) -> None:
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

    def _finish(self, seq: PagedSequence, event: Finished | Failed, is_complete: bool) -> None:
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        else:
            return  # already finished
        try:
            with self.blocks.lock:
                self.blocks.release(seq.blocks, keep_contents=seq.use_cache)
                self.blocks.unreserve(seq.num_reserved)
                seq.blocks, seq.num_reserved = [], 0
            if seq.entry is not None:  # the transcript is journaled here, before the client hears of the end
                turn = seq.completed_turn(event.finish_reason) if is_complete else None
                self.store.release(seq.entry, turn=turn)
        except Exception:
            log.exception("request %s: finishing failed", seq.request.request_id)
            event = Failed("internal_error", "the turn could not be recorded; the session is as before it")
        finally:
            seq.handle.push(event)
        log.debug("request %s done: %s in %.3f s", seq.request.request_id, event, time.monotonic() - seq.started)

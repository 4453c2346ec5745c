"""The engine loop, on the engine thread: a step is schedule, run, post-process, finish.

It owns the scheduler, the model runner and the block bookkeeping; other threads reach it only
through its inbox (requests, questions, wake-ups) and read only the stats it publishes. The
scheduler decides; the loop carries its decisions out: it has idle sessions copied down a tier,
the runner write reused K/V, the scheduler book it, and tells each client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from server.engine.grammar import Grammars, apply_bitmask
from server.engine.inbox import WAKE, Errand, Inbox, Query, Submission
from server.engine.model_runner import ModelRunner
from server.engine.openings import OpeningBans, apply_bans
from server.engine.request import CANCELLED, SHUTTING_DOWN, SLOW_READER, Admitted, Failed, Finished
from server.engine.sampler import batch_greedy, batch_sample
from server.engine.scheduler import Admission, Row, Scheduler
from server.engine.sequence import Sequence, SequenceStatus
from server.engine.threads import use_compute_threads
from server.kv.attention import StepAbandoned
from server.kv.blocks import BlockManager
from server.kv.offload import Offloader
from server.models.loader import LoadedModel
from server.sessions.errors import SessionError, SharedStoreLost, SharedStoreUncertain
from server.sessions.record import CompletedTurn, Session
from server.sessions.store import SessionStore

log = logging.getLogger("kvserve.engine")
RECORD_FAILED = Failed("internal_error", "the turn could not be recorded; the session is as before it")


@dataclass(slots=True, frozen=True)
class EngineStats:
    """What the engine thread last published about itself (read by metrics and tests)."""

    num_running: int = 0
    num_waiting: int = 0  # admitted to the engine, waiting for blocks or a snapshot
    num_blocks: int = 0
    num_blocks_used: int = 0  # held by running sequences
    num_blocks_cached: int = 0  # idle, holding reusable K/V
    num_evictions: int = 0
    num_spilled: int = 0
    num_done: int = 0  # requests answered for good, ever
    head_layout_bytes: int = 0  # the attention backend's kept cascade head layouts (`kept_bytes`)


@dataclass(slots=True, frozen=True)
class StepRecord:
    decode: list[str]  # request ids that fed one decode token
    prefill: list[tuple[str, int]]  # (request id, chunk length)
    admitted: tuple[str, ...] = ()  # request ids admitted in this step (a load is admitted again once read)


class EngineLoop:
    def __init__(
        self,
        loaded: LoadedModel,
        store: SessionStore,
        runner: ModelRunner,
        blocks: BlockManager,
        offloader: Offloader,
        scheduler: Scheduler,
        inbox: Inbox,
    ) -> None:
        self.loaded, self.store, self.runner, self.blocks = loaded, store, runner, blocks
        self.offloader, self.scheduler, self._inbox = offloader, scheduler, inbox
        self.model_id = loaded.spec.id
        self.step_log: deque[StepRecord] = deque(maxlen=4096)
        self.max_batch_seen = 0
        self.num_abandoned_steps = 0  # steps stopped between layers: every request in them had ended
        self.num_done = 0  # requests answered for good; read by others through the published stats
        self._done_lock = threading.Lock()  # the committer answers requests too
        self._thread: threading.Thread | None = None  # the engine thread, once it runs
        # Replicas: a session's turn commits to Redis, which can take seconds when it does not answer (a resolved
        # uncertain outcome); the committer does it, so the engine thread never waits on the network.
        self._committer = (
            ThreadPoolExecutor(1, thread_name_prefix=f"kv-commit-{self.model_id}") if store.is_shared else None
        )
        self.stats = EngineStats(num_blocks=blocks.num_blocks)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix=f"kv-loader-{self.model_id}")
        self.grammars: Grammars | None = None  # the engine's, for the masks of constrained rows
        self.openings: OpeningBans | None = None  # the engine's, for rows whose lines may not open with some text

    def run(self) -> None:
        """The engine thread's body, until the inbox closes; then everything still here is answered."""
        self._thread = threading.current_thread()
        use_compute_threads()  # this thread's OpenMP team is the process's one (server/engine/threads.py)
        torch.set_grad_enabled(False)
        if self.loaded.device.type == "cuda":  # Triton launches its kernels on the thread's current device
            torch.cuda.set_device(self.loaded.device)
        while not self._inbox.is_closed:
            items = self._inbox.take(block=not (self.scheduler.running or self.scheduler.waiting))  # books at rest
            with self.blocks.changing():  # others read the books only at rest: while waiting, or in a forward pass
                try:
                    self._take(items)
                    self._step()
                except Exception:  # a bug in scheduling or bookkeeping: fail what runs, keep the engine alive
                    log.exception("engine step failed")
                    for seq in list(self.scheduler.running):
                        self._finish(seq, Failed("internal_error", "the engine failed this step"), is_complete=False)
                self._publish_stats()
        with self.blocks.changing():
            for seq in self.scheduler.sequences():
                self._finish(seq, SHUTTING_DOWN, is_complete=False)
            for item in self._inbox.take(block=False):
                self._reject(item)
            self._publish_stats()
        self._loader.shutdown(wait=False, cancel_futures=True)
        if self._committer is not None:
            self._committer.shutdown(wait=True)  # every request handed to it is answered before the thread ends

    def _take(self, items: list[Submission | Query | Errand]) -> None:
        if not items and self.scheduler.is_idle:
            self.store.expire()  # the idle tick
        for item in items:
            if isinstance(item, Query):
                item.answer()
                continue
            if isinstance(item, Errand):
                try:
                    item.fn()
                except Exception:  # best-effort pool work (sharing, forgetting): the rest of the batch goes on
                    log.exception("an errand on the engine thread failed")
                continue
            try:
                self.scheduler.add(Sequence(item.request, item.session, item.handle, self.loaded, self.openings))
            except Exception:
                log.exception("request %s could not start", item.request.request_id)
                self._reject(item, Failed("internal_error", "the request could not start"))

    def _reject(self, item: Submission | Query | Errand, event: Failed = SHUTTING_DOWN) -> None:
        if isinstance(item, Query):
            item.answer()
            return
        if isinstance(item, Errand):
            return  # the pool is going away with the thread
        if item.session is not None:
            self.store.release(item.session)
        item.handle.push(event)
        self._count_done()

    def _step(self) -> None:
        self.offloader.discard_forgotten()
        self._drop_ended()
        plan = self.scheduler.admit()
        self.offloader.spill(plan.num_short)  # before any reserved block is allocated: allocating evicts
        admissions = plan.admissions
        for admission in admissions:
            self._start(admission)
        self._start_loads()
        rows = self.scheduler.schedule()
        admitted = tuple(a.seq.request.request_id for a in admissions)
        if not rows:
            self.runner.rest()
            if admitted:  # only loads started: the step still tells who was admitted in it
                self.step_log.append(StepRecord([], [], admitted))
            return
        decode = [r.seq.request.request_id for r in rows if r.seq.is_prefilled]
        prefill = [(r.seq.request.request_id, len(r.token_ids)) for r in rows if not r.seq.is_prefilled]
        self.step_log.append(StepRecord(decode, prefill, admitted))
        self.max_batch_seen = max(self.max_batch_seen, len(rows))
        # A step that prefills may take long (seconds, a minute on a busy CPU): once every request in it has gone
        # (its client left, its time ran out) it stops between layers, and they are ended at once.
        is_abandoned = (lambda: all(r.seq.is_ended for r in rows)) if prefill else None
        try:
            with self.blocks.resting():  # a forward pass reads the books, never changes them
                logits = self.runner.run(rows, is_abandoned)  # [R, V]
        except StepAbandoned as exc:
            self.num_abandoned_steps += 1
            log.info("a step of %d rows stopped %s: every request in it had ended", len(rows), exc)
            self._drop_ended()
            return
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
        """Carry out an admission: put the reused K/V in place and tell the client (a load starts later)."""
        seq, bs = admission.seq, self.blocks.block_size
        if admission.load is not None:
            return  # `_start_loads` reads the snapshot
        num_cached, source = admission.num_cached, admission.source
        try:
            if admission.restore is not None:
                blocks, first = self.scheduler.blocks_to_fill(admission), len(admission.shared) * bs
                try:
                    self.runner.write_snapshot([b.block_id for b in blocks], admission.restore, first, num_cached)
                except BaseException:
                    self.scheduler.unfill(admission)  # nothing was published: back to the reservation
                    raise
                self.scheduler.publish_filled(admission)
            elif admission.partial is not None:
                blocks = self.scheduler.blocks_to_fill(admission)
                self.runner.copy_slots(admission.partial.block_id, blocks[-1].block_id, admission.num_partial)
                self.scheduler.publish_filled(admission)
        except Exception:  # e.g. out of memory: compute what the snapshot would have given
            log.exception("request %s: restoring K/V from a snapshot failed", seq.request.request_id)
            num_cached = len(admission.shared) * bs
            source = "device" if num_cached else "none"
        finally:
            self.scheduler.unpin_copy_source(seq)
        seq.snapshot = None  # its tokens are in the pool now (or computed): host memory is not held for the run
        seq.num_cached = seq.num_computed = num_cached
        seq.handle.push(Admitted(seq.num_prompt, num_cached, source))

    def _start_loads(self) -> None:
        """Read, on the loader thread, the snapshot of every LOADING sequence that has no read in flight."""
        for seq in self.scheduler.loading:
            if seq.loading is None and seq.request.kv_source is not None:
                fetch = self.offloader.fetch
                seq.loading = self._loader.submit(fetch, seq.request.kv_source, seq.request.prompt_ids)
                seq.loading.add_done_callback(lambda _: self._inbox.put(WAKE))

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
        sampled = [row.seq for row in rows if row.is_sampled]
        self._mask(sampled, logits)
        greedy = [index for index, seq in enumerate(sampled) if seq.sampler.is_plain_greedy]
        drawn = [index for index, seq in enumerate(sampled) if seq.sampler.is_plain_sampled]
        chosen: dict[int, int] = {}
        try:
            if greedy:
                chosen.update(zip(greedy, batch_greedy(logits, greedy), strict=True))
            if drawn:
                tokens = batch_sample([sampled[i].sampler for i in drawn], logits[drawn])
                chosen.update(zip(drawn, tokens, strict=True))
        except Exception:  # each row samples its own: a failure then fails that request alone
            log.exception("batched sampling failed; sampling row by row")
            chosen = {}
        for index, seq in enumerate(sampled):
            self._sample(seq, logits[index], chosen.get(index))
        for row in rows:
            if row.seq.request.is_prefill_only and row.seq.is_prefilled:
                self._finish(row.seq, Finished("length", row.seq.usage()), is_complete=True)

    def _mask(self, sampled: list[Sequence], logits: torch.Tensor) -> None:
        """Constrained rows: the tokens their grammars forbid get -inf, before any row samples; and rows with banned
        openings the tokens that would open one here."""
        banned = [index for index, seq in enumerate(sampled) if seq.opening_ban is not None]
        if banned:
            with torch.inference_mode():  # the logits are the forward pass's inference tensors
                apply_bans(logits, banned, [sampled[i].opening_ban for i in banned])  # type: ignore[misc]
        rows = [index for index, seq in enumerate(sampled) if seq.constraint is not None]
        if not rows or self.grammars is None:
            return
        try:
            bitmask = self.grammars.fill_masks([sampled[i].constraint for i in rows])  # type: ignore[misc]
            with torch.inference_mode():  # the logits are the forward pass's inference tensors
                apply_bitmask(logits, bitmask, rows)
        except Exception:
            log.exception("computing grammar masks failed for %d requests", len(rows))
            for index in rows:
                self._finish(sampled[index], Failed("internal_error", "the output grammar failed"), is_complete=False)

    def _sample(self, seq: Sequence, logits: torch.Tensor, chosen: int | None) -> None:
        """Accept the token already chosen for this sequence (a batched argmax or draw), or sample its own."""
        if seq.status is SequenceStatus.FINISHED:
            return  # failed in this step already (its grammar's mask)
        try:
            delta = seq.accept(chosen, None) if chosen is not None else seq.accept(*seq.sampler.sample(logits))
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
            self._finish(seq, Finished(seq.finish_reason, seq.usage(), seq.detok.matched), is_complete=True)

    def _finish(self, seq: Sequence, event: Finished | Failed, is_complete: bool) -> None:
        if not self.scheduler.remove(seq):
            return  # already finished
        if seq.session is None:
            self._answer(seq, event)
            return
        turn, failed = self._turn(seq, event if is_complete else None)
        tokens = seq.token_ids[: seq.num_computed]
        if self._committer is not None:  # replicas: the commit may wait on Redis, the engine thread does not
            self._committer.submit(self._record, seq, seq.session, turn, failed or event, tokens)
        else:
            self._record(seq, seq.session, turn, failed or event, tokens)

    def _record(
        self, seq: Sequence, session: Session, turn: CompletedTurn | None, event: Finished | Failed, tokens: list[int]
    ) -> None:
        """Release the session, with the completed turn when there is one (journaled, and committed to Redis with
        replicas, before the client hears of the end); a failure fails the request. On the engine thread, or on
        the committer's: pool work then goes back to the engine thread as errands."""
        is_unkept = False  # made by this request, which made no turn: gone, but not deleted by anyone
        try:
            is_unkept = self.store.release(session, turn)  # releases the session even when journaling raises
        except (SharedStoreUncertain, SharedStoreLost) as exc:  # not "as before": the client is told what happened
            log.error("request %s: %s", seq.request.request_id, exc.message)
            event = Failed(exc.code, exc.message)
        except SessionError as exc:  # 503 or 409: the client hears the turn did not happen, and it did not
            log.error("request %s: %s", seq.request.request_id, exc.message)
            event = Failed(exc.code, f"{exc.message}; the session is as before this turn")
        except Exception:
            log.exception("request %s: its turn could not be recorded", seq.request.request_id)
            event = RECORD_FAILED
        try:
            key, is_live = session.key, self.store.is_live(session.key, session)
            if turn is not None and isinstance(event, Finished):
                self._on_engine(lambda: self.offloader.share(key, tokens))  # to other replicas
            # Deleted while it ran: none of it is served. A session its failed first request made is only not kept:
            # what it computed stays as cache, like any failed turn's (a client's retry of it reuses it).
            if not is_live and not is_unkept:
                self._on_engine(lambda: self.offloader.forget(key, tokens))
        except Exception:  # what follows the record is best effort; the client is answered whatever happens
            log.exception("request %s: after its turn was recorded", seq.request.request_id)
        self._answer(seq, event)

    def _turn(self, seq: Sequence, finished: Finished | Failed | None) -> tuple[CompletedTurn | None, Failed | None]:
        """The completed turn a finished sequence makes (None: it failed, or was cancelled)."""
        if not isinstance(finished, Finished):
            return None, None
        try:
            return seq.completed_turn(finished.finish_reason), None
        except Exception:
            log.exception("request %s: its turn could not be built", seq.request.request_id)
            return None, RECORD_FAILED

    def _on_engine(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread: here when this is it, else between its next steps."""
        if threading.current_thread() is self._thread:
            fn()
        else:
            self._inbox.put(Errand(fn))

    def _answer(self, seq: Sequence, event: Finished | Failed) -> None:
        seq.handle.push(event)
        self._count_done()
        if threading.current_thread() is not self._thread:
            self._inbox.put(WAKE)  # the engine publishes the count at its next step
        log.debug("request %s done: %s in %.3f s", seq.request.request_id, event, time.monotonic() - seq.started)

    def _count_done(self) -> None:
        with self._done_lock:
            self.num_done += 1

    def _num_done(self) -> int:
        with self._done_lock:
            return self.num_done

    def _publish_stats(self) -> None:
        self.stats = EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.loading),
            num_blocks=self.blocks.num_blocks,
            num_blocks_used=self.blocks.num_used,
            num_blocks_cached=self.blocks.num_cached_idle,
            num_evictions=self.blocks.num_evictions,
            num_spilled=self.offloader.num_spilled,
            num_done=self._num_done(),
            head_layout_bytes=self.runner.backend.kept_bytes(),
        )

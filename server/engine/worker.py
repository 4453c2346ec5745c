"""The engine: one thread per model owns every forward pass; requests advance round-robin.

Each loop iteration gives every running sequence one step (its prefill, or one decoded
token), so streams interleave and a cancelled or timed-out request stops before its next
forward pass. Batching many sequences into one forward is a later step (see docs).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from server.engine.batch_engine import DeviceUsage
from server.engine.generate import Forward, ForwardCounter
from server.engine.handle import RequestHandle
from server.engine.inbox import SHUTTING_DOWN, SLOW_READER, Inbox
from server.engine.kv_cache import bytes_per_token, kv_layout
from server.engine.kv_store import Entry, KVStore
from server.engine.registry import LoadedModel
from server.engine.sequence import Sequence
from server.engine.snapshot import fingerprint
from server.engine.types import Failed, Finished, GenerationRequest, TextDelta

log = logging.getLogger("kvserve.engine")
CONSISTENT_FAILURES = ("cancelled", "request_timeout", "shutting_down", "slow_reader")  # noticed between steps


class Engine:
    def __init__(self, loaded: LoadedModel, store: KVStore) -> None:
        self.loaded = loaded
        self.model_id = loaded.spec.id
        self.store = store
        self.counter = ForwardCounter()
        self._forward = Forward(loaded.model, self.counter)
        self.token_bytes = bytes_per_token(loaded.model.config, loaded.dtype)
        self.fingerprint = fingerprint(*kv_layout(loaded.model.config), loaded.dtype, loaded.model)
        self._inbox = Inbox(store)
        self._active: list[Sequence] = []
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.model_id}", daemon=True)

    # -- event loop side ----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Admit a request. Raises SessionBusy / SessionModelMismatch at once, before any work."""
        return self._inbox.submit(request, self.model_id)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._inbox.close()
        self._thread.join(timeout_s)

    @property
    def num_queued(self) -> int:
        return self._inbox.qsize()

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return 0  # every taken request runs at once

    def residency(self, key, transcript_ids: list[int], others: list[list[int]]) -> DeviceUsage:
        """A session's own cache in the store: never shared with another session."""
        info = self.store.info(key)
        return DeviceUsage(info.num_cached_tokens, info.nbytes, 0) if info else DeviceUsage(0, 0, 0)

    def cached_tokens(self, salt: str, prompt_ids: list[int]) -> int:
        return 0  # each session's cache is found by its key at prefill, not by prefix

    def save_sessions(self) -> int:
        return 0  # per-session caches are not snapshotted (docs/architecture.md): transcripts are

    # -- engine thread ------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._inbox.is_closed:
            try:
                self._active += self._inbox.take(not self._active, lambda *item: Sequence(*item, self.loaded))
                self.store.take_forgotten(self.model_id)  # its caches left with their entries: nothing to drop
            except Exception:
                log.exception("taking new requests failed")
            for seq in list(self._active):
                self._step(seq)
        for seq in list(self._active):
            self._finish(seq, SHUTTING_DOWN, is_complete=False)
        self._inbox.reject_all()

    def _step(self, seq: Sequence) -> None:
        try:
            if seq.handle.is_cancelled:
                self._finish(seq, Failed("cancelled", "the client went away"), is_complete=False)
            elif seq.handle.is_overflowing:
                self._finish(seq, SLOW_READER, is_complete=False)
            elif seq.is_past_deadline():
                message = f"request exceeded its time limit of {seq.request.timeout_s:g} s"
                self._finish(seq, Failed("request_timeout", message), is_complete=False)
            elif not seq.is_prefilled:
                self._emit(seq, seq.prefill(self.store, self._forward))
            else:
                self._emit(seq, seq.decode(self._forward))
        except torch.OutOfMemoryError:
            log.warning("request %s: device out of memory; idle sessions' caches are dropped", seq.request.request_id)
            self.store.make_room(self.store.budget_bytes + 1)  # every idle cache goes (transcripts stay)
            if self.loaded.device.type == "cuda":
                torch.cuda.empty_cache()
            self._finish(seq, Failed("out_of_memory", "the device ran out of memory"), is_complete=False)
        except Exception:
            log.exception("request %s failed", seq.request.request_id)
            self._finish(seq, Failed("internal_error", "generation failed inside the engine"), is_complete=False)

    def _release(self, seq: Sequence, entry: Entry, event: Finished | Failed, is_complete: bool) -> None:
        turn = seq.completed_turn(event.finish_reason) if is_complete else None
        if not seq.has_taken_cache:
            self.store.release(entry, turn=turn, keep_cache=True)
            return
        # A forward that raised may have written some layers and not others: never keep that cache.
        is_consistent = is_complete or event.code in CONSISTENT_FAILURES
        cache = seq.cache if is_consistent else None
        self.store.release(entry, cache, seq.fed_ids if is_consistent else [], turn)

    def _emit(self, seq: Sequence, delta: TextDelta | None) -> None:
        if delta is not None:
            seq.handle.push(delta)
        if seq.finish_reason is not None:
            self._finish(seq, Finished(seq.finish_reason, seq.usage()), is_complete=True)

    def _finish(self, seq: Sequence, event: Finished | Failed, is_complete: bool) -> None:
        if seq not in self._active:
            return  # already finished (a failure while finishing lands here again)
        self._active.remove(seq)
        try:
            if seq.entry is not None:
                self._release(seq, seq.entry, event, is_complete)
        except Exception:
            log.exception("request %s: finishing failed", seq.request.request_id)
            event = Failed("internal_error", "the turn could not be recorded; the session is as before it")
        finally:
            seq.cache = None
            seq.handle.push(event)
        log.debug("request %s done: %s in %.3f s", seq.request.request_id, event, time.monotonic() - seq.started)

"""The block store: K/V below host RAM, a block at a time, content-addressed, over one of two backends.

The backends are a disk directory (`disk_blocks.py`, this process's disk tier) and Redis
(`redis_blocks.py`, the tier replicas share). Both hold the same bytes per block
(`snapshot.encode_block`) under the same address, and everything else is this module's:

- The address of a block is a chained BLAKE2b over the stored format's version, the model's
  fingerprint (layout and weights), the block size, the tenant (two tenants with the same prompt
  never share a block) and every token id up to the block's end. It is process-independent by
  construction, unlike Python's `hash()`, so any replica, and this process after a restart, finds
  what another wrote. A block with fewer tokens than the block size (a transcript's tail) is
  addressed the same way.
- Writing: the engine thread hands over host copies (`WriteJob`) and goes on; the store's writer
  thread keeps only the blocks the backend lacks (a system prompt many sessions share is stored
  once), encodes and checksums them, and writes them in order, a few a round trip, so a writer
  that dies part way leaves a usable leading run.
- Reading: the leading run of present, sound blocks; a block that fails its check is deleted
  (the next writer stores it again) and it and what follows are recomputed, never served.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from server.kv.pool import KVLayout
from server.kv.snapshot import VERSION, decode_block, encode_block

log = logging.getLogger("kvserve.blocks")
KNOWN_LIMIT = 1 << 20  # addresses the shared store remembers as already held
CHUNK = 8  # blocks per round trip: one reply never carries more than a few MB
READERS = 4  # chunks read and checked at once: file reads, Redis round trips and SHA-256 release the GIL


def addresses(fingerprint: str, block_size: int, tenant: str, token_ids: list[int], tail: bool = False) -> list[str]:
    """The content address of each full block of `token_ids` (and of the partial last one, with `tail`)."""
    # The stored format's version too: blocks of another version are not found (so never deleted as unreadable).
    digest = hashlib.blake2b(f"{VERSION}\0{fingerprint}\0{block_size}\0{tenant}".encode(), digest_size=20)
    found = []
    end = len(token_ids) if tail else len(token_ids) - len(token_ids) % block_size
    for start in range(0, end, block_size):
        digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids[start : min(start + block_size, end)]))
        found.append(digest.copy().hexdigest())
    return found


def leading_run(flags: list[bool]) -> int:
    """How many of the first flags are true."""
    return next((i for i, flag in enumerate(flags) if not flag), len(flags))


def join_blocks(blocks: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Consecutive blocks [2, layers, kv_heads, tokens, head_dim] as one run, in one copy: per-layer K and V
    [kv_heads, tokens, head_dim] (contiguous views of it)."""
    run = torch.cat(blocks, dim=3)
    return list(run[0].unbind()), list(run[1].unbind())


class BlockBackend(Protocol):
    """Where blocks are kept: stored bytes under their address."""

    errors: tuple[type[Exception], ...]  # what its calls raise when the medium fails (disk, network)

    def held(self, names: list[str]) -> list[bool]: ...

    def write(self, items: list[tuple[str, bytes]]) -> int:
        """Store the ones not held yet; returns how many it stored."""
        ...

    def read(self, names: list[str]) -> list[bytes | None]: ...

    def delete(self, names: list[str]) -> None: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class WriteJob:
    names: list[str]
    k: list[torch.Tensor]  # host copies, per layer [kv_heads, tokens, head_dim]: block i is tokens i*bs ..
    v: list[torch.Tensor]
    block_size: int
    done: Callable[[bool], None] | None = None  # on the writer thread: whether the backend now holds every block
    ready: Callable[[], None] = lambda: None  # waits for an asynchronous copy to land before encoding
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None  # rows into the format the blocks are stored in


@dataclass(slots=True)
class BlockStats:
    num_queued: int = 0  # blocks handed to the writer
    num_written: int = 0  # blocks stored
    num_skipped: int = 0  # blocks the backend already held
    num_read: int = 0  # blocks restored
    num_refused: int = 0  # blocks whose check failed: deleted and recomputed
    num_failed: int = 0  # blocks not written or not read: the backend did not answer


class BlockStore:
    def __init__(self, backend: BlockBackend, origin: str, max_queued: int = 0, known_limit: int = 0) -> None:
        """`known_limit`: how many addresses seen held to remember, so `unknown` asks no round trip (0: none; the
        disk backend answers `held` from memory anyway)."""
        self.backend, self.origin = backend, origin  # origin: the tier's name in X-Cache-Source
        self.stats = BlockStats()
        self._known_limit = known_limit
        self._known: OrderedDict[str, None] = OrderedDict()  # seen held (written or read): copied no more
        self._known_lock = threading.Lock()
        self._queue: queue.Queue[WriteJob | None] = queue.Queue(max_queued)  # 0: unbounded
        self._writer = threading.Thread(target=self._write_loop, name=f"kv-{origin}-writer", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix=f"kv-{origin}-reader")

    # -- writing ------------------------------------------------------------------------
    def unknown(self, names: list[str]) -> list[int]:
        """Indices of the addresses not known to be held already (what to copy and hand to `put`)."""
        with self._known_lock:
            return [i for i, name in enumerate(names) if name not in self._known]

    def put(self, job: WriteJob) -> None:
        """Queue host copies of blocks for the writer. A full queue drops them: only colder, still correct."""
        try:
            self._queue.put_nowait(job)
            self.stats.num_queued += len(job.names)
        except queue.Full:
            log.warning("the %s K/V writer is behind: %d blocks are not stored", self.origin, len(job.names))
            if job.done is not None:
                job.done(False)

    def flush(self) -> None:
        """Wait until every job queued so far is written."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                try:
                    is_whole = self._write(job)
                except Exception:  # not the medium failing (an encoding or copy bug): the job still ends
                    log.exception("the %s K/V writer failed on a job", self.origin)
                    is_whole = False
                if job.done is not None:
                    job.done(is_whole)  # always: its owner holds references and memory until told
            except Exception:  # a callback's bug must not stop the writer for every later job
                log.exception("the %s K/V writer's callback failed", self.origin)
            finally:
                self._queue.task_done()

    def _write(self, job: WriteJob) -> bool:
        """The blocks the backend lacks, in order, CHUNK a round trip. Whether every block is held afterwards."""
        bs = job.block_size
        try:
            held = self.backend.held(job.names)
            missing = [i for i, is_held in enumerate(held) if not is_held]
            self.stats.num_skipped += len(held) - len(missing)
            job.ready()
            convert = job.convert or (lambda rows: rows)  # a block at a time: only the missing ones are converted

            def encoded(i: int) -> bytes:
                cut = slice(i * bs, (i + 1) * bs)
                k, v = [convert(t[:, cut]) for t in job.k], [convert(t[:, cut]) for t in job.v]
                return encode_block(job.names[i], k, v)

            for start in range(0, len(missing), CHUNK):
                items = [(job.names[i], encoded(i)) for i in missing[start : start + CHUNK]]
                written = self.backend.write(items)
                self.stats.num_written += written
                self.stats.num_skipped += len(items) - written
        except self.backend.errors as exc:
            self.stats.num_failed += len(job.names)
            log.warning("%d K/V blocks not stored in the %s tier: %s", len(job.names), self.origin, exc)
            self.forget_known()  # the backend may have come back empty (a restart): nothing is taken as held
            return False
        self._remember(job.names)
        return True

    # -- reading (on the engine's loader thread) ----------------------------------------
    def read_run(self, names: list[str], layout: KVLayout) -> list[torch.Tensor]:
        """The leading run of present, sound blocks among `names`, each [2, layers, kv_heads, tokens, head_dim].
        Chunks are read and checked READERS at a time. Never raises: a backend that does not answer means
        recompute."""
        chunks = [names[start : start + CHUNK] for start in range(0, len(names), CHUNK)]
        futures = [self._readers.submit(self._read_chunk, chunk, layout) for chunk in chunks]
        blocks: list[torch.Tensor] = []
        try:
            for chunk, future in zip(chunks, futures, strict=True):
                try:
                    found = future.result()
                except self.backend.errors as exc:
                    self.stats.num_failed += len(names) - len(blocks)
                    log.warning("K/V blocks not read from the %s tier (%s): they are recomputed", self.origin, exc)
                    break
                run = leading_run([block is not None for block in found])
                blocks += found[:run]  # type: ignore[arg-type]  # the leading run holds no None
                if run < len(chunk):
                    self._forget([chunk[run]])  # evicted (or refused): the next turn's blocks go to the writer again
                    break
        finally:
            for future in futures:
                future.cancel()  # chunks past a missing block are not needed
        self.stats.num_read += len(blocks)
        self._remember(names[: len(blocks)])
        return blocks

    def _read_chunk(self, chunk: list[str], layout: KVLayout) -> list[torch.Tensor | None]:
        found: list[torch.Tensor | None] = []
        for name, value in zip(chunk, self.backend.read(chunk), strict=True):
            block = None if value is None else decode_block(name, value, layout)
            if value is not None and block is None:
                self.stats.num_refused += 1
                self.delete([name])  # the next writer stores a sound one
            found.append(block)
        return found

    # -- forgetting ---------------------------------------------------------------------
    def delete(self, names: list[str]) -> None:
        """Best effort: a block left behind costs space, never correctness."""
        if not names:
            return
        self._forget(names)
        try:
            self.backend.delete(names)
        except self.backend.errors as exc:
            log.warning("%d K/V blocks not deleted from the %s tier: %s", len(names), self.origin, exc)

    def _forget(self, names: list[str]) -> None:
        with self._known_lock:
            for name in names:
                self._known.pop(name, None)

    def forget_known(self) -> None:
        """Take no block as held any more (the backend lost its data, or a write failed): each is asked for again,
        and stored again where the backend lacks it."""
        with self._known_lock:
            self._known.clear()

    def _remember(self, names: list[str]) -> None:
        if not self._known_limit:
            return
        with self._known_lock:
            for name in names:
                self._known[name] = None
                self._known.move_to_end(name)
            while len(self._known) > self._known_limit:
                self._known.popitem(last=False)

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(30)
        self._readers.shutdown(cancel_futures=True)
        self.backend.close()

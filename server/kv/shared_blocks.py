"""K/V blocks in the shared store (Redis): any replica restores a session another one computed.

A full block is stored once under a content address: a chained BLAKE2b over the model's
fingerprint (layout and weights), the tenant (two tenants with the same prompt never share a
block) and every token id up to the block's end. Process-independent by construction, unlike
Python's `hash()`. The value is a SHA-256 of the payload followed by the payload (the block's K
then V, layer by layer, in the pool's dtype); a block whose checksum fails is never served.

Writes happen behind a turn on a writer thread: the engine copies the blocks Redis is not known
to hold and goes on; the writer skips the ones Redis already has (a system prompt many sessions
share is stored once). Redis' own `maxmemory` and eviction policy bound the tier. Reads take the
longest run of present, sound blocks from the start of a transcript; the rest is recomputed.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from server.kv.pool import KVLayout

log = logging.getLogger("kvserve.shared")
PREFIX = "kvserve:blk:"
KNOWN_LIMIT = 1 << 20  # addresses remembered as already in Redis
MAX_QUEUED = 256  # write jobs; past this a turn's blocks are not shared (it stays correct, only colder)
CHUNK = 8  # blocks per round trip: one reply never carries more than a few MB
Block = tuple[str, list[torch.Tensor], list[torch.Tensor]]  # address, per-layer K and V [kv_heads, block, head_dim]


def addresses(fingerprint: str, tenant: str, token_ids: list[int], block_size: int) -> list[str]:
    """The content address of each full block of `token_ids`."""
    digest = hashlib.blake2b(f"{fingerprint}\0{tenant}".encode(), digest_size=20)
    found = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids[start : start + block_size]))
        found.append(PREFIX + digest.copy().hexdigest())
    return found


@dataclass(slots=True)
class SharedStats:
    num_queued: int = 0  # blocks handed to the writer
    num_written: int = 0  # blocks this replica stored
    num_skipped: int = 0  # blocks Redis already held
    num_read: int = 0  # blocks restored from Redis
    num_refused: int = 0  # blocks whose checksum or size failed: recomputed instead
    num_failed: int = 0  # writes or reads Redis did not answer


class SharedBlocks:
    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        import redis  # only with a shared store configured

        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self.client: Any = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.stats = SharedStats()
        self._known: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._queue: queue.Queue[list[Block] | None] = queue.Queue(MAX_QUEUED)
        self._writer = threading.Thread(target=self._write_loop, name="kv-shared-writer", daemon=True)
        self._writer.start()

    def announce(self, model_id: str, fingerprint: str) -> None:
        """Say which K/V layout this replica serves `model_id` with; warn when another replica said another.
        Replicas whose layouts differ (a dtype `auto` settled differently, other weights under one id) share
        no block: each is correct alone, but every failover recomputes."""
        name = f"kvserve:layout:{model_id}"
        try:
            held = None if self.client.set(name, fingerprint, nx=True) else self.client.get(name)
        except self._errors:
            log.warning("the shared store did not answer: model %s's K/V layout was not compared", model_id)
            return
        if held is not None and held.decode() != fingerprint:
            log.warning(
                "model %s: this replica's K/V layout (%s) differs from another replica's (%s): they share no "
                "K/V blocks; pin the dtype in models.toml on every replica",
                model_id,
                fingerprint,
                held.decode(),
            )

    # -- writing (the engine copies, the writer stores) ----------------------------------
    def unknown(self, names: list[str]) -> list[int]:
        """Indices of the addresses not known to be in Redis already (to copy and hand to `put`)."""
        with self._lock:
            return [i for i, name in enumerate(names) if name not in self._known]

    def put(self, blocks: list[Block]) -> None:
        """Blocks (address, per-layer K, per-layer V, host tensors [kv_heads, block_size, head_dim]) to store."""
        if not blocks:
            return
        try:
            self._queue.put_nowait(blocks)  # encoded and checksummed on the writer thread
            self.stats.num_queued += len(blocks)
        except queue.Full:
            log.warning("the shared K/V writer is behind: %d blocks of this turn are not shared", len(blocks))

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(job)
            except self._errors:
                self.stats.num_failed += len(job or [])
                log.warning("%d K/V blocks not shared: the shared store did not answer", len(job or []))
            finally:
                self._queue.task_done()

    def _write(self, job: list[Block]) -> None:
        """The blocks Redis lacks, in order, a few a round trip: a replica that dies part way leaves a usable
        leading run, and no reply carries more than a few MB."""
        pipe = self.client.pipeline(transaction=False)
        for name, _, _ in job:
            pipe.exists(name)
        missing = [block for block, held in zip(job, pipe.execute(), strict=True) if not held]
        self.stats.num_skipped += len(job) - len(missing)
        for start in range(0, len(missing), CHUNK):
            pipe = self.client.pipeline(transaction=False)
            for name, k, v in missing[start : start + CHUNK]:
                pipe.set(name, _encode(k, v), nx=True)
            written = sum(1 for ok in pipe.execute() if ok)
            self.stats.num_written += written
            self.stats.num_skipped += len(missing[start : start + CHUNK]) - written
        self._remember([name for name, _, _ in job])

    def _remember(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                self._known[name] = None
                self._known.move_to_end(name)
            while len(self._known) > KNOWN_LIMIT:
                self._known.popitem(last=False)

    # -- reading (on the engine's loader thread) ----------------------------------------
    def read(self, names: list[str], layout: KVLayout, block_size: int) -> tuple[list[torch.Tensor], ...] | None:
        """The leading run of present, sound blocks as per-layer K and V [kv_heads, n * block_size, head_dim]
        (None: not even the first). Never raises: a store that does not answer means recompute."""
        if not names:
            return None
        blocks: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        for start in range(0, len(names), CHUNK):
            try:
                values = self.client.mget(names[start : start + CHUNK])
            except self._errors:
                self.stats.num_failed += len(names) - len(blocks)
                log.warning("K/V blocks not read: the shared store did not answer; they are recomputed")
                break
            for value in values:
                decoded = None if value is None else _decode(value, layout, block_size)
                if decoded is None:
                    self.stats.num_refused += value is not None
                    break
                blocks.append(decoded)
            if len(blocks) < start + len(values):
                break
        if not blocks:
            return None
        self.stats.num_read += len(blocks)
        self._remember(names[: len(blocks)])
        k = [torch.cat([b[0][layer] for b in blocks], dim=1) for layer in range(layout.num_layers)]
        v = [torch.cat([b[1][layer] for b in blocks], dim=1) for layer in range(layout.num_layers)]
        return k, v

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(30)
        self.client.close()


def _encode(k: list[torch.Tensor], v: list[torch.Tensor]) -> bytes:
    payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in [*k, *v])
    return hashlib.sha256(payload).digest() + payload


def _decode(value: bytes, layout: KVLayout, block_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    checksum, payload = value[:32], value[32:]
    shape = (layout.num_kv_heads, block_size, layout.head_dim)
    element = torch.empty((), dtype=layout.dtype).element_size()
    per_tensor = layout.num_kv_heads * block_size * layout.head_dim * element
    if len(payload) != 2 * layout.num_layers * per_tensor or hashlib.sha256(payload).digest() != checksum:
        log.warning("a shared K/V block failed its checksum: it is recomputed")
        return None
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    tensors = [
        flat[i * per_tensor : (i + 1) * per_tensor].view(layout.dtype).view(shape) for i in range(2 * layout.num_layers)
    ]
    return tensors[: layout.num_layers], tensors[layout.num_layers :]

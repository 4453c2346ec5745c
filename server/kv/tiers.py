"""Where sessions' K/V go when they leave the device: host RAM, then the block store (disk; Redis too).

Host RAM holds whole snapshots (on CUDA, the pinned copies the device made), with a byte
budget and least-recently-used order; on CPU the device pool already is host RAM, so its budget
defaults to 0. Below it, K/V is kept a block at a time in one block store over two backends
(`block_store.py`): this process's disk (`disk_tier.py`, a manifest per session over shared
block files) and, with replicas, Redis. Host overflow hands the oldest snapshots to the disk's
writer thread (still readable from memory until written), so the engine never waits on a file
system. Reading a prompt's K/V back takes the leading run of its blocks from the disk and goes
on from Redis where the disk stops; a disk read lands in host RAM when it fits.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from server.kv.block_store import BlockStore, addresses, join_blocks
from server.kv.disk_tier import DiskTier
from server.kv.pool import KVLayout, convert
from server.kv.snapshot import Snapshot
from server.sessions.journal import Tombstones
from server.sessions.record import SessionKey

log = logging.getLogger("kvserve.tiers")


@dataclass(slots=True, frozen=True)
class TierFormats:
    """How each tier keeps the K/V it is given (`TIER_KV_DTYPES`): as it comes (`pool`), or in 8 bits (int8, fp8)
    where it comes in more; a restore converts it back to the pool's format."""

    host: str = "pool"
    disk: str = "pool"
    shared: str = "pool"  # Redis

    def layouts(self, pool: KVLayout) -> dict[str, KVLayout]:
        """The layout each tier holds a pool's K/V in: host RAM's comes from the pool, the disk's from host RAM
        (snapshots move down through it), Redis's from the pool."""
        host = pool.stored_as(self.host)
        return {"host": host, "disk": host.stored_as(self.disk), "shared": pool.stored_as(self.shared)}


@dataclass(slots=True)
class TierUsage:
    host_tokens: int = 0
    host_bytes: int = 0
    disk_tokens: int = 0
    disk_bytes: int = 0  # blocks only this session names
    disk_shared_bytes: int = 0  # blocks other sessions name too


@dataclass(slots=True)
class TierStats:
    host_bytes: int = 0
    disk_bytes: int = 0
    num_host: int = 0
    num_disk: int = 0
    num_demoted: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0, "dropped": 0})
    num_failed_writes: int = 0  # snapshots the disk did not take (dropped: their sessions recompute)
    num_swept: int = 0  # temporary files a crash left behind, removed at start


class TierStore:
    def __init__(
        self,
        host_budget_bytes: int,
        disk_budget_bytes: int,
        directory: Path | None,
        block_size: int = 16,
        formats: TierFormats = TierFormats(),
    ) -> None:
        self.host_budget_bytes, self.block_size, self.formats = host_budget_bytes, block_size, formats
        self._deleted = Tombstones()  # shared with the disk tier
        self.disk = None
        if directory is not None:
            self.disk = DiskTier(directory, disk_budget_bytes, block_size, self._deleted, formats.disk)
        self.shared: BlockStore | None = None  # replicas: blocks in Redis, below this process's tiers
        self.is_enabled = host_budget_bytes > 0 or directory is not None  # a snapshot has somewhere to go
        self._lock = threading.RLock()
        self._host: OrderedDict[SessionKey, Snapshot] = OrderedDict()
        self._writing: dict[SessionKey, Snapshot] = {}  # on their way to disk: still readable from memory
        self._num_dropped = 0  # snapshots with nowhere to go (no disk, or larger than its budget)
        self.stats = TierStats()

    def path_for(self, key: SessionKey) -> Path:
        """The disk manifest of `key` (its blocks are content-addressed files beside it)."""
        assert self.disk is not None
        return self.disk.path_for(key)

    def revive(self, key: SessionKey) -> None:
        """A new session under a name deleted before: its K/V may be kept again."""
        with self._lock:
            self._deleted.revive(key)

    def scan(self, keys: set[SessionKey] | None = None) -> int:
        """At start: index the K/V a previous run left on disk, dropping that of sessions not in `keys` (no record
        knows them). Returns how many sessions have K/V on disk."""
        if self.disk is None:
            return 0
        found = self.disk.scan(lambda key: keys is None or key in keys)
        self.stats.num_swept = self.disk.num_swept
        return found

    # -- moving down ----------------------------------------------------------------
    def put(self, snapshot: Snapshot) -> None:
        """A snapshot leaving the device: into host RAM, or on to disk when host RAM has no room."""
        with self._lock:
            if snapshot.key in self._deleted:
                return  # the session was deleted while its K/V was being copied
            self._host.pop(snapshot.key, None)
            self._host[snapshot.key] = snapshot
            self._evict_host()

    def covers(self, key: SessionKey, token_ids: list[int]) -> bool:
        """Some tier already holds K/V for all of `token_ids`: no need to save them again."""
        with self._lock:
            for snap in (self._host.get(key), self._writing.get(key)):
                if snap is not None and snap.token_ids[: len(token_ids)] == token_ids:
                    return True
        disk = self.disk.manifest(key, use=False) if self.disk is not None else None
        return disk is not None and disk.token_ids[: len(token_ids)] == token_ids

    def flush(self) -> None:
        """At shutdown: every snapshot in host RAM goes to disk; returns when the writes are done."""
        with self._lock:
            for key in list(self._host):
                self._demote(key)
        self.flush_pending()

    def pending_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._writing.values())

    def flush_pending(self) -> None:
        """Wait until the snapshots already on their way to disk are written."""
        if self.disk is not None:
            self.disk.flush()

    # -- moving up ----------------------------------------------------------------------
    def peek_tokens(self, key: SessionKey) -> int:
        """How many tokens the best copy of `key` below the device holds (0: none), without reading it."""
        with self._lock:
            for snap in (self._host.get(key), self._writing.get(key)):
                if snap is not None:
                    return snap.num_tokens
        disk = self.disk.manifest(key, use=False) if self.disk is not None else None
        return len(disk.token_ids) if disk is not None else 0

    def fetch(self, key: SessionKey, model_id: str, digests: str, pool: KVLayout) -> Snapshot | None:
        """The snapshot of `key` in host RAM (or on its way to disk), or None; one of another model, or of K/V
        computed otherwise than this pool's (another dtype, another layout), is None too."""
        with self._lock:
            snap = self._host.get(key) or self._writing.get(key)
            if snap is None:
                return None
            if key in self._host:
                self._host.move_to_end(key)
            snap.origin = "host"
            fits = snap.model_id == model_id and snap.digests == digests and snap.layout.computed == pool.computed
            return snap if fits else None

    def read(
        self, key: SessionKey, usable_ids: list[int], model_id: str, digests: str, pool: KVLayout
    ) -> Snapshot | None:
        """From the block store (blocking: call off the loop): the leading run of `usable_ids`' blocks on disk
        (with `key`'s partial last block), continued from the shared tier where the disk stops. Each tier's blocks
        are addressed and checked in the format it keeps this pool's K/V in (`TierFormats`)."""
        layouts = self.formats.layouts(pool)
        layout = layouts["disk"]
        disk_fp, shared_fp = layout.fingerprint(digests), layouts["shared"].fingerprint(digests)
        full = addresses(disk_fp, self.block_size, key.tenant, usable_ids)
        blocks: list[torch.Tensor] = []
        tail_block, origin = None, "disk"
        if self.disk is not None:
            tail = self.disk.tail(key, disk_fp, usable_ids)
            names = [*full[: tail[0]], tail[1]] if tail is not None else full
            blocks = self.disk.store.read_run(names, layout)
            if tail is not None and len(blocks) == len(names):
                tail_block = blocks.pop()  # used unless the shared tier holds full blocks past it
        if self.shared is not None and len(blocks) < len(full):
            shared = full if shared_fp == disk_fp else addresses(shared_fp, self.block_size, key.tenant, usable_ids)
            more = self.shared.read_run(shared[len(blocks) :], layouts["shared"])
            if more and blocks and layouts["shared"] != layout:  # two formats: both as the pool keeps them
                blocks = [convert(b, layout, pool) for b in blocks]
                more, layout = [convert(b, layouts["shared"], pool) for b in more], pool
            elif more:
                layout = layouts["shared"]
            if more:
                blocks, tail_block, origin = blocks + more, None, "shared"
        blocks += [tail_block] if tail_block is not None else []
        if not blocks:
            return None
        k, v = join_blocks(blocks)
        snap = Snapshot(key, model_id, layout, digests, list(usable_ids[: k[0].shape[1]]), k, v, origin=origin)
        with self._lock:
            if origin == "disk" and snap.nbytes <= self.host_budget_bytes and key not in self._deleted:
                self._host[key] = snap  # use brings it back up; the disk copy stays valid
                self._evict_host()
        return snap

    # -- forgetting ---------------------------------------------------------------------
    def drop(self, key: SessionKey) -> None:
        """Delete a session's K/V from every tier of this process (session deleted or expired)."""
        if key.is_bucket:
            return
        with self._lock:
            self._deleted.add(key)
            self._host.pop(key, None)
            self._writing.pop(key, None)
        if self.disk is not None:
            self.disk.drop(key)

    def usage(self, key: SessionKey) -> TierUsage:
        usage = TierUsage()
        with self._lock:
            snap = self._host.get(key) or self._writing.get(key)
            if snap is not None:
                usage.host_tokens, usage.host_bytes = snap.num_tokens, snap.nbytes
        if self.disk is not None:
            usage.disk_tokens, usage.disk_bytes, usage.disk_shared_bytes = self.disk.usage(key)
        return usage

    def host_bytes(self, model_id: str) -> int:
        """Bytes of `model_id`'s snapshots in host RAM, those on their way to disk included (still held)."""
        with self._lock:
            held = [s for s in [*self._host.values(), *self._writing.values()] if s.model_id == model_id]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for s in held for t in s.k + s.v}
        return sum(storages.values())  # a snapshot in both places, or sharing a storage, counts once

    def totals(self) -> TierStats:
        with self._lock:
            self.stats.host_bytes = sum(s.nbytes for s in [*self._host.values(), *self._writing.values()])
            self.stats.num_host = len(self._host)
        if self.disk is not None:
            self.stats.disk_bytes, self.stats.num_disk = self.disk.blocks.nbytes, self.disk.num_sessions
            self.stats.num_failed_writes = self.disk.num_failed_writes
        self.stats.num_demoted["dropped"] = self._num_dropped + (self.disk.num_evicted if self.disk is not None else 0)
        return self.stats

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    # -- internals ----------------------------------------------------------------------
    def _evict_host(self) -> None:
        total = sum(s.nbytes for s in self._host.values())
        while self._host and total > self.host_budget_bytes:
            key, snap = next(iter(self._host.items()))
            total -= snap.nbytes
            self._demote(key)

    def _demote(self, key: SessionKey) -> None:
        snap = self._host.pop(key)
        if self.disk is not None and self.disk.holds(snap):
            return  # the disk already holds this very snapshot
        if self.disk is None or snap.nbytes > self.disk.budget_bytes:
            self._num_dropped += 1  # nowhere to go: the session recomputes
            return
        self.stats.num_demoted["disk"] += 1
        self._writing[key] = snap

        def written() -> None:
            with self._lock:
                if self._writing.get(key) is snap:
                    del self._writing[key]

        self.disk.write(snap, written)

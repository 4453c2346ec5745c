"""Where sessions' K/V go when they leave the device: host RAM, then a disk directory.

Each tier has a byte budget and least-recently-used order. A snapshot leaving the device
lands in host RAM; host overflow moves the oldest snapshots to disk (written by a
background thread, so the engine never waits on the file system); disk overflow deletes
the oldest files. Using a snapshot brings it back up: a disk read lands in host RAM when it
fits, and the engine copies it into the device pool. On CPU the device pool already is host
RAM, so the host budget defaults to 0 and snapshots go straight to disk.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from server.kv import snapshot as snap_io
from server.kv.shared_blocks import SharedBlocks
from server.kv.snapshot import Snapshot, SnapshotError, SnapshotMismatch
from server.sessions.journal import Tombstones, state_path, sweep
from server.sessions.record import SessionKey

log = logging.getLogger("kvserve.tiers")


@dataclass(slots=True)
class DiskEntry:
    path: Path
    model_id: str
    num_tokens: int
    nbytes: int
    token_ids: list[int] | None = None  # known for files written by this process


@dataclass(slots=True)
class TierUsage:
    host_tokens: int = 0
    host_bytes: int = 0
    disk_tokens: int = 0
    disk_bytes: int = 0


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
    def __init__(self, host_budget_bytes: int, disk_budget_bytes: int, directory: Path | None) -> None:
        self.host_budget_bytes = host_budget_bytes
        self.disk_budget_bytes = disk_budget_bytes if directory is not None else 0
        self.directory = directory
        self.is_enabled = host_budget_bytes > 0 or directory is not None  # a snapshot has somewhere to go
        self.shared: SharedBlocks | None = None  # replicas: blocks in Redis, under this process's tiers
        self._lock = threading.RLock()
        self._host: OrderedDict[SessionKey, Snapshot] = OrderedDict()
        self._writing: dict[SessionKey, Snapshot] = {}  # on their way to disk: still readable from memory
        self._disk: OrderedDict[SessionKey, DiskEntry] = OrderedDict()
        self._deleted = Tombstones()
        self.stats = TierStats()
        self._queue: queue.Queue[SessionKey | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        if self.directory is not None:
            self._writer.start()

    # -- paths and start-up -----------------------------------------------------------
    def path_for(self, key: SessionKey) -> Path:
        """Tenant names are hashed and ids validated: no key can point outside the directory."""
        assert self.directory is not None
        return state_path(self.directory, key, ".safetensors")

    def revive(self, key: SessionKey) -> None:
        """A new session under a name deleted before: its snapshots may be kept again."""
        with self._lock:
            self._deleted.revive(key)

    def retain(self, keys: set[SessionKey]) -> int:
        """At start: drop snapshots whose session record is gone. Returns how many were dropped."""
        with self._lock:
            orphans = [key for key in self._disk if key not in keys]
        for key in orphans:
            self.drop(key)
        return len(orphans)

    def scan(self) -> int:
        """Index the snapshots a previous run left on disk (headers only). Returns how many were found."""
        if self.directory is None or not self.directory.exists():
            return 0
        self.stats.num_swept = sweep(self.directory, ".safetensors")  # writes a crash cut short
        found = sorted(self.directory.glob("*/*.safetensors"), key=lambda p: p.stat().st_mtime)
        for path in found:
            try:
                key, model_id, _fingerprint, num_tokens = snap_io.read_header(path)
            except SnapshotError as exc:
                log.warning("skipping K/V snapshot %s: %s", path, exc)
                continue
            if key.kind not in ("session", "response") or path != self.path_for(key):
                log.warning("skipping K/V snapshot %s: its header names another session", path)
                continue
            with self._lock:
                self._disk[key] = DiskEntry(path, model_id, num_tokens, path.stat().st_size)
        self._evict_disk()
        return len(self._disk)

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
            disk = self._disk.get(key)
            return disk is not None and disk.token_ids is not None and disk.token_ids[: len(token_ids)] == token_ids

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
        if self.directory is not None:
            self._queue.join()

    # -- moving up ----------------------------------------------------------------------
    def peek_tokens(self, key: SessionKey) -> int:
        """How many tokens the best snapshot of `key` holds (0: none), without loading it."""
        with self._lock:
            for snap in (self._host.get(key), self._writing.get(key)):
                if snap is not None:
                    return snap.num_tokens
            disk = self._disk.get(key)
            return disk.num_tokens if disk else 0

    def fetch(self, key: SessionKey, model_id: str, fingerprint: str) -> Snapshot | None:
        """The snapshot of `key` in memory (read from disk when needed), or None. Blocking: call off the loop."""
        with self._lock:
            snap = self._host.get(key) or self._writing.get(key)
            if snap is not None:
                if key in self._host:
                    self._host.move_to_end(key)
                snap.origin = "host"
                return snap if snap.model_id == model_id and snap.fingerprint == fingerprint else None
            disk = self._disk.get(key)
        if disk is None:
            return None
        try:
            snap = snap_io.load(disk.path, model_id, fingerprint)
        except SnapshotError as exc:
            log.warning("K/V snapshot of session %s skipped, its turns will be recomputed: %s", key.name, exc)
            if not (isinstance(exc, SnapshotMismatch) and exc.model_id != model_id):
                self._forget_disk(key, disk)  # corrupt, or stale (our model id, other weights): gone
            return None
        with self._lock:
            if self._disk.get(key) is not disk:
                return snap  # dropped or replaced while it was read: use it once, keep nothing
            disk.token_ids = snap.token_ids
            self._disk.move_to_end(key)
            if snap.nbytes <= self.host_budget_bytes:
                self._host[key] = snap  # use brings it back up; the disk copy stays valid
                self._evict_host()
        return snap

    # -- forgetting ---------------------------------------------------------------------
    def _forget_disk(self, key: SessionKey, disk: DiskEntry) -> None:
        """An unusable file: remove it (and only it; a newer copy in memory stays)."""
        with self._lock:
            if self._disk.get(key) is disk:
                del self._disk[key]
        disk.path.unlink(missing_ok=True)

    def drop(self, key: SessionKey) -> None:
        """Delete a session's snapshots from every tier (session deleted or expired)."""
        if key.is_bucket:
            return
        with self._lock:
            self._deleted.add(key)
            self._host.pop(key, None)
            self._writing.pop(key, None)
            disk = self._disk.pop(key, None)
        if disk is not None:
            disk.path.unlink(missing_ok=True)
        elif self.directory is not None:
            self.path_for(key).unlink(missing_ok=True)

    def usage(self, key: SessionKey) -> TierUsage:
        with self._lock:
            usage = TierUsage()
            snap = self._host.get(key) or self._writing.get(key)
            if snap is not None:
                usage.host_tokens, usage.host_bytes = snap.num_tokens, snap.nbytes
            disk = self._disk.get(key)
            if disk is not None:
                usage.disk_tokens, usage.disk_bytes = disk.num_tokens, disk.nbytes
            return usage

    def totals(self) -> TierStats:
        with self._lock:
            self.stats.host_bytes = sum(s.nbytes for s in [*self._host.values(), *self._writing.values()])
            self.stats.disk_bytes = sum(d.nbytes for d in self._disk.values())
            self.stats.num_host, self.stats.num_disk = len(self._host), len(self._disk)
            return self.stats

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(30)

    # -- internals ----------------------------------------------------------------------
    def _evict_host(self) -> None:
        total = sum(s.nbytes for s in self._host.values())
        while self._host and total > self.host_budget_bytes:
            key, snap = next(iter(self._host.items()))
            total -= snap.nbytes
            self._demote(key)

    def _demote(self, key: SessionKey) -> None:
        snap = self._host.pop(key)
        disk = self._disk.get(key)
        if disk is not None and disk.token_ids == snap.token_ids:
            return  # the disk already holds this very snapshot
        if self.directory is None or snap.nbytes > self.disk_budget_bytes:
            self.stats.num_demoted["dropped"] += 1
            return
        self.stats.num_demoted["disk"] += 1
        self._writing[key] = snap
        self._queue.put(key)

    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                self._write(key)
            finally:
                self._queue.task_done()

    def _write(self, key: SessionKey) -> None:
        with self._lock:
            snap = self._writing.get(key)
        if snap is None:
            return  # dropped meanwhile
        path = self.path_for(key)
        try:
            nbytes = snap_io.save(snap, path)
        except Exception:  # a full or read-only disk: the K/V is dropped (recomputed later), never kept in RAM for ever
            log.exception("writing the K/V snapshot of session %s failed; it is dropped", key.name)
            with self._lock:
                if self._writing.get(key) is snap:
                    del self._writing[key]
                self.stats.num_failed_writes += 1
            return
        with self._lock:
            if self._writing.get(key) is not snap:
                if key not in self._writing and key not in self._host:
                    path.unlink(missing_ok=True)  # the session was deleted while its file was written
                return
            del self._writing[key]
            self._disk.pop(key, None)
            self._disk[key] = DiskEntry(path, snap.model_id, snap.num_tokens, nbytes, snap.token_ids)
        self._evict_disk()

    def _evict_disk(self) -> None:
        with self._lock:
            total = sum(d.nbytes for d in self._disk.values())
            victims = []
            while self._disk and total > self.disk_budget_bytes:
                _key, disk = self._disk.popitem(last=False)
                total -= disk.nbytes
                victims.append(disk.path)
                self.stats.num_demoted["dropped"] += 1
        for path in victims:
            path.unlink(missing_ok=True)

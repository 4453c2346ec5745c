"""The disk tier: sessions' K/V in the block store's disk backend, with a manifest per session.

A session's manifest (`<directory>/<sha256(tenant)[:16]>/<kind>-<id>.kv.json`) names its
model, K/V layout and the token ids its blocks hold; the blocks themselves are content-addressed
files (`disk_blocks.py`), so sessions of one tenant that share a prefix (a fork and its parent,
one system prompt) share its blocks on disk too. A block is referenced by every manifest that
names it (and by a write in flight) and deleted when the last one goes. The byte budget counts
the block files really held (a shared block once) and drops whole sessions, least recently used
first. Blocks are written before their manifest, so a crash leaves no manifest naming a block
that was never written; blocks no manifest names are removed at start.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from server.kv.block_store import BlockStore, WriteJob, addresses, leading_run
from server.kv.disk_blocks import DiskBlocks
from server.kv.pool import convert
from server.kv.snapshot import Snapshot
from server.sessions.journal import Tombstones, state_path, sweep, write_json
from server.sessions.record import SessionKey

log = logging.getLogger("kvserve.tiers")
FORMAT, VERSION, SUFFIX = "kvserve-kv-manifest", "1", ".kv.json"


@dataclass(slots=True)
class Manifest:
    key: SessionKey
    model_id: str
    fingerprint: str
    token_ids: list[int]
    names: list[str]  # its blocks' addresses: the full ones, then the partial tail


class DiskTier:
    def __init__(
        self, directory: Path, budget_bytes: int, block_size: int, deleted: Tombstones, kv_dtype: str = "pool"
    ) -> None:
        """`deleted`: the keys deleted lately, the tier store's (a write that raced with a delete is not kept);
        `kv_dtype`: how its blocks keep K/V (`KVLayout.stored_as`)."""
        self.directory, self.budget_bytes, self.block_size = directory, budget_bytes, block_size
        self.kv_dtype = kv_dtype
        self.blocks = DiskBlocks(directory / "blocks")
        self.store = BlockStore(self.blocks, "disk")
        self._lock = threading.RLock()
        self._manifests: OrderedDict[SessionKey, Manifest] = OrderedDict()  # least recently used first
        self._writing: dict[SessionKey, Manifest] = {}  # the latest write of each key still in flight
        self._refs: Counter[str] = Counter()  # address -> manifests and writes in flight naming it
        self._deleted = deleted
        self.num_failed_writes = 0  # snapshots the disk did not take (dropped: their sessions recompute)
        self.num_evicted = 0
        self.num_swept = 0  # temporary files a crash left behind, removed at start

    def path_for(self, key: SessionKey) -> Path:
        """Tenant names are hashed and ids validated: no key can point outside the directory."""
        return state_path(self.directory, key, SUFFIX)

    # -- writing ------------------------------------------------------------------------
    def write(self, snapshot: Snapshot, done: Callable[[], None]) -> None:
        """Store the snapshot's blocks (the ones not held yet), then its manifest; `done` runs afterwards on the
        writer thread, whatever happened."""
        key, bs = snapshot.key, self.block_size
        source, layout = snapshot.layout, snapshot.layout.stored_as(self.kv_dtype)
        fingerprint = layout.fingerprint(snapshot.digests)
        names = addresses(fingerprint, bs, key.tenant, snapshot.token_ids, tail=True)
        manifest = Manifest(key, snapshot.model_id, fingerprint, list(snapshot.token_ids), names)
        with self._lock:
            self._writing[key] = manifest
            self._refs.update(names)  # held for the write: a delete of another session cannot take them meanwhile

        def written(is_whole: bool) -> None:
            try:
                self._commit(manifest, is_whole)
            finally:
                done()

        to_disk = None if layout == source else (lambda rows: convert(rows, source, layout))  # on the writer thread
        self.store.put(WriteJob(names, snapshot.k, snapshot.v, bs, written, snapshot.wait, to_disk))

    def _commit(self, manifest: Manifest, is_whole: bool) -> None:
        key = manifest.key
        with self._lock:
            is_latest = self._writing.get(key) is manifest
            if is_latest:
                del self._writing[key]
            if is_whole and is_latest and key not in self._deleted:
                try:
                    self._save(manifest)
                except Exception as exc:  # a full disk, or anything else: the write's references must not leak
                    log.warning("the K/V manifest of session %s was not written (%s); it is dropped", key.name, exc)
                    is_whole = False
                else:
                    old = self._manifests.pop(key, None)
                    self._manifests[key] = manifest
                    self._release(old.names if old else [])
                    self._evict()
                    return
            self._release(manifest.names)
            self.num_failed_writes += not is_whole
            self._evict()

    def _save(self, manifest: Manifest) -> None:
        key = manifest.key
        record: dict[str, object] = {"format": FORMAT, "version": VERSION, "model": manifest.model_id}
        record |= {"fingerprint": manifest.fingerprint, "block_size": self.block_size}
        record |= {"session": [key.tenant, key.name, key.kind], "token_ids": manifest.token_ids}
        write_json(self.path_for(key), record)

    def flush(self) -> None:
        self.store.flush()

    # -- reading ------------------------------------------------------------------------
    def manifest(self, key: SessionKey, use: bool = True) -> Manifest | None:
        """What the disk holds for `key` (its blocks written), or None; a use (not a peek) moves it up the LRU.

        A peek takes no lock: the engine thread peeks, and the lock's holder may be deleting block files
        (one dict lookup is atomic, and a manifest is replaced, never changed, once it is in the dict)."""
        if not use:
            return self._manifests.get(key)
        with self._lock:
            manifest = self._manifests.get(key)
            if manifest is not None:
                self._manifests.move_to_end(key)
            return manifest

    def holds(self, snapshot: Snapshot) -> bool:
        """The disk already holds (or is writing) this very snapshot. A peek, without the lock (see `manifest`)."""
        found = (self._manifests.get(snapshot.key), self._writing.get(snapshot.key))
        stored = snapshot.layout.stored_as(self.kv_dtype).fingerprint(snapshot.digests)
        return any(m is not None and (m.fingerprint, m.token_ids) == (stored, snapshot.token_ids) for m in found)

    def tail(self, key: SessionKey, fingerprint: str, usable_ids: list[int]) -> tuple[int, str] | None:
        """(block index, address) of the partial last block `key`'s manifest names, when the prompt's usable ids
        reach past it (its address names its tokens: a prompt that differs there finds nothing)."""
        manifest = self.manifest(key)
        if manifest is None or manifest.fingerprint != fingerprint:
            return None
        num_tokens = len(manifest.token_ids)
        if num_tokens % self.block_size == 0 or usable_ids[:num_tokens] != manifest.token_ids:
            return None
        return num_tokens // self.block_size, manifest.names[-1]  # the manifest's own tokens: its address holds

    def usage(self, key: SessionKey) -> tuple[int, int, int]:
        """(tokens, exclusive bytes, shared bytes) of `key`'s K/V on disk."""
        with self._lock:
            manifest = self._manifests.get(key)
            if manifest is None:
                return 0, 0, 0
            exclusive = sum(self.blocks.size(n) for n in manifest.names if self._refs[n] == 1)
            shared = sum(self.blocks.size(n) for n in manifest.names if self._refs[n] > 1)
            return len(manifest.token_ids), exclusive, shared

    @property
    def num_sessions(self) -> int:
        with self._lock:
            return len(self._manifests)

    # -- forgetting -----------------------------------------------------------------------
    def drop(self, key: SessionKey, forever: bool = True) -> None:
        """A session's manifest, and the blocks no other session names, go (`forever`: deleted, so a write
        racing with it is not kept either)."""
        with self._lock:
            if forever:
                self._deleted.add(key)
                self._writing.pop(key, None)  # its blocks are released when the writer is done with them
            manifest = self._manifests.pop(key, None)
            self._release(manifest.names if manifest else [])
            self.path_for(key).unlink(missing_ok=True)  # under the lock: a new manifest of a revived key survives

    def _release(self, names: list[str]) -> None:
        gone = []
        for name in names:
            self._refs[name] -= 1
            if self._refs[name] <= 0:
                del self._refs[name]
                gone.append(name)
        self.store.delete(gone)

    def _evict(self) -> None:
        while self._manifests and self.blocks.nbytes > self.budget_bytes:
            key = next(iter(self._manifests))
            self.num_evicted += 1
            self.drop(key, forever=False)

    # -- start-up -------------------------------------------------------------------------
    def scan(self, is_wanted: Callable[[SessionKey], bool]) -> int:
        """Index what a previous run left: the blocks, and the manifests of wanted sessions (others are
        removed); blocks no manifest names are removed. Returns how many sessions have K/V on disk."""
        if not self.directory.exists():
            return 0
        self.num_swept = sweep(self.directory, SUFFIX) + self.blocks.scan()
        for path in sorted(self.directory.glob(f"*/*{SUFFIX}"), key=lambda p: p.stat().st_mtime):
            manifest = self._read(path)
            if manifest is None or not is_wanted(manifest.key):
                path.unlink(missing_ok=True)
                continue
            run = leading_run(self.blocks.held(manifest.names))
            manifest.names = manifest.names[:run]  # a block lost meanwhile ends what can be restored
            manifest.token_ids = manifest.token_ids[: min(len(manifest.token_ids), run * self.block_size)]
            with self._lock:
                self._manifests[manifest.key] = manifest
                self._refs.update(manifest.names)
        with self._lock:
            self.store.delete([name for name in self.blocks.names() if name not in self._refs])
            self._evict()
            return len(self._manifests)

    def _read(self, path: Path) -> Manifest | None:
        try:
            record = json.loads(path.read_text())
            if record.get("format") != FORMAT or record.get("version") != VERSION:
                raise ValueError(f"format {record.get('format')!r} version {record.get('version')!r}")
            if record["block_size"] != self.block_size:
                raise ValueError(f"block size {record['block_size']}, this server uses {self.block_size}")
            key = SessionKey(*record["session"])
            if path != self.path_for(key):
                raise ValueError("it names another session")
            token_ids = [int(t) for t in record["token_ids"]]
            names = addresses(record["fingerprint"], self.block_size, key.tenant, token_ids, tail=True)
            return Manifest(key, str(record["model"]), str(record["fingerprint"]), token_ids, names)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("skipping K/V manifest %s: %s", path, exc)
            return None

    def close(self) -> None:
        self.store.close()

"""The session journal: one JSON file per session, written when a turn completes (torch-free).

Written atomically (a temporary file, then a rename) before the turn's final event is
sent, so a killed server loses no completed turn. Deleted keys are remembered for a while:
a write that raced with the delete must not bring the session back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from server.sessions.record import STORED_KINDS, Session, SessionKey, SessionRecord

log = logging.getLogger("kvserve.sessions")
NAME_PATTERN = r"[A-Za-z0-9_-]{1,128}"


def state_path(directory: Path, key: SessionKey, suffix: str) -> Path:
    """`directory/<sha256(tenant)[:16]>/<kind>-<name><suffix>`: no tenant or id can leave the directory."""
    if not re.fullmatch(NAME_PATTERN, key.name) or key.kind not in STORED_KINDS:
        raise ValueError(f"no file for {key.kind} {key.name[:40]!r}")
    tenant_dir = hashlib.sha256(key.tenant.encode()).hexdigest()[:16]
    return directory / tenant_dir / f"{key.kind}-{key.name}{suffix}"


def sweep(directory: Path, suffix: str) -> int:
    """Remove what is not a record under `directory/<tenant>/`: temporary files a crash left (ours end in
    `.partial`, safetensors' start with `.tmp`). Returns how many were removed."""
    keep = re.compile(rf"({'|'.join(STORED_KINDS)})-{NAME_PATTERN}{re.escape(suffix)}")
    removed = 0
    for path in directory.glob("*/*"):
        if path.is_file() and not keep.fullmatch(path.name):
            path.unlink(missing_ok=True)
            removed += 1
    if removed:
        log.info("removed %d temporary files left in %s", removed, directory)
    return removed


def write_json(path: Path, record: Mapping[str, object]) -> None:
    """Atomically (a temporary file, then a rename): a reader sees the old record or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, separators=(",", ":")))
    os.replace(partial, path)


class Tombstones:
    """Keys deleted lately: a write that raced with the delete must not bring the files back."""

    def __init__(self, limit: int = 100_000) -> None:
        self._keys: OrderedDict[SessionKey, None] = OrderedDict()
        self._limit = limit

    def add(self, key: SessionKey) -> None:
        self._keys[key] = None
        while len(self._keys) > self._limit:
            self._keys.popitem(last=False)

    def revive(self, key: SessionKey) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: SessionKey) -> bool:
        return key in self._keys


class Journal:
    """One JSON file per session under `directory`; None: sessions live in memory only."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._lock = threading.Lock()  # a save and a delete of one key never interleave
        self._deleted = Tombstones()

    def path_for(self, key: SessionKey) -> Path:
        assert self.directory is not None
        return state_path(self.directory, key, ".json")

    def save(self, key: SessionKey, record: SessionRecord) -> None:
        """Raises OSError (disk full, ...): the caller treats the turn as not recorded."""
        if self.directory is None or key.is_bucket:
            return
        with self._lock:
            if key in self._deleted:
                return  # deleted while its turn ran: this state belongs to nobody
            write_json(self.path_for(key), record)

    def save_all(self, records: list[tuple[SessionKey, SessionRecord]]) -> list[SessionKey]:
        """Write each record; returns the keys whose write failed."""
        failed = []
        for key, record in records:
            try:
                self.save(key, record)
            except OSError:
                failed.append(key)
        return failed

    def revive(self, key: SessionKey) -> None:
        """A new session under a name that was deleted before."""
        with self._lock:
            self._deleted.revive(key)

    def delete(self, key: SessionKey) -> None:
        if self.directory is None or key.is_bucket:
            return
        with self._lock:
            self.path_for(key).unlink(missing_ok=True)  # raises (read-only, gone bad) with nothing forgotten
            self._deleted.add(key)

    def load_all(self) -> list[dict[str, Any]]:
        if self.directory is None or not self.directory.exists():
            return []
        sweep(self.directory, ".json")  # writes a crash cut short
        records = []
        for path in sorted(self.directory.glob("*/*.json")):
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError) as exc:
                log.warning("skipping unreadable session record %s: %s", path, exc)
        return records

    def load_sessions(self, now_mono: float, now_wall: float) -> list[Session]:
        """Every journaled session; a record that cannot be read is skipped with a warning."""
        sessions = []
        for data in self.load_all():
            try:
                sessions.append(Session.from_record(data, now_mono, now_wall))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("skipping a session record: %s", exc)
        return sessions

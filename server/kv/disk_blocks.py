"""The block store's disk backend: one file per block, `<directory>/<address[:2]>/<address>.safetensors`.

A block is written to a `.partial` file and renamed, so a reader (or a restart after a crash)
sees a whole block or none. Which blocks exist is kept in memory (indexed at start from the
file names, without reading them), so asking costs no I/O; only reading a block touches it.
Which blocks a session needs, and when one may go, is the disk tier's business (`disk_tier.py`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

log = logging.getLogger("kvserve.tiers")
SUFFIX = ".safetensors"
NAME = re.compile(r"[0-9a-f]{40}")


class DiskBlocks:
    errors: tuple[type[Exception], ...] = (OSError,)

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._sizes: dict[str, int] = {}  # address -> bytes of its file
        self._nbytes = 0  # their sum, kept as blocks come and go (the disk tier's budget asks after every write)
        self._lock = threading.Lock()

    def path_for(self, name: str) -> Path:
        if not NAME.fullmatch(name):  # addresses are ours; anything else never reaches a path
            raise ValueError(f"not a block address: {name[:48]!r}")
        return self.directory / name[:2] / f"{name}{SUFFIX}"

    def scan(self) -> int:
        """Index the blocks a previous run left; remove the temporary files a crash left. Returns how many
        temporary files were removed."""
        swept = 0
        for path in self.directory.glob("*/*"):
            name = path.name.removesuffix(SUFFIX)
            if path.name.endswith(SUFFIX) and NAME.fullmatch(name) and path.parent.name == name[:2]:
                size = path.stat().st_size
                with self._lock:
                    self._nbytes += size - self._sizes.get(name, 0)
                    self._sizes[name] = size
            elif path.is_file():
                path.unlink(missing_ok=True)
                swept += 1
        return swept

    def names(self) -> list[str]:
        with self._lock:
            return list(self._sizes)

    def size(self, name: str) -> int:
        with self._lock:
            return self._sizes.get(name, 0)

    @property
    def nbytes(self) -> int:
        """The bytes of every block file held: shared blocks count once."""
        with self._lock:
            return self._nbytes

    def held(self, names: list[str]) -> list[bool]:
        with self._lock:
            return [name in self._sizes for name in names]

    def write(self, items: list[tuple[str, bytes]]) -> int:
        written = 0
        for name, value in items:
            path = self.path_for(name)
            if self.held([name])[0]:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")
            try:
                partial.write_bytes(value)
                with self._lock:
                    os.replace(partial, path)
                    self._nbytes += len(value) - self._sizes.get(name, 0)
                    self._sizes[name] = len(value)
            except BaseException:
                partial.unlink(missing_ok=True)
                raise
            written += 1
        return written

    def read(self, names: list[str]) -> list[bytes | None]:
        found: list[bytes | None] = []
        for name in names:
            try:
                found.append(self.path_for(name).read_bytes() if self.held([name])[0] else None)
            except FileNotFoundError:  # deleted meanwhile (its last session went): a miss
                found.append(None)
        return found

    def delete(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                size = self._sizes.pop(name, None)
                if size is not None:
                    self._nbytes -= size
                    self.path_for(name).unlink(missing_ok=True)

    def close(self) -> None:
        return None

"""A session's K/V as a self-checking snapshot: host tensors in memory, safetensors on disk.

The file format is safetensors (never pickle): tensors `k.{layer}` / `v.{layer}` shaped
[kv_heads, tokens, head_dim] plus `token_ids` [tokens], and a string header naming the
format, its version, the model and its K/V layout (the fingerprint), the session it belongs
to and a SHA-256 over the token ids and every tensor's bytes. A file that fails any check
(truncated, corrupt, another model, another version) raises SnapshotError and is recomputed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from server.sessions.record import SessionKey

FORMAT = "kvserve-kv"
VERSION = "1"


class SnapshotError(Exception):
    """A snapshot that cannot be used; the caller recomputes instead."""


class SnapshotMismatch(SnapshotError):
    """A sound snapshot made by another model (id or K/V layout or weights)."""

    def __init__(self, message: str, model_id: str) -> None:
        super().__init__(message)
        self.model_id = model_id


@dataclass(slots=True)
class Snapshot:
    key: SessionKey
    model_id: str
    fingerprint: str  # K/V layout: a snapshot only fits a model with the same one
    token_ids: list[int]
    k: list[torch.Tensor]  # per layer [kv_heads, tokens, head_dim]
    v: list[torch.Tensor]
    ready: torch.cuda.Event | None = None  # set while an asynchronous copy to host is in flight
    origin: str = "host"  # the tier it was read from: host | disk

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.k + self.v)

    def wait(self) -> None:
        """Block until an asynchronous device-to-host copy has landed."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


def _checksum(token_ids: torch.Tensor, tensors: list[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for tensor in [token_ids, *tensors]:
        digest.update(tensor.contiguous().view(torch.uint8).numpy().data)  # raw bytes, whatever the dtype
    return digest.hexdigest()


def save(snapshot: Snapshot, path: Path) -> int:
    """Write atomically (temporary file, then rename); returns the file's size in bytes."""
    snapshot.wait()
    ids = torch.tensor(snapshot.token_ids, dtype=torch.int64)
    k = [t.contiguous() for t in snapshot.k]
    v = [t.contiguous() for t in snapshot.v]
    tensors = {"token_ids": ids} | {f"k.{i}": t for i, t in enumerate(k)} | {f"v.{i}": t for i, t in enumerate(v)}
    key = snapshot.key
    header = {
        "format": FORMAT,
        "version": VERSION,
        "model": snapshot.model_id,
        "fingerprint": snapshot.fingerprint,
        "session": json.dumps([key.tenant, key.name, key.kind]),
        "num_layers": str(len(k)),
        "sha256": _checksum(ids, k + v),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        save_file(tensors, str(partial), metadata=header)  # safetensors itself writes a `.tmp*` file, then renames
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def read_header(path: Path) -> tuple[SessionKey, str, str, int]:
    """(session, model, fingerprint, tokens) from the header alone, without reading the tensors."""
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            num_tokens = f.get_slice("token_ids").get_shape()[0]
        _check_format(header)
        tenant, name, kind = json.loads(header["session"])
        return SessionKey(tenant, name, kind), header["model"], header["fingerprint"], num_tokens
    except SnapshotError:
        raise
    except Exception as exc:  # safetensors, json, key and type errors all mean "unreadable"
        raise SnapshotError(f"{path.name}: unreadable snapshot ({exc})") from exc


def load(path: Path, model_id: str, expected_fingerprint: str) -> Snapshot:
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            _check_format(header)
            if header["model"] != model_id or header["fingerprint"] != expected_fingerprint:
                made_by = f"made by model {header['model']!r} ({header['fingerprint']})"
                raise SnapshotMismatch(f"{path.name}: {made_by}", header["model"])
            num_layers = int(header["num_layers"])
            ids = f.get_tensor("token_ids")
            k = [f.get_tensor(f"k.{i}") for i in range(num_layers)]
            v = [f.get_tensor(f"v.{i}") for i in range(num_layers)]
        if _checksum(ids, k + v) != header["sha256"]:
            raise SnapshotError(f"{path.name}: checksum mismatch")
        tenant, name, kind = json.loads(header["session"])
    except SnapshotError:
        raise
    except Exception as exc:
        raise SnapshotError(f"{path.name}: unreadable snapshot ({exc})") from exc
    key = SessionKey(tenant, name, kind)
    return Snapshot(key, model_id, expected_fingerprint, ids.tolist(), k, v, origin="disk")


def _check_format(header: dict[str, str]) -> None:
    if header.get("format") != FORMAT:
        raise SnapshotError(f"not a {FORMAT} snapshot")
    if header.get("version") != VERSION:
        raise SnapshotError(f"snapshot version {header.get('version')!r}, this server reads {VERSION!r}")

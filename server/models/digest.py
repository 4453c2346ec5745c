"""What decides the K/V a model computes for a token id, as digests: its weights, its config and its tokenizer.

Together with the K/V layout (layers, heads, head size, dtype) they make the model's K/V fingerprint
(`KVLayout.fingerprint`), which is part of every block address: two processes share K/V only when
all of it is equal.

- Weights: every tensor of the model's safetensors files (the ones transformers loads: the index's
  shards, or `model.safetensors`), in the order of their names, each as name, dtype, shape and
  every stored byte. Streamed from the files a buffer at a time (the model is never in memory
  twice), so it is the weights as stored, before any cast or packing, and independent of how
  they are split into shards. The result is kept beside the files (`DIGEST_FILE`), keyed by each
  file's name, size, modification and change times and inode, so a restart reads it instead of
  reading the weights again (the change time and inode because tools that copy or unpack files
  keep, or zero, the modification time: only a write in place in the same clock tick, with the
  same size, would go unseen); a directory we cannot write to is digested at every load (and
  says so). A model without
  safetensors files is digested from its loaded parameters (the same streaming, one tensor at a
  time; nothing kept).
- Config: the architecture's settings (RoPE, norms, activations: what the tensors are used with),
  without the fields that only name the loading (`transformers_version`, `dtype`, private ones).
- Tokenizer: its whole serialized pipeline and vocabulary (added tokens included); the ids a text
  becomes are what a session's transcript and every block address are made of.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from io import FileIO
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("kvserve.registry")
DIGEST_FILE = ".kvserve-weights-digest.json"
VERSION = 1  # of the digest's definition: a cache written under another is not read
CHUNK = 8 << 20  # bytes read and hashed at a time
SHORT = 32  # hex digits kept of each digest (128 bits)
# Config fields that describe how the model was saved or is run, not what it computes.
CONFIG_NOISE = frozenset(
    {"transformers_version", "dtype", "torch_dtype", "use_cache", "output_attentions", "output_hidden_states"}
    | {"return_dict"}
)


@dataclass(slots=True, frozen=True)
class ModelDigests:
    weights: str
    config: str
    tokenizer: str

    @property
    def text(self) -> str:
        """What `KVLayout.fingerprint` folds in next to the layout."""
        return f"weights={self.weights},config={self.config},tokenizer={self.tokenizer}"

    @classmethod
    def of_loaded(cls, model: Any, tokenizer: Any) -> ModelDigests:
        """For a model built in memory (no files): its parameters as they are now."""
        return cls(state_dict_digest(model), config_digest(model.config), tokenizer_digest(tokenizer))


def safetensors_files(directory: Path) -> list[Path] | None:
    """The weight files transformers loads from this directory (the index's shards, or the single file); None
    when it holds no safetensors weights."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    return [single] if single.exists() else None


def weights_digest(directory: Path) -> str | None:
    """The digest of every stored weight of the model in `directory`, from the cache beside them when its key
    (each file's name and `_stat_key`) still holds; None when the directory holds no safetensors weights."""
    files = safetensors_files(directory)
    if files is None:
        return None
    key = [[path.name, *_stat_key(path)] for path in files]
    cache = directory / DIGEST_FILE
    cached = _read_cache(cache)
    if cached is not None and cached.get("version") == VERSION and cached.get("files") == key:
        return str(cached["weights"])
    started = time.monotonic()
    digest = _digest_tensors(files)
    num_bytes = sum(path.stat().st_size for path in files)
    log.info("weights in %s digested: %.0f MB in %.2f s", directory, num_bytes / 1e6, time.monotonic() - started)
    partial = cache.with_name(f"{cache.name}.{os.getpid()}.partial")
    try:
        partial.write_text(json.dumps({"version": VERSION, "files": key, "weights": digest}))
        partial.replace(cache)  # atomic: replicas starting together each write a whole file
    except OSError as exc:
        log.info("the weights digest is not cached in %s (%s): it is computed again at each load", directory, exc)
        partial.unlink(missing_ok=True)
    return digest


def _stat_key(path: Path) -> list[int]:
    stat = path.stat()  # follows links: the hub cache's snapshots link to its blobs
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def _read_cache(path: Path) -> dict | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _digest_tensors(files: list[Path]) -> str:
    """Every tensor of these safetensors files, by name: name, dtype, shape, then its bytes a chunk at a time."""
    digest = hashlib.sha256(f"kvserve-weights-{VERSION}".encode())
    handles = [open(path, "rb", buffering=0) for path in files]  # noqa: SIM115 - closed below
    try:
        entries = sorted((entry for handle in handles for entry in _tensor_entries(handle)), key=lambda e: e[0])
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        for name, dtype, shape, handle, start, end in entries:
            digest.update(json.dumps([name, dtype, shape, end - start]).encode())
            handle.seek(start)
            for got in _chunks(handle, end - start, buffer):
                digest.update(view[:got])
    finally:
        for handle in handles:
            handle.close()
    return digest.hexdigest()[:SHORT]


def _tensor_entries(handle: FileIO) -> Iterator[tuple[str, str, list[int], FileIO, int, int]]:
    """(name, dtype, shape, file, start, end) of each tensor in a safetensors file: an 8-byte little-endian
    header length, a JSON header, then the data the header's offsets point into."""
    (header_len,) = struct.unpack("<Q", handle.read(8))
    header = json.loads(handle.read(header_len))
    base = 8 + header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        yield name, info["dtype"], list(info["shape"]), handle, base + start, base + end


def _chunks(handle: FileIO, num_bytes: int, buffer: bytearray) -> Iterator[int]:
    view = memoryview(buffer)
    while num_bytes > 0:
        got = handle.readinto(view[: min(num_bytes, len(buffer))])
        if not got:
            raise ValueError(f"{getattr(handle, 'name', 'a weights file')} ends before its header says")
        num_bytes -= got
        yield got


def state_dict_digest(model: torch.nn.Module) -> str:
    """The same over a loaded model's tensors (parameters and buffers), one tensor at a time on the CPU."""
    digest = hashlib.sha256(f"kvserve-loaded-weights-{VERSION}".encode())
    for name, tensor in sorted(model.state_dict(keep_vars=False).items()):
        flat = tensor.detach().reshape(-1).to("cpu").contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        digest.update(json.dumps([name, dtype, list(tensor.shape), flat.numel() * flat.element_size()]).encode())
        if flat.numel():
            digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()[:SHORT]


def config_digest(config: Any) -> str:
    """The text model's config as canonical JSON, without the fields that only describe saving or running it."""
    fields = config.to_dict()
    kept = {k: v for k, v in fields.items() if k not in CONFIG_NOISE and not k.startswith("_")}
    text = json.dumps(kept, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:SHORT]


def tokenizer_digest(tokenizer: Any) -> str:
    """A fast tokenizer's whole serialized pipeline (normalizer, pre-tokenizer, vocabulary, merges, added
    tokens); otherwise its vocabulary with the added tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        added = {str(token): int(i) for i, token in tokenizer.added_tokens_decoder.items()}
        text = json.dumps([type(tokenizer).__name__, sorted(tokenizer.get_vocab().items()), added], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:SHORT]

"""A session's K/V off the device: a snapshot in host memory, and the stored form of its blocks.

A `Snapshot` holds per-layer host tensors [kv_heads, tokens, row] for a prefix of a transcript,
stored as its layout says (the pool's format, or 8 bits where a tier keeps fewer). Below host RAM
the K/V is kept a block at a time (`server/kv/block_store.py`), and every backend of the block
store (a disk directory, Redis) holds the same bytes per block: a safetensors document (never
pickle) with one tensor `kv` [2, layers, kv_heads, tokens, row] (K then V; quantized rows are
head_dim values and their scale) and a header naming the format and its version, the block's
content address, the K/V dtype it is stored in and a SHA-256 of the tensor's bytes: equal blocks
are equal bytes. A value that fails any check (truncated, flipped, another format or version,
stored under another address, another shape) decodes to None and its tokens are recomputed,
never served.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from server.kv.pool import KVLayout
from server.sessions.record import SessionKey

log = logging.getLogger("kvserve.tiers")
FORMAT = "kvserve-kv-block"
VERSION = "1"


@dataclass(slots=True)
class Snapshot:
    key: SessionKey
    model_id: str
    layout: KVLayout  # how its K/V is stored (a tier may keep it in fewer bits than the pool: converted back)
    digests: str  # the model's weights, config and tokenizer (`ModelDigests.text`): what else decides its K/V
    token_ids: list[int]
    k: list[torch.Tensor]  # per layer [kv_heads, tokens, row] as `layout` stores it
    v: list[torch.Tensor]
    ready: torch.cuda.Event | None = None  # set while an asynchronous copy to host is in flight
    origin: str = "host"  # the tier it was read from: host | disk | shared
    # A copy made for a restore on CUDA (server/kv/transfers.py): k and v are device tensors, copied on the side
    # stream from `staged` (pinned host tensors) and usable by the compute stream once it waits for this event.
    uploaded: Any = None
    staged: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        """The storage really held: views of one tensor (a run read from the block store) count it once."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.k + self.v}
        return sum(storages.values())

    def wait(self) -> None:
        """Block until an asynchronous device-to-host copy has landed (the engine and the disk writer may both
        ask, for a snapshot that is on its way to disk and restored meanwhile)."""
        ready = self.ready
        if ready is not None:
            ready.synchronize()  # an event may be waited on again
            self.ready = None


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.view(torch.uint8).numpy().data).hexdigest()  # raw bytes, whatever the dtype


def encode_block(address: str, k: list[torch.Tensor], v: list[torch.Tensor]) -> bytes:
    """One block's K and V (per layer [kv_heads, tokens, row], as the pool stores them) as the bytes every backend
    stores."""
    kv = torch.stack([torch.stack(k), torch.stack(v)])  # [2, layers, kv_heads, tokens, row], one copy
    kv_dtype = str(kv.dtype).removeprefix("torch.")
    header = {"version": VERSION, "address": address, "kv_dtype": kv_dtype, "sha256": _digest(kv)}
    # One metadata entry, its keys sorted: safetensors stores a map in no fixed order, and equal blocks should be
    # equal bytes wherever they are kept.
    return bytes(save_tensors({"kv": kv}, metadata={FORMAT: json.dumps(header, sort_keys=True)}))


def decode_block(address: str, value: bytes, layout: KVLayout) -> torch.Tensor | None:
    """A stored block's K and V as [2, layers, kv_heads, tokens, head_dim], or None (logged) when the value fails
    a check."""
    try:
        size = int.from_bytes(value[:8], "little")  # safetensors: the header's length, then the header
        metadata = json.loads(value[8 : 8 + size]).get("__metadata__") or {}
        if FORMAT not in metadata:
            raise ValueError(f"not a {FORMAT}")
        header = json.loads(metadata[FORMAT])
        if header.get("version") != VERSION:
            raise ValueError(f"version {header.get('version')!r}, this server reads {VERSION!r}")
        if header.get("address") != address:
            raise ValueError("stored under another address")
        stored = str(layout.storage_dtype).removeprefix("torch.")
        if header.get("kv_dtype", str(layout.dtype).removeprefix("torch.")) != stored:
            raise ValueError(f"K/V stored as {header.get('kv_dtype')}, this pool's is {stored}")
        kv: torch.Tensor = load_tensors(value)["kv"]
        expected = (2, layout.num_layers, layout.num_kv_heads, layout.row_width)
        if kv.dtype != layout.storage_dtype or kv.dim() != 5 or (*kv.shape[:3], kv.shape[4]) != expected:
            raise ValueError(f"shape {tuple(kv.shape)} {kv.dtype}, not this model's K/V")
        if _digest(kv) != header.get("sha256"):
            raise ValueError("checksum mismatch")
    except Exception as exc:  # safetensors, json, key and value errors all mean "unusable"
        log.warning("a K/V block failed its check (%s): its tokens are recomputed", exc)
        return None
    return kv

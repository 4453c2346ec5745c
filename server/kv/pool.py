"""The paged K/V pool: per layer, K and V as [kv_heads, num_blocks * block_size, head_dim] on the device.

A token's slot is block_id * block_size + offset. The pool only holds tensors; which block
holds what is the BlockManager's business (server/kv/blocks.py).

The K/V may be stored in fewer bits than the model computes in (`kv_dtype`): int8, or fp8 e4m3.
Each token's vector per kv head is scaled on its own (symmetric: scale = max |x| / the format's
largest value), and its float32 scale is kept in the same row, after its head_dim values: a
quantized pool is [kv_heads, slots, head_dim + 4] of one-byte elements. So everything that moves
K/V as rows (a partial block's copy, snapshots, the disk and Redis blocks) moves the scales with
it, and stores the quantized bytes as they are. Only the slots a step reads are dequantized.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

import torch

from server.kv.transfers import transfers_for

KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # the quantized formats, by their setting's name
_LARGEST = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_BYTES = 4  # a float32 scale after each quantized row
TIER_KV_DTYPES = ("pool", "int8", "fp8")  # how a tier below the pool may keep K/V: as it comes, or in 8 bits


@dataclass(slots=True, frozen=True)
class KVLayout:
    """The shape of one token's K/V in a model: what a pool is sized by and a snapshot must match."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's compute dtype: what attention reads and writes
    kv_dtype: torch.dtype | None = None  # the stored K/V's when quantized (int8, fp8 e4m3); None: `dtype`

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> KVLayout:
        text = config.get_text_config(decoder=True)
        num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        stored = kv_dtype if kv_dtype is not None and kv_dtype != dtype else None
        return cls(int(text.num_hidden_layers), int(num_kv_heads), int(head_dim), dtype, stored)

    @property
    def is_quantized(self) -> bool:
        return self.kv_dtype is not None

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.kv_dtype if self.kv_dtype is not None else self.dtype

    @property
    def row_width(self) -> int:
        """Elements of one token's row per kv head as stored: head_dim, and the scale's bytes when quantized."""
        return self.head_dim + (SCALE_BYTES if self.is_quantized else 0)

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x a row's bytes (head_dim elements, + a float32 scale when quantized)."""
        element = torch.empty((), dtype=self.storage_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.row_width * element

    @property
    def computed(self) -> KVLayout:
        """This layout unquantized: K/V of two layouts with the same one are the same values, stored two ways."""
        return replace(self, kv_dtype=None)

    def stored_as(self, name: str) -> KVLayout:
        """How a tier set to `name` (TIER_KV_DTYPES) keeps K/V that comes to it in this layout: as it comes
        (`pool`), or quantized when it comes unquantized (already 8 bits: nothing smaller, so as it comes)."""
        if name == "pool" or self.is_quantized:
            return self
        return replace(self, kv_dtype=KV_DTYPES[name])

    @property
    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        stored = f",kv_dtype={str(self.kv_dtype).removeprefix('torch.')}" if self.kv_dtype is not None else ""
        return f"layers={self.num_layers},kv_heads={self.num_kv_heads},head_dim={self.head_dim},dtype={dtype}{stored}"

    def fingerprint(self, model: str = "") -> str:
        """The K/V fingerprint: a digest of this layout and of `model`, what else decides a token's K/V (the
        weights', config's and tokenizer's digests: `server/models/digest.py`). It is part of every block
        address, so K/V computed by another model or in another dtype, or stored in another K/V dtype, is never
        found."""
        return hashlib.blake2b(f"{self.describe}\0{model}".encode(), digest_size=16).hexdigest()


def stored_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """The `kv_dtype` setting for a model computing in `dtype` on `device`: the quantized format to store K/V in,
    or None for the compute dtype (auto, compute). fp8 needs torch's float8_e4m3fn on the device."""
    if name in ("auto", "compute"):
        return None
    if name not in KV_DTYPES:
        raise ValueError(f"kv_dtype {name!r}: expected auto, compute, int8 or fp8")
    stored = KV_DTYPES[name]
    try:
        quantize(torch.ones(1, 8, device=device), stored)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"kv_dtype {name!r} is not supported by torch on {device}: {exc}") from exc
    return stored


def quantize(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """[..., D] in any float dtype -> [..., D + 4] rows in `kv_dtype`: each vector scaled so its largest magnitude
    is the format's largest value, its float32 scale in the last four bytes (a zero vector: scale 0)."""
    largest = _LARGEST[kv_dtype]
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / largest
    scaled = x * torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    if kv_dtype == torch.int8:
        values = scaled.round_().clamp_(-largest, largest).to(torch.int8)
    else:
        values = scaled.clamp_(-largest, largest).to(kv_dtype)
    return torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], -1).view(kv_dtype)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] quantized rows -> [..., D] in `dtype`."""
    raw = rows.view(torch.uint8)
    dim = raw.shape[-1] - SCALE_BYTES
    scale = raw[..., dim:].contiguous().view(torch.float32)
    return (raw[..., :dim].view(rows.dtype).float() * scale).to(dtype)


def convert(rows: torch.Tensor, source: KVLayout, target: KVLayout) -> torch.Tensor:
    """Rows [..., row] stored in `source`'s format as `target` stores them (the same layout: as they are)."""
    if source.storage_dtype == target.storage_dtype:
        return rows
    values = dequantize(rows, source.dtype) if source.is_quantized else rows
    return quantize(values, target.kv_dtype) if target.kv_dtype is not None else values.to(target.dtype)


class KVPool:
    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, device: torch.device) -> None:
        shape = (layout.num_kv_heads, num_blocks * block_size, layout.row_width)
        stored = layout.storage_dtype
        # empty, not zeros: slots are read only after they are written, and untouched pages cost no RAM
        self.k = [torch.empty(shape, dtype=stored, device=device) for _ in range(layout.num_layers)]
        self.v = [torch.empty(shape, dtype=stored, device=device) for _ in range(layout.num_layers)]
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.transfers = transfers_for(device)  # copies to and from host memory (a side stream on CUDA)

    @property
    def is_quantized(self) -> bool:
        return self.layout.is_quantized

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.k + self.v)

    def host_regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of each K and V tensor's storage in host memory (none for a device's pool): which of
        their pages are in RAM says how much of the pool has been written (`server/memory.py: resident_bytes`)."""
        if self.device.type != "cpu":
            return []
        return [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in self.k + self.v]

    def slot_ids(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """The slots of positions start..end-1 of a sequence whose positions fill these blocks in order."""
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """[num_tokens] slot ids of the first `num_tokens` tokens held by these blocks, in order."""
        return torch.tensor(self.slot_ids(block_ids, 0, num_tokens), dtype=torch.long, device=self.device)

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """A step's new K and V [kv_heads, len(slots), head_dim] (the compute dtype) into their slots."""
        kv_dtype = self.layout.kv_dtype
        if kv_dtype is not None:
            key, value = quantize(key, kv_dtype), quantize(value, kv_dtype)
        for pool, new in ((self.k[layer], key), (self.v[layer], value)):
            _bits(pool).index_copy_(1, slots, _bits(new.to(pool.dtype)))

    def read(self, layer: int, lo: int, hi: int, slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V [kv_heads, n, head_dim] in the compute dtype: slots lo..hi-1 (a view of a pool that
        is not quantized), or with `slots` those slots. A quantized pool dequantizes these slots alone."""
        k_pool, v_pool = self.k[layer], self.v[layer]
        if slots is None:
            k, v = k_pool[:, lo:hi], v_pool[:, lo:hi]
        else:
            k, v = _select(k_pool, slots), _select(v_pool, slots)
        if not self.is_quantized:
            return k, v
        return dequantize(k, self.layout.dtype), dequantize(v, self.layout.dtype)

    def copy_slots(self, src_block: int, dst_block: int, num_slots: int) -> None:
        """Divergence inside a block: the new block starts as a copy of the matching slots."""
        src, dst = src_block * self.block_size, dst_block * self.block_size
        for tensor in self.k + self.v:
            raw = _bits(tensor)
            raw[:, dst : dst + num_slots] = raw[:, src : src + num_slots]

    def gather(
        self, slots: torch.Tensor, layout: KVLayout | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of these slots' K and V, per layer [kv_heads, len(slots), row], as `layout` stores them (None: as
        the pool does; converted on the device)."""
        target = layout or self.layout
        k = [convert(_select(t, slots), self.layout, target) for t in self.k]
        return k, [convert(_select(t, slots), self.layout, target) for t in self.v]

    def scatter(
        self, slots: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], layout: KVLayout | None = None
    ) -> None:
        """Write per-layer K and V [kv_heads, len(slots), row] stored as `layout` stores them (None: as the pool
        does) into these slots, converted on the device to the pool's format (one copy per layer)."""
        source = layout or self.layout
        for pool_k, pool_v, layer_k, layer_v in zip(self.k, self.v, k, v, strict=True):
            for pool, rows in ((pool_k, layer_k), (pool_v, layer_v)):
                rows = convert(rows.to(self.device, non_blocking=True), source, self.layout)
                _bits(pool).index_copy_(1, slots, _bits(rows))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their bytes: torch's CPU index_copy and index_select do not take fp8 (a view, no copy)."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def _select(tensor: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return _bits(tensor).index_select(1, slots).view(tensor.dtype)

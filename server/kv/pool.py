"""The paged K/V pool: per layer, K and V as [kv_heads, num_blocks * block_size, head_dim] on the device.

A token's slot is block_id * block_size + offset. The pool only holds tensors; which block
holds what is the BlockManager's business (server/kv/blocks.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True, frozen=True)
class KVLayout:
    """The shape of one token's K/V in a model: what a pool is sized by and a snapshot must match."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype) -> KVLayout:
        text = config.get_text_config(decoder=True)
        num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(int(text.num_hidden_layers), int(num_kv_heads), int(head_dim), dtype)

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @property
    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"layers={self.num_layers},kv_heads={self.num_kv_heads},head_dim={self.head_dim},dtype={dtype}"

    def fingerprint(self, model: str = "") -> str:
        """The K/V fingerprint: a digest of this layout and of `model`, what else decides a token's K/V (the
        weights', config's and tokenizer's digests: `server/models/digest.py`). It is part of every block
        address, so K/V computed by another model, or in another dtype, is never found."""
        return hashlib.blake2b(f"{self.describe}\0{model}".encode(), digest_size=16).hexdigest()


class KVPool:
    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, device: torch.device) -> None:
        shape = (layout.num_kv_heads, num_blocks * block_size, layout.head_dim)
        # empty, not zeros: slots are read only after they are written, and untouched pages cost no RAM
        self.k = [torch.empty(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]
        self.v = [torch.empty(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.k + self.v)

    def slot_ids(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """The slots of positions start..end-1 of a sequence whose positions fill these blocks in order."""
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """[num_tokens] slot ids of the first `num_tokens` tokens held by these blocks, in order."""
        return torch.tensor(self.slot_ids(block_ids, 0, num_tokens), dtype=torch.long, device=self.device)

    def copy_slots(self, src_block: int, dst_block: int, num_slots: int) -> None:
        """Divergence inside a block: the new block starts as a copy of the matching slots."""
        src, dst = src_block * self.block_size, dst_block * self.block_size
        for tensor in self.k + self.v:
            tensor[:, dst : dst + num_slots] = tensor[:, src : src + num_slots]

    def gather(self, slots: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of these slots' K and V, per layer [kv_heads, len(slots), head_dim]."""
        return [t.index_select(1, slots) for t in self.k], [t.index_select(1, slots) for t in self.v]

    def scatter(self, slots: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Write per-layer K and V [kv_heads, len(slots), head_dim] into these slots (one copy per layer)."""
        for pool_k, pool_v, layer_k, layer_v in zip(self.k, self.v, k, v, strict=True):
            pool_k.index_copy_(1, slots, layer_k.to(self.device, non_blocking=True))
            pool_v.index_copy_(1, slots, layer_v.to(self.device, non_blocking=True))

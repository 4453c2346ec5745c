"""Cascade heads laid out once: a head's keys and values in the paged kernel's layout, kept across steps.

A head is the keys several decode rows share (a cached system prompt behind many conversations).
`kvserve::paged_shared_keys` lays them out for the kernel (16 keys across the lanes, values in key
pairs) on every call: each layer, each step, for keys that do not change while the rows decode. On a
2-core EPYC (default model, 1,366 shared keys, 8 rows, both threads) that call takes 121 us per layer;
attending from a kept layout 71 us, and laying it out once 32 us.

A kept layout is valid while its blocks hold what it was read from. Its key is the blocks' stamps
(server/kv/blocks.py: a block gets a new stamp each time it is handed out for new contents or cut), so
a block that now holds other tokens never matches. Within one stamp a head's blocks do not change:
a head takes only blocks that are full before every row's own token, the engine writes K/V only at
or past a sequence's computed tokens, and copies and restores go into blocks just handed out. A path
that rewrote a full block in place would have to give it a new stamp.

A step keeps the layouts of its own heads and drops the rest (a step with no rows drops them all).
Those it keeps fit a byte limit (a quarter of the pool, at most 256 MiB). A head beyond the limit is
laid out per call, as before.
"""

from __future__ import annotations

import torch

from server.kv.pool import KVLayout

MAX_BYTES = 256 << 20
_TILE = 16  # keys per tile of the layout: a head's keys are padded to a multiple


class _Tally:
    __slots__ = ("made",)

    def __init__(self) -> None:
        self.made = 0


class HeadLayout:
    """One head's layouts, one per layer, each made by the first call that needs it."""

    __slots__ = ("_block_size", "_layers", "_tally")

    def __init__(self, num_layers: int, block_size: int, tally: _Tally) -> None:
        self._layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self._block_size = block_size
        self._tally = tally  # the owner's count (not the owner: no cycle keeps a dropped layout alive)

    def of_layer(
        self, layer: int, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor, num_keys: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values laid out (made now if this is the first call for the layer)."""
        made = self._layers[layer]
        if made is None:
            made = torch.ops.kvserve.paged_keys_layout(k_pool, v_pool, blocks, num_keys, self._block_size)
            self._layers[layer] = made
            self._tally.made += 1
        return made

    def made(self) -> list[torch.Tensor]:
        """The layouts made so far, keys and values of each layer that has one."""
        return [t for layer in self._layers if layer is not None for t in layer]


class HeadLayouts:
    """The layouts kept for a pool's heads, by the stamps of their blocks."""

    def __init__(self, layout: KVLayout, block_size: int, limit_bytes: int) -> None:
        self.layout = layout
        self.block_size = block_size
        self.limit_bytes = limit_bytes
        self._tally = _Tally()
        self._kept: dict[tuple[int, ...], HeadLayout] = {}

    @classmethod
    def for_pool(cls, layout: KVLayout, block_size: int, pool_bytes: int) -> HeadLayouts:
        return cls(layout, block_size, min(MAX_BYTES, pool_bytes // 4))

    def nbytes(self, num_blocks: int) -> int:
        """What a head of this many blocks takes laid out: keys and values, 4 bytes per pair of dimensions each
        (padded to whole tiles), every kv head of every layer."""
        keys = -(-num_blocks * self.block_size // _TILE) * _TILE
        return 2 * keys * self.layout.head_dim * 2 * self.layout.num_kv_heads * self.layout.num_layers

    def for_step(self, stamps: list[tuple[int, ...]]) -> list[HeadLayout | None]:
        """The layouts of a step's heads (given by their blocks' stamps), in order: a kept one, a new one where
        it fits the limit, else None. Heads this step does not use are dropped."""
        kept: dict[tuple[int, ...], HeadLayout] = {}
        used = 0
        for key in sorted(dict.fromkeys(stamps), key=lambda k: k not in self._kept):  # the kept ones first: they stay
            size = self.nbytes(len(key))
            if used + size <= self.limit_bytes:
                made = self._kept.get(key)
                kept[key] = made or HeadLayout(self.layout.num_layers, self.block_size, self._tally)
                used += size
        self._kept = kept
        return [kept.get(key) for key in stamps]

    @property
    def kept_bytes(self) -> int:
        """The storage the kept layouts hold (each layer's made by its first call: a head's bytes come as used)."""
        return sum(t.untyped_storage().nbytes() for head in self._kept.values() for t in head.made())

    @property
    def num_made(self) -> int:
        """Layer layouts made since start (tests count them)."""
        return self._tally.made

    @property
    def num_kept(self) -> int:
        return len(self._kept)

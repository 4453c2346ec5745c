"""What one model's engine holds in memory, by part (GET /v1/models/{id}, the load log; docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

MIB = 2**20


@dataclass(slots=True, frozen=True)
class ResidentBytes:
    """Bytes of storage really held, each storage counted once. The parts add up to `total`; `kv_pool_touched`
    is not a part but how much of `kv_pool` has pages in RAM (a pool is allocated whole at start, and a page of
    it takes memory once a slot on it is first written)."""

    PARTS: ClassVar[tuple[str, ...]] = (
        "weights", "packed_weights", "gemv_weights", "kv_pool", "head_layouts", "host_tier"
    )  # fmt: skip

    weights: int  # the model's parameters and buffers as tensors: the embedding, norms; every weight not packed
    packed_weights: int  # linear weights packed for oneDNN (prefill chunks, steps of more than 8 rows)
    gemv_weights: int  # their copies for kvserve::bf16_gemv (decode steps of up to 8 rows); 0 in deterministic mode
    kv_pool: int  # the paged K/V pool, as allocated
    head_layouts: int  # cascade heads' K/V laid out for the tiled kernel, kept across steps
    host_tier: int  # this model's K/V snapshots in host RAM (those on their way to disk included)
    kv_pool_touched: int | None  # of kv_pool, the bytes whose pages are in RAM now (None: not known, a device's)

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in self.PARTS)

    def as_dict(self) -> dict[str, int | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"total": self.total}

    def describe(self) -> str:
        """One line for the load log, in MiB."""
        touched = "" if self.kv_pool_touched is None else f" ({self.kv_pool_touched / MIB:.0f} MiB of it touched)"
        return (
            f"weights {self.weights / MIB:.0f} MiB, packed for oneDNN {self.packed_weights / MIB:.0f} MiB, "
            f"bf16_gemv copies {self.gemv_weights / MIB:.0f} MiB, K/V pool {self.kv_pool / MIB:.0f} MiB{touched}, "
            f"head layouts {self.head_layouts / MIB:.0f} MiB, host tier {self.host_tier / MIB:.0f} MiB; "
            f"total {self.total / MIB:.0f} MiB"
        )

"""How an engine is sized and scheduled (built from the settings by the host)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class EngineConfig:
    budget_bytes: int  # the paged pool's size
    block_size: int = 16  # tokens per block
    max_batch_tokens: int = 256  # tokens per step: decode tokens + prefill chunks
    max_queue: int = 64  # requests waiting for blocks; more are refused (429)
    is_prefix_caching: bool = True  # share and keep K/V blocks by prefix
    compile_dir: str | None = None  # compile the model (CPU), its artifacts kept here; None: eager
    kv_dtype: str = "auto"  # how the pool stores K/V: auto | compute | int8 | fp8 (server/kv/pool.py)
    deterministic: bool = False  # a token's K/V and logits independent of batch, chunks and cache (model_runner)
    attention: str = "auto"  # the attention backend: auto (chosen by the machine) or one of backends.BACKENDS
    cuda_graphs: bool = True  # capture decode steps as CUDA graphs (CUDA with the Triton backend only)

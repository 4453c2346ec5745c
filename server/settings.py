"""All configuration in one object, from KVSERVE_* environment variables, a .env file or the CLI."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

GIB = 1 << 30


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVSERVE_", env_file=".env", extra="ignore")

    @field_validator("state_dir", mode="before")
    @classmethod
    def _empty_is_none(cls, value):
        return None if value in ("", None) else value

    @field_validator("log_level", mode="before")
    @classmethod
    def _any_case(cls, value):
        return value.lower() if isinstance(value, str) else value

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0: any free port")
    models_file: Path = Path("models/models.toml")
    model: str | None = Field(None, description="serve this path or hub id instead of models_file")
    cache_dir: Path = Field(Path("models/cache"), description="converted weights (GGUF -> safetensors)")
    kv_budget_bytes: int | None = Field(
        None,
        description="bytes of K/V per model (the paged pool's size); default: a quarter of RAM up to 4 GiB on CPU, "
        "half the free device memory on CUDA",
    )
    session_ttl_s: float = Field(3600.0, gt=0, description="idle sessions are forgotten after this")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per block of the paged K/V pool")
    max_batch_tokens: int = Field(256, ge=1, description="tokens per engine step (decode tokens + prefill chunks)")
    max_queue: int = Field(64, ge=1, description="requests waiting for K/V blocks; more answer 429")
    prefix_caching: bool = Field(True, description="share and keep K/V blocks by prefix (false: recompute all)")
    kv_dtype: Literal["auto", "compute", "int8", "fp8"] = Field(
        "auto",
        description="how K/V is stored, for models whose models.toml entry does not say: compute (the model's "
        "dtype), int8 or fp8 (e4m3: 8 bits with a scale per token and kv head, about half the bytes of bf16); auto: "
        "the compute dtype (docs/benchmarks.md, 'Quantized K/V', measures what the 8-bit ones cost)",
    )
    deterministic: Literal["auto"] | bool = Field(
        False,
        description="true: a greedy or seeded turn's tokens do not depend on what was cached, where the prompt was "
        "cut into chunks or which rows shared a step (docs/architecture.md, 'Deterministic mode'); auto: true for "
        "models computing in bf16 or fp16, where rounding can make the cache change answers; false (the default): "
        "the faster kernels, whose rounding depends on the step (its price: docs/benchmarks.md)",
    )
    cuda_graphs: bool = Field(
        True,
        description="on a CUDA device with the Triton backend, capture decode steps of 1 to 64 rows (up to "
        "max_batch_tokens) as CUDA graphs at start (ready once done; the time is logged); false: every step eager",
    )
    compile: bool = Field(
        False,
        description="compile each CPU model's dense part with torch.compile at start (a minute or two the first "
        "time, artifacts kept under cache_dir/inductor; ready only when done)",
    )
    state_dir: Path | None = Field(
        Path(".kvserve"),
        description="where sessions (JSON transcripts) and K/V snapshots (safetensors) persist across restarts; "
        "empty: memory only",
    )
    host_kv_budget_bytes: int | None = Field(
        None,
        ge=0,
        description="host RAM for K/V evicted from the device; default 0 on CPU (the pool is host RAM), "
        "a quarter of RAM up to 16 GiB with CUDA",
    )
    disk_kv_budget_bytes: int = Field(20 * GIB, ge=0, description="disk for K/V snapshots under state_dir/kv")
    host_kv_dtype: Literal["pool", "int8", "fp8"] = Field(
        "pool",
        description="how host RAM keeps K/V evicted from the device: as the pool stores it, or int8 or fp8 (8 bits "
        "with a scale per token and kv head) where the pool keeps more; restored into the pool's format",
    )
    disk_kv_dtype: Literal["pool", "int8", "fp8"] = Field(
        "pool", description="how the disk tier keeps K/V: as host RAM holds it, or int8 or fp8 where that is more"
    )
    shared_kv_dtype: Literal["pool", "int8", "fp8"] = Field(
        "pool", description="how the K/V blocks replicas share in Redis are kept: as the pool stores it, or int8 or fp8"
    )
    response_retention_s: float = Field(
        30 * 86400.0, gt=0, description="stored /v1/responses results are kept this long after last use"
    )
    api_keys: str | None = Field(
        None, description="comma-separated KEY:TENANT pairs; when set, every route but /health and /ready needs a key"
    )
    api_keys_file: Path | None = Field(None, description="a file of KEY:TENANT lines (# comments)")
    metrics_needs_key: bool = Field(True, description="with API keys: /metrics needs one too")
    max_request_bytes: int = Field(8 << 20, gt=0, description="larger request bodies answer 413")
    max_tokens_limit: int = Field(8192, gt=0, description="the largest max_tokens a request may ask for")
    max_sessions_per_tenant: int = Field(10_000, gt=0, description="sessions and stored responses per tenant (429)")
    max_tenant_kv_bytes: int = Field(
        16 * GIB, gt=0, description="K/V a tenant's sessions may hold, counted as transcript tokens x bytes/token (429)"
    )
    max_connections: int | None = Field(
        None, ge=1, description="open connections at most; default: the open files limit less a reserve"
    )
    header_timeout_s: float = Field(10.0, gt=0, description="a request header not whole by then closes its connection")
    body_timeout_s: float = Field(30.0, gt=0, description="a request body not whole by then is answered 408")
    max_unread_events: int = Field(
        1024, gt=0, description="stream events a client may leave unread before its request is ended"
    )
    log_prompts: bool = Field(False, description="debug only: log prompt text (never on by default)")
    control_tokens_in_messages: bool = Field(
        False,
        description="read a control token spelt in a message's text (<|im_start|>, ...) as that token; off, such "
        "text is plain text, so no message can forge a turn of another role",
    )
    playground: bool = Field(True, description="serve the playground page at / and /playground")
    default_max_tokens: int = Field(512, gt=0, description="when a request gives no max_tokens")
    request_timeout_s: float = Field(600.0, gt=0, description="a request running longer is ended")
    shutdown_grace_s: float = Field(10.0, ge=0, description="on SIGTERM, how long open requests may finish")
    # Python's logging levels that uvicorn knows too (its own "trace" is no logging level until uvicorn is imported)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    shared_url: str | None = Field(
        None,
        description="redis://host:port/db of the store the replicas share (unset: one process, no Redis); "
        "a session's turn then holds a lease there, so it runs on one replica at a time",
    )
    shared_lease_s: float = Field(
        15.0, gt=0, description="a session lease's expiry: renewed while its turn runs, lost when its replica dies"
    )
    shared_blocks_url: str | None = Field(
        None,
        description="redis://host:port/db of the store for shared K/V blocks, when it is not KVSERVE_SHARED_URL's: "
        "blocks are a cache an LRU may evict, records and leases are not (docs/deploy.md)",
    )
    shared_resolve_s: float = Field(
        10.0,
        gt=0,
        description="how long a change sent to the shared store whose answer never came is asked after before the "
        "client is told its outcome is unknown (503 shared_store_uncertain)",
    )
    replica_id: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="names this process in the X-Kvserve-Replica header of every answer (default: the host name)",
    )


def default_kv_budget(device_type: str, free_device_bytes: int | None, total_ram_bytes: int) -> int:
    """CUDA: half of the memory free after the weights loaded. CPU: a quarter of RAM, at most 4 GiB."""
    if device_type == "cuda" and free_device_bytes:
        return free_device_bytes // 2
    return min(total_ram_bytes // 4, 4 * GIB)


def default_host_kv_budget(device_type: str, total_ram_bytes: int) -> int:
    """On CPU the device pool already is host RAM: a host tier would only hold second copies."""
    return min(total_ram_bytes // 4, 16 * GIB) if device_type == "cuda" else 0

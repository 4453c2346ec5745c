"""Plain data passed between the HTTP side and the engine thread (no torch, no pydantic)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + output (HF/vLLM semantics)
    presence_penalty: float = 0.0  # over output only (OpenAI semantics)
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    num_logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token + top-k alternatives
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True, frozen=True)
class SessionKey:
    """Where a request's KV state lives: a tenant's explicit session or a cache bucket."""

    tenant: str
    name: str
    kind: str = "session"  # session | response | bucket (prompt_cache_key: shared, never locks)

    @property
    def is_bucket(self) -> bool:
        return self.kind == "bucket"


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    session: SessionKey | None = None
    timeout_s: float | None = None
    tenant: str = "default"  # salts the shared prefix cache: tenants never share K/V
    use_cache: bool = True  # False: no K/V reuse and nothing published for others (baselines)
    snapshot: Any = None  # a Snapshot (host or disk tier) the engine may restore K/V from
    messages: list[dict] | None = None  # chat: the messages this prompt renders (kept in the session record)
    max_unread_events: int | None = None  # a stream left unread past this many events is ended (slow reader)

    @property
    def is_prefill_only(self) -> bool:
        """max_tokens 0: compute the prompt's K/V, generate nothing (a session's system prompt)."""
        return self.params.max_tokens == 0


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class TextDelta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class Admitted:
    """The engine took the request: how much of its prompt is cached, and from which tier."""

    num_prompt: int
    num_cached: int
    source: str  # device | host | disk | none


@dataclass(slots=True)
class Finished:
    finish_reason: str  # "stop" | "length"
    usage: Usage


@dataclass(slots=True)
class Failed:
    code: str  # request_timeout | internal_error | out_of_memory | cancelled
    message: str


Event = Admitted | TextDelta | Finished | Failed


class EngineError(Exception):
    """Raised synchronously by the engine at admission; `code` follows the design's error table."""

    code = "engine_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SessionBusy(EngineError):
    code = "session_busy"


class SessionModelMismatch(EngineError):
    code = "session_model_mismatch"


class EngineStopped(EngineError):
    code = "shutting_down"


class SessionNotFound(EngineError):
    code = "session_not_found"


class InvalidTurn(EngineError):
    code = "invalid_parameter"

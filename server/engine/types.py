"""Plain data passed between the HTTP side and the engine thread (no torch, no pydantic)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    is_bucket: bool = False  # prompt_cache_key: shared, never locks


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    session: SessionKey | None = None
    timeout_s: float | None = None
    tenant: str = "default"  # salts the shared prefix cache: tenants never share K/V
    use_cache: bool = True  # False: no K/V reuse and nothing published for others (baselines)


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
class Finished:
    finish_reason: str  # "stop" | "length"
    usage: Usage


@dataclass(slots=True)
class Failed:
    code: str  # request_timeout | internal_error | out_of_memory | cancelled
    message: str


Event = TextDelta | Finished | Failed


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

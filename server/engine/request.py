"""What the serving layer hands the engine, and the events it gets back (plain data: no torch, no pydantic)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.engine.grammar import Constraint
from server.errors import Refused
from server.sessions.chat import ChatMessage
from server.sessions.record import SessionKey, Usage


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 16  # 0: compute the prompt's K/V and generate nothing (a session's system prompt)
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


@dataclass(slots=True, frozen=True, kw_only=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str = "default"  # salts the shared prefix cache: tenants never share K/V
    session: SessionKey | None = None  # locked for the request; its turn is recorded when it completes
    kv_source: SessionKey | None = None  # whose host/disk snapshot may hold this prompt's K/V
    use_cache: bool = True  # False: no K/V reuse and nothing published for others (baselines)
    messages: list[ChatMessage] | None = None  # chat: the messages this prompt renders (kept in the record)
    timeout_s: float | None = None
    max_unread_events: int | None = None  # a stream left unread past this many events is ended (slow reader)
    constraint: Constraint | None = None  # structured output: every token must fit this (fresh) grammar
    tools: list[dict[str, Any]] | None = None  # chat: the tool definitions the prompt renders (kept in the record)
    reply: Callable[[str], ChatMessage] | None = None  # chat: the reply's text -> the message the record keeps
    shown_special_ids: frozenset[int] = frozenset()  # special tokens kept in the text: tool-call tags to read
    # Makes the request's own judge of its reply: fed each piece of text as it is released, True ends the reply
    # there ("stop", its text kept), as a stop string would (a forced reply that repeats a call: it is looping).
    reply_watch: Callable[[], Callable[[str], bool]] | None = None
    # Texts no line of the reply may open with (a tool result's tag, which a small model echoes instead of
    # answering): masked where a line starts (engine/openings.py). A grammar, when there is one, decides alone.
    banned_openings: tuple[str, ...] = ()

    @property
    def is_prefill_only(self) -> bool:
        return self.params.max_tokens == 0


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass(slots=True, frozen=True)
class Admitted:
    """The engine took the request: how much of its prompt is cached, and from which tier."""

    num_prompt: int
    num_cached: int
    source: str  # device | host | disk | none


@dataclass(slots=True, frozen=True)
class TextDelta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True, frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length"
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended it (None: end of sequence, or length)


@dataclass(slots=True, frozen=True)
class Failed:
    code: str  # request_timeout | internal_error | out_of_memory | cancelled | slow_reader | shutting_down
    message: str


Event = Admitted | TextDelta | Finished | Failed
SHUTTING_DOWN = Failed("shutting_down", "the server is shutting down")
SLOW_READER = Failed("slow_reader", "the client read the stream too slowly; too many events were left unread")
CANCELLED = Failed("cancelled", "the client went away")


class EngineError(Refused):
    """Raised synchronously by `Engine.submit`; `code` follows the design's error table."""

    code = "engine_error"


class QueueFull(EngineError):
    code = "server_overloaded"


class TooLarge(EngineError):
    code = "context_length_exceeded"


class EngineStopped(EngineError):
    code = "shutting_down"


class EngineBusy(EngineError):
    code = "not_ready"

"""OpenAI wire shapes for requests. Unknown fields and known-but-unimplemented ones are 400s, never ignored.

Every field of the SDKs' chat and completions request types is honoured, accepted as a hint with no effect, or
refused with a 400 naming it; docs/api.md has the table, field by field, with the reasons."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError
from typing_extensions import Self  # typing.Self is Python 3.11's

from server.openai.formats import ResponseFormat, ToolCall, ToolFields
from server.wire import MAX_STOP, SESSION_ID_PATTERN, Stop, Unused, WireModel, only_kinds, reject_unsupported

MAX_LOGIT_BIAS = 1024

SessionId = Annotated[str, Field(pattern=SESSION_ID_PATTERN, description="1-128 characters of [A-Za-z0-9_-]")]

# Fields OpenAI defines that kvserve does not implement, with the values that mean "not used": accepted with those
# (clients send defaults), a 400 naming the field otherwise, and left out of the OpenAPI document.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "modalities": (None, ["text"]),  # text is what these models write
    "service_tier": (None, "auto", "default"),  # one tier here: the default one
    "store": (None, False),  # a chat completion is never stored (Responses are)
    **dict.fromkeys(("suffix", "functions", "function_call", "audio", "prediction"), (None,)),
    **dict.fromkeys(("web_search_options", "reasoning_effort", "metadata"), (None,)),
}
COMPLETION_UNSUPPORTED = UNSUPPORTED | dict.fromkeys(("tools", "tool_choice", "parallel_tool_calls"), (None,))
CHAT_UNSUPPORTED = UNSUPPORTED | {"verbosity": (None, "medium"), "moderation": (None,)}
NULL_IS_DEFAULT = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "logprobs", "stream")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: Unused = None  # no obfuscation field on these events: asking for one is refused

    @model_validator(mode="after")
    def _no_obfuscation(self) -> StreamOptions:
        reject_unsupported(self, {"include_obfuscation": (None, False)})
        return self


class PromptCacheBreakpoint(BaseModel):
    """OpenAI's explicit cache breakpoint: a hint here, where every prompt's K/V is kept by prefix anyway."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class PromptCacheOptions(BaseModel):
    """How OpenAI caches a prompt: hints here, where every prompt's K/V is kept by prefix, as memory allows (a mode,
    a lifetime). Warming without generating and cache diagnostics are refused."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m", "12h"] | None = None
    prewarm: Unused = None
    comparison_response_id: Unused = None

    @model_validator(mode="after")
    def _reject_unsupported(self) -> PromptCacheOptions:
        reject_unsupported(self, {"prewarm": (None, False), "comparison_response_id": (None,)})
        return self


class CacheHints(BaseModel):
    """Chat's and Responses' caching and tracing hints: accepted, with no effect on the answer."""

    prompt_cache_options: PromptCacheOptions | None = Field(None, description="accepted, no effect: a cache hint")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="accepted, no effect: K/V is kept as memory allows"
    )
    safety_identifier: str | None = Field(None, max_length=256, description="accepted, no effect: a tracing id")


class _Unsupported(WireModel):
    """Declares the unimplemented fields so clients get a 400 naming the field they set."""

    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED
    null_is_default: ClassVar[tuple[str, ...]] = NULL_IS_DEFAULT
    n: Unused = None
    best_of: Unused = None
    echo: Unused = None
    suffix: Unused = None
    functions: Unused = None
    function_call: Unused = None
    audio: Unused = None
    modalities: Unused = None
    prediction: Unused = None
    web_search_options: Unused = None
    reasoning_effort: Unused = None
    service_tier: Unused = None
    store: Unused = None
    metadata: Unused = None

    @model_validator(mode="after")
    def _reject_unsupported(self) -> _Unsupported:
        reject_unsupported(self, self.unsupported)
        return self


class SamplingFields(_Unsupported):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1: off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Stop = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    session_id: SessionId | None = Field(None, description="an explicit session (created on first use)")
    cache_prompt: bool = Field(
        True, description="false: reuse no cached K/V and publish none (for no-cache baselines; llama.cpp's name)"
    )
    prompt_cache_key: str | None = Field(
        None, max_length=256, description="a cache bucket shared by many requests; never locks"
    )

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = COMPLETION_UNSUPPORTED
    prompt: str | list[int] | list[str] | list[list[int]] = Field(..., description="text or token ids")
    logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = Field(None, description="structured output, as on chat completions")
    tools: Unused = None
    tool_choice: Unused = None
    parallel_tool_calls: Unused = None

    @model_validator(mode="after")
    def _one_prompt(self) -> Self:
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list):
            raise PydanticCustomError(
                "unsupported_parameter", "batched prompts are not supported yet", {"name": "prompt"}
            )
        return self

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return prompt[0]  # a one-item batch: its only prompt
        return prompt  # type: ignore[return-value]  # a string, or one list of token ids


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = Field(None, description="accepted, no effect")


text_parts_only = only_kinds(("text", None), "content parts", ": this server's models read text only")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[TextPart] | str | None = None  # the list first: its errors are the ones worth reporting
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=128, description="an assistant's calls")
    tool_call_id: str | None = Field(None, max_length=256, description="a tool message: the call it answers")
    refusal: Unused = None  # echoed assistant messages carry "refusal": null; a refusal's text has no place in a prompt
    audio: Unused = None  # null accepted (the SDKs type these optional on an assistant message); audio and the
    function_call: Unused = None  # pre-tools API's call are refused
    parsed: SkipJsonSchema[Any] = None  # the openai SDK's parse() echoes the content it parsed
    annotations: SkipJsonSchema[list[Any] | None] = None

    _text_only = field_validator("content", mode="before")(text_parts_only)

    @model_validator(mode="after")
    def _fits_its_role(self) -> ChatMessage:
        reject_unsupported(self, dict.fromkeys(("refusal", "audio", "function_call"), (None,)))
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("value_error", "a tool message needs 'tool_call_id'")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError(
                "value_error", "'content' may be null only on an assistant message with tool_calls"
            )
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("value_error", "only assistant messages carry 'tool_calls'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields, ToolFields, CacheHints):
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_UNSUPPORTED
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    verbosity: Unused = None  # how terse the answer is: these models have no such control, only the default
    moderation: Unused = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> Self:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("value_error", "top_logprobs requires logprobs=true")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class SessionCreate(WireModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"model": "smollm2-135m-instruct", "system": "You are terse.", "ttl_s": 3600}]},
    )
    model: str | None = Field(None, min_length=1, max_length=256, description="default: the first served model")
    system: str | None = Field(
        None, min_length=1, description="a system prompt, prefilled now so the first turn starts warm"
    )
    ttl_s: float | None = Field(None, gt=0, le=365 * 86400, description="idle lifetime; default: the server's")


class SessionFork(WireModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"turn": 2}]})
    turn: int | None = Field(
        None,
        ge=0,
        description="branch after this turn (counted from 1; 0: the system prompt only); default: the latest",
    )
    ttl_s: float | None = Field(None, gt=0, le=365 * 86400)


class SessionRewind(WireModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"turn": 1}]})
    turn: int = Field(..., ge=0, description="keep turns 1..turn, drop the later ones")

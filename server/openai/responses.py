"""The OpenAI Responses API request, as far as kvserve implements it (the rest is a 400 naming the field).

Every field of the SDKs' request type is honoured, accepted as a hint with no effect, or refused with a 400 naming
it; docs/api.md has the table, field by field, with the reasons."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from server.openai.schemas import CacheHints, PromptCacheBreakpoint
from server.wire import FUNCTION_NAME, MAX_TOOLS, SESSION_ID_PATTERN, Unused, WireModel, only_kinds, reject_unsupported

RESPONSE_ID_PATTERN = r"^resp_[0-9a-f]{32}$"
ITEM_TYPES = ("message", "function_call", "function_call_output", "item_reference")

# Fields of the Responses API kvserve does not implement, with the values that mean "not used".
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "reasoning": (None,),
    "include": (None, []),
    "background": (None, False),
    "truncation": (None, "disabled"),
    "conversation": (None,),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "service_tier": (None, "auto", "default"),
    "stream_options": (None, {}, {"include_obfuscation": False}),  # no obfuscation field on these events
    **dict.fromkeys(("moderation", "context_management", "background_options", "access_programs", "image"), (None,)),
}
# A function tool's fields for OpenAI's server-side tool machinery (tool search, programmatic callers) and for what
# its prompt would show (an output schema): kvserve renders name, description and parameters only.
FUNCTION_TOOL_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "defer_loading": (None, False),
    "allowed_callers": (None, ["direct"]),
    "output_schema": (None,),
}


class InputPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # echoed output items carry these; nothing to do with them
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = Field(None, description="accepted, no effect")


_text_parts = only_kinds(
    ("input_text", "output_text", "text", None), "content parts", ": this server's models read text only"
)


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]
    id: str | None = Field(None, max_length=256)
    status: str | None = Field(None, max_length=32)
    phase: Unused = None  # null accepted (the SDKs type it optional); a commentary channel these prompts lack

    @model_validator(mode="after")
    def _reject_unsupported(self) -> InputMessage:
        reject_unsupported(self, {"phase": (None,)})
        return self


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1, max_length=256)
    name: str = Field(..., max_length=64)
    arguments: str
    id: str | None = Field(None, max_length=256)
    status: str | None = Field(None, max_length=32)
    caller: Unused = None  # null accepted; a program's calls and namespaced tools are OpenAI's machinery
    namespace: Unused = None

    @model_validator(mode="after")
    def _reject_unsupported(self) -> FunctionCallItem:
        reject_unsupported(self, dict.fromkeys(("caller", "namespace"), (None,)))
        return self


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1, max_length=256)
    output: str | list[InputPart]
    id: str | None = Field(None, max_length=256)
    status: str | None = Field(None, max_length=32)
    caller: Unused = None  # null accepted, as on a call
    namespace: Unused = None
    name: Unused = None  # the call it answers (call_id) names its function

    @model_validator(mode="after")
    def _reject_unsupported(self) -> FunctionCallOutputItem:
        reject_unsupported(self, dict.fromkeys(("caller", "namespace", "name"), (None,)))
        return self


class ItemReference(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["item_reference"] = "item_reference"  # optional in the SDKs: {"id": ...} alone is a reference
    id: str = Field(..., min_length=1, max_length=256, description="an item of a response kvserve stored")


ITEM_TAGS = {
    "message": "InputMessage",
    "function_call": "FunctionCallItem",
    "function_call_output": "FunctionCallOutputItem",
    "item_reference": "ItemReference",
}


def _item_type(item: Any) -> str | None:
    """An item's tag (its class's name, which an error's location leaves out); None (an unknown type) fails
    validation, and `_known_items` names it first. Without a type, an item of an id alone is a reference."""
    if isinstance(item, dict):
        kind = item.get("type") or ("item_reference" if set(item) <= {"id", "type"} and "id" in item else "message")
    else:
        kind = getattr(item, "type", None) or ("item_reference" if isinstance(item, ItemReference) else "message")
    return ITEM_TAGS.get(kind) if isinstance(kind, str) else None


def _known_items(items: Any) -> Any:
    """Unsupported item types and content parts are named before the union's own errors (which would say
    "Input should be a valid string", the first member's)."""
    for item in items if isinstance(items, list) else []:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind is not None and kind not in ITEM_TYPES:
            raise PydanticCustomError(
                "unsupported_parameter", "input items of type '{kind}' are not supported", {"kind": str(kind)[:40]}
            )
        if isinstance(item, dict):
            _text_parts(item.get("content", item.get("output")))
    return items


InputItem = Annotated[
    Annotated[InputMessage, Tag("InputMessage")]
    | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
    | Annotated[ItemReference, Tag("ItemReference")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    """A Responses API function tool (the flat shape: name and parameters beside the type)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: Unused = None
    allowed_callers: Unused = None
    output_schema: Unused = None

    @model_validator(mode="after")
    def _reject_unsupported(self) -> FunctionTool:
        reject_unsupported(self, FUNCTION_TOOL_UNSUPPORTED)
        return self


_function_tools_only = only_kinds(("function",), "tools", " (function tools are)")


class ChosenTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(..., pattern=FUNCTION_NAME)


class TextFormat(BaseModel):
    """text.format: text, json_object, or json_schema (name, schema, strict beside the type)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=4096)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponseRequest(WireModel, CacheHints):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"model": "smollm2-135m-instruct", "input": "Name three rivers.", "max_output_tokens": 64},
                {"model": "smollm2-135m-instruct", "input": "And three lakes?", "previous_response_id": "resp_..."},
            ]
        },
    )
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED
    null_is_default: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "store", "stream", "parallel_tool_calls")
    model: str = Field(..., min_length=1, max_length=256)
    input: list[InputItem] | str = Field(  # the list first: its errors are the ones worth reporting
        ..., description="text (one user message) or a list of input items"
    )
    instructions: str | None = Field(None, description="a system message for this response only (not inherited)")
    previous_response_id: str | None = Field(
        None,
        max_length=256,  # bounded; any id not stored here, malformed ones included, is 404 (OpenAI's answer)
        description="a stored response to continue from (resp_...); an unknown id is 404 response_not_found",
    )
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1, description="kvserve extension: reproducible sampling")
    store: bool = Field(True, description="keep the response (and its K/V) so later ones can continue from it")
    stream: bool = False
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | ChosenTool | None = None
    parallel_tool_calls: bool = True
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN, description="an explicit session, as on chat")
    prompt_cache_key: str | None = Field(None, max_length=256, description="a cache bucket shared by many requests")
    cache_prompt: bool = Field(True, description="false: reuse no cached K/V (for no-cache baselines)")
    reasoning: Unused = None
    include: Unused = None
    background: Unused = None
    truncation: Unused = None
    conversation: Unused = None
    prompt: Unused = None
    max_tool_calls: Unused = None
    top_logprobs: Unused = None
    service_tier: Unused = None
    stream_options: Unused = None
    moderation: Unused = None
    context_management: Unused = None
    background_options: Unused = None
    access_programs: Unused = None
    image: Unused = None

    _function_tools = field_validator("tools", mode="before")(_function_tools_only)
    _known_input = field_validator("input", mode="before")(_known_items)

    @model_validator(mode="after")
    def _reject_unsupported(self) -> ResponseRequest:
        reject_unsupported(self, self.unsupported)
        if isinstance(self.input, list) and not self.input:
            raise PydanticCustomError("value_error", "input must hold at least one item")
        names = [t.name for t in self.tools or []]
        if isinstance(self.tool_choice, ChosenTool) and self.tool_choice.name not in names:
            raise PydanticCustomError("value_error", "tool_choice names a function that is not in 'tools'")
        if self.tool_choice == "required" and not names:
            raise PydanticCustomError("value_error", "tool_choice 'required' needs at least one tool")
        return self

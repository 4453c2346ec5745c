"""Anthropic Messages API request shapes, as far as kvserve implements them (the rest is a 400 naming it).

Every field of the SDKs' request types (stable and beta) is honoured, accepted as a hint with no effect, or refused
with a 400 naming it; docs/api.md has the table, field by field, with the reasons."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from server.wire import (
    FUNCTION_NAME,
    MAX_TOOLS,
    SESSION_ID_PATTERN,
    StopSequences,
    Unused,
    WireModel,
    only_kinds,
    reject_unsupported,
)

BLOCK_TYPES = ("text", "tool_use", "tool_result")
# Fields kvserve does not implement, with the values that mean "not used" (beta fields among them).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    **dict.fromkeys(("container", "diagnostics", "inference_geo", "compaction", "fallback_credit_token"), (None,)),
    "prompt_cache_key": (None,),  # a session or nothing here: cache_control marks the prefix
    "fallbacks": (None, "default"),  # the model's own fallbacks: kvserve's models never decline, there are none
}
# On count_tokens too: what the conversation holds.
CONVERSATION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    **dict.fromkeys(("mcp_servers", "context_management"), (None,)),
    # Nobody is billed here; billing the caller's own organization is what happens without the field.
    "billing_policy": (None, {"type": "billing_policy"}, {"type": "billing_policy", "bill_to": "self"}),
}
# A tool definition's fields for Anthropic's server-side tool machinery (tool search, programmatic callers) and
# for what its prompt shows the model (input examples): kvserve renders name, description and schema only.
TOOL_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "defer_loading": (None, False),
    "allowed_callers": (None, ["direct"]),
    "input_examples": (None, []),
}
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Unused = None  # echoed blocks carry null; citations cite documents, which are refused

    @model_validator(mode="after")
    def _no_citations(self) -> TextBlock:
        reject_unsupported(self, {"citations": (None, [])})
        return self


def direct_caller(value: Any) -> Any:
    """A call the model made itself ({"type": "direct"}, as Anthropic's answers say) is what every call here is;
    one a server tool made (code execution's) is a 400 naming its type."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is not None and kind != "direct":
        message = "tool_use blocks of a caller of type '{kind}' are not supported: only the model's own calls"
        raise PydanticCustomError("unsupported_parameter", message, {"kind": str(kind)[:40]})
    return value


class DirectCaller(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["direct"]


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1, max_length=256)
    name: str = Field(..., max_length=64)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: DirectCaller | None = Field(None, description="only the model's own: {'type': 'direct'}")
    toolset_name: Unused = None  # echoed blocks carry null; a toolset is a family of Anthropic's server tools

    _direct = field_validator("caller", mode="before")(direct_caller)

    @model_validator(mode="after")
    def _no_toolset(self) -> ToolUseBlock:
        reject_unsupported(self, {"toolset_name": (None,)})
        return self


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = Field(None, description="accepted; not rendered: the model reads the result's text")
    cache_control: CacheControl | None = None
    toolset_name: Unused = None

    _text_only = field_validator("content", mode="before")(
        only_kinds(("text",), "tool_result content blocks", ": this server's models read text")
    )

    @model_validator(mode="after")
    def _no_toolset(self) -> ToolResultBlock:
        reject_unsupported(self, {"toolset_name": (None,)})
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


BLOCK_TAGS = {"text": "TextBlock", "tool_use": "ToolUseBlock", "tool_result": "ToolResultBlock"}


def _block_type(block: Any) -> str | None:
    """A block's tag: its class's name, which an error's location leaves out (`messages.0.content.1.citations`)."""
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return BLOCK_TAGS.get(kind) if isinstance(kind, str) else None


Block = Annotated[
    Annotated[TextBlock, Tag("TextBlock")]
    | Annotated[ToolUseBlock, Tag("ToolUseBlock")]
    | Annotated[ToolResultBlock, Tag("ToolResultBlock")],
    Discriminator(_block_type),
]


known_blocks = only_kinds(BLOCK_TYPES, "content blocks", ": this server's models read text and tools")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: list[Block] | str  # the list first: its errors are the ones worth reporting

    _known = field_validator("content", mode="before")(known_blocks)


ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}
WHERE_BLOCKS_GO = {
    "tool_use": "tool_use blocks belong in assistant messages (they are the calls the assistant made)",
    "tool_result": "tool_result blocks belong in user messages",
}


def standard_speed(value: Any) -> Any:
    """`speed: "fast"` asks for a faster mode: there is one speed here."""
    if value not in (None, "standard"):
        message = "speed '{speed}' is not supported: one speed here ('standard')"
        raise PydanticCustomError("unsupported_parameter", message, {"speed": str(value)[:40]})
    return value


def no_system_messages(value: Any) -> Any:
    """A `role: "system"` message inside `messages` (the SDKs type it): not read yet, so a 400 naming it, before the
    role's own error ("Input should be 'user' or 'assistant'") would say less."""
    for i, message in enumerate(value if isinstance(value, list) else []):
        if isinstance(message, dict) and message.get("role") == "system":
            text = "system messages inside 'messages' are not supported yet: give the system prompt in 'system'"
            raise PydanticCustomError("unsupported_parameter", text, {"name": f"messages.{i}.role"})
    return value


def blocks_in_their_roles(messages: list[Message]) -> None:
    """A tool_use block is an assistant's, a tool_result block a user's: one elsewhere is a 400 naming it (the
    conversation could only be rendered by dropping it)."""
    for i, message in enumerate(messages):
        for j, block in enumerate(message.content if isinstance(message.content, list) else []):
            if block.type not in ROLE_BLOCKS[message.role]:
                context = {"where": f"messages.{i}.content.{j}", "why": WHERE_BLOCKS_GO[block.type]}
                raise PydanticCustomError("invalid_block", "{where}: {why}", context)


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"] | None = None
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=8192)
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    strict: bool | None = Field(
        None, description="a forced call (tool_choice any or tool) is held to input_schema by a grammar either way"
    )
    eager_input_streaming: bool | None = Field(
        None, description="accepted, no effect: a call's input is streamed as one input_json_delta once whole"
    )
    defer_loading: Unused = None
    allowed_callers: Unused = None
    input_examples: Unused = None

    @model_validator(mode="after")
    def _reject_unsupported(self) -> Tool:
        reject_unsupported(self, TOOL_UNSUPPORTED)
        return self


custom_tools_only = only_kinds((None, "custom"), "tools", " (client tools with an input_schema are)")


def unique_names(tools: list[Tool] | None) -> list[Tool] | None:
    """Calls name their tool: two tools of one name could not be told apart (chat refuses them too)."""
    seen: set[str] = set()
    for tool in tools or []:
        if tool.name in seen:
            raise PydanticCustomError(
                "value_error", "tool names must be unique: '{name}' is declared twice", {"name": tool.name}
            )
        seen.add(tool.name)
    return tools


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["disabled"]


def thinking_disabled(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in (None, "disabled"):
        message = "thinking of type '{kind}' is not supported: these models do not reason apart from their answer"
        raise PydanticCustomError("unsupported_parameter", message, {"kind": str(kind)[:40]})
    return value


class JsonOutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(BaseModel):
    """Structured output: the reply's text is a JSON document of this schema (held to it by a grammar)."""

    model_config = ConfigDict(extra="forbid")
    format: JsonOutputFormat | None = None
    effort: Unused = None  # no reasoning to spend effort on: refused when set
    task_budget: Unused = None  # beta: a budget told to the model, which these models' prompts have no place for

    @model_validator(mode="after")
    def _no_effort(self) -> OutputConfig:
        reject_unsupported(self, {"effort": (None,), "task_budget": (None,)})
        return self


class Conversation(WireModel):
    """What /v1/messages and /v1/messages/count_tokens share: the conversation and what shapes its prompt."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(..., min_length=1, max_length=256)
    messages: list[Message] = Field(..., min_length=1, max_length=4096)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = Field(None, description="only {'type': 'disabled'}: these models do not reason apart")
    cache_control: CacheControl | None = Field(None, description="a breakpoint on the request's last block")
    output_config: OutputConfig | None = None
    speed: Literal["standard"] | None = None
    mcp_servers: Unused = None
    context_management: Unused = None
    billing_policy: Unused = None

    _no_system_messages = field_validator("messages", mode="before")(no_system_messages)
    _one_speed = field_validator("speed", mode="before")(standard_speed)
    _custom_tools = field_validator("tools", mode="before")(custom_tools_only)
    _unique_tools = field_validator("tools")(unique_names)
    _no_thinking = field_validator("thinking", mode="before")(thinking_disabled)

    @model_validator(mode="after")
    def _reject_unsupported_conversation(self) -> Conversation:
        reject_unsupported(self, CONVERSATION_UNSUPPORTED)
        return self

    @model_validator(mode="after")
    def _blocks_in_their_roles(self) -> Conversation:
        blocks_in_their_roles(self.messages)
        return self

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> Conversation:
        if isinstance(getattr(self, "thread", None), ThreadContinue):
            return self  # the thread's tools: checked against them when it is read
        choice, names = self.tool_choice, [t.name for t in self.tools or []]
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise PydanticCustomError("value_error", "tool_choice names a tool that is not in 'tools'")
        if choice is not None and choice.type == "any" and not names:
            raise PydanticCustomError("value_error", "tool_choice 'any' needs at least one tool")
        return self


class ThreadCreate(BaseModel):
    """Hold this conversation under the answer's id, for a later `continue` to send only its new messages."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["create"]


class ThreadContinue(BaseModel):
    """Continue from a held answer: the thread keeps its messages, `system` and `tools`; only the new ones come."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["continue"]
    previous_message_id: str = Field(..., min_length=1, max_length=256)


Thread = Annotated[ThreadCreate | ThreadContinue, Field(discriminator="type")]
CONTINUE_KEEPS = ("system", "tools")  # a continue takes them from its thread: a request repeating one is refused


class CountTokensRequest(Conversation):
    # beta: Anthropic's count_tokens "accepts this parameter and ignores it"; so does this one
    compaction: SkipJsonSchema[Any] = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = Field(None, max_length=256)


class MessagesRequest(Conversation):
    max_tokens: int = Field(..., ge=0, description="0: compute and cache the prompt, generate nothing")
    stop_sequences: StopSequences = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="accepted: one tier here")
    thread: Thread | None = Field(
        None,
        description="message threads: the server holds the conversation (create), a turn sends only its new "
        "messages (continue from a previous message id)",
    )
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN, description="kvserve: an explicit session")
    prompt_cache_key: Unused = None
    container: Unused = None
    diagnostics: Unused = None
    inference_geo: Unused = None
    compaction: Unused = None
    fallback_credit_token: Unused = None
    fallbacks: Unused = None

    @model_validator(mode="after")
    def _reject_unsupported(self) -> MessagesRequest:
        reject_unsupported(self, UNSUPPORTED)
        return self

    @model_validator(mode="after")
    def _continue_keeps_system_and_tools(self) -> MessagesRequest:
        if isinstance(self.thread, ThreadContinue):
            for name in CONTINUE_KEEPS:
                if getattr(self, name) is not None:
                    message = "'{name}' is the thread's on a continue: send it with thread.type 'create' only"
                    raise PydanticCustomError("invalid_parameter", message, {"name": name})
        return self

    @property
    def continues(self) -> str | None:
        """The message id a thread continue resumes from (None: not a continue)."""
        return self.thread.previous_message_id if isinstance(self.thread, ThreadContinue) else None

    def cache_ttl(self) -> float | None:
        """The longest cache_control ttl anywhere in the request (None: no breakpoint)."""
        marks = [c for c in [self.cache_control, *_cache_controls(self)] if c is not None]
        return max((TTL_SECONDS[c.ttl or "5m"] for c in marks), default=None)


def _cache_controls(req: Conversation) -> list[CacheControl | None]:
    found = [t.cache_control for t in req.tools or []]
    found += [b.cache_control for b in req.system] if isinstance(req.system, list) else []
    for message in req.messages:
        found += [b.cache_control for b in message.content] if isinstance(message.content, list) else []
    return found

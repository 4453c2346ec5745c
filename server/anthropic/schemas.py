"""Anthropic Messages API request shapes, as far as kvserve implements them (the rest is a 400 naming it)."""

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
UNSUPPORTED: dict[str, tuple[Any, ...]] = dict.fromkeys(
    ("container", "diagnostics", "inference_geo", "mcp_servers", "context_management"), (None,)
)
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
    citations: SkipJsonSchema[None] = None


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1, max_length=256)
    name: str = Field(..., max_length=64)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: SkipJsonSchema[None] = None  # echoed blocks carry these as null
    toolset_name: SkipJsonSchema[None] = None


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


def _block_type(block: Any) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return kind if kind in BLOCK_TYPES else None


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")],
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
    effort: SkipJsonSchema[Any] = None  # no reasoning to spend effort on: refused when set

    @model_validator(mode="after")
    def _no_effort(self) -> OutputConfig:
        reject_unsupported(self, {"effort": (None,)})
        return self


class Conversation(WireModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(..., min_length=1, max_length=256)
    messages: list[Message] = Field(..., min_length=1, max_length=4096)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = Field(None, description="only {'type': 'disabled'}: these models do not reason apart")

    _custom_tools = field_validator("tools", mode="before")(custom_tools_only)
    _unique_tools = field_validator("tools")(unique_names)
    _no_thinking = field_validator("thinking", mode="before")(thinking_disabled)

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
    pass


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
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard"] | None = None
    cache_control: CacheControl | None = Field(None, description="a breakpoint on the request's last block")
    output_config: OutputConfig | None = None
    thread: Thread | None = Field(
        None,
        description="message threads: the server holds the conversation (create), a turn sends only its new "
        "messages (continue from a previous message id)",
    )
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN, description="kvserve: an explicit session")
    prompt_cache_key: SkipJsonSchema[None] = None  # a session or nothing here: cache_control marks the prefix
    container: Unused = None
    diagnostics: Unused = None
    inference_geo: Unused = None
    mcp_servers: Unused = None
    context_management: Unused = None

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

"""Wire shapes for structured output and tools: response_format, tools, tool_choice, tool calls."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from server.wire import FUNCTION_NAME, MAX_TOOLS, only_kinds

MAX_NUMBER_DIGITS = 4000  # below Python's int <-> str limit (4300): what `json.dumps` can write back


def exact_float(text: str) -> float | int:
    """A JSON number past a float's range stays exact as an int (10**400, not inf: JSON has no infinity, and an
    answer holding one could not be written); one of more than MAX_NUMBER_DIGITS digits is no number kvserve
    holds (1e999999999 would take the process's memory and time): a ValueError, as for text that is no JSON."""
    value = float(text)
    if math.isfinite(value):
        return value
    exact = Decimal(text)
    if exact.adjusted() >= MAX_NUMBER_DIGITS:
        raise ValueError("a number too large to hold")
    return int(exact)


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


JSON = json.JSONDecoder(parse_float=exact_float, parse_constant=_not_json)  # what a call's arguments are read with


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field("response", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=4096)
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema; absent: any JSON")
    strict: bool | None = Field(None, description="the grammar enforces the schema either way")


class ResponseFormat(BaseModel):
    """text, json_object (any JSON object) or json_schema: enforced token by token by a grammar."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("value_error", "response_format of type json_schema needs 'json_schema'")
        return self


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments object")
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=FUNCTION_NAME)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., max_length=64)
    arguments: str = Field(..., description="the arguments, as a JSON text")
    parsed_arguments: SkipJsonSchema[Any] = None  # the openai SDK's parse() echoes the arguments it parsed


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(..., min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolFields(BaseModel):
    """What chat completions add for tools and structured output."""

    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = Field(None, description="default: auto with tools, none without")
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    _function_tools = field_validator("tools", mode="before")(
        only_kinds(("function",), "tools", " (function tools are)")
    )

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ToolFields:
        choice, names = self.tool_choice, [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise PydanticCustomError("value_error", "tool names must be unique")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise PydanticCustomError("value_error", "tool_choice names a function that is not in 'tools'")
        if choice == "required" and not names:
            raise PydanticCustomError("value_error", "tool_choice 'required' needs at least one tool")
        return self


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt as it is (`prompt`), or messages through the model's chat template (`messages`)."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(..., min_length=1, max_length=256)
    prompt: str | None = Field(None, description="text, tokenized as /v1/completions does")
    messages: list[dict[str, Any]] | None = Field(None, max_length=4096, description="chat messages, as on chat")
    add_generation_prompt: bool = Field(True, description="with messages: end with the assistant's header")
    add_special_tokens: bool = Field(True, description="with prompt: the tokenizer's own (BOS...)")
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS, description="with messages: tools to render")
    return_token_strs: bool = Field(False, description="also each token's text")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("value_error", "give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(..., min_length=1, max_length=256)
    tokens: list[int] = Field(..., max_length=1 << 20)

"""The OpenAI Responses API request, as far as kvserve implements it (the rest is a 400 naming the field)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from server.openai.schemas import WireModel, reject_unsupported

RESPONSE_ID_PATTERN = r"^resp_[0-9a-f]{32}$"

# Fields of the Responses API kvserve does not implement, with the values that mean "not used".
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "auto", "none"),
    "parallel_tool_calls": (None, False, True),
    "reasoning": (None,),
    "include": (None, []),
    "background": (None, False),
    "truncation": (None, "disabled"),
    "conversation": (None,),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "service_tier": (None, "auto", "default"),
    "stream_options": (None,),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
}


class InputPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # echoed output items carry these; nothing to do with them
    logprobs: list[Any] | None = None


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]
    id: str | None = Field(None, max_length=256)
    status: str | None = Field(None, max_length=32)

    def as_chat(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponseRequest(WireModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"model": "smollm2-135m-instruct", "input": "Name three rivers.", "max_output_tokens": 64},
                {"model": "smollm2-135m-instruct", "input": "And three lakes?", "previous_response_id": "resp_..."},
            ]
        },
    )
    model: str = Field(..., min_length=1, max_length=256)
    input: str | list[InputMessage] = Field(..., description="text (one user message) or a list of messages")
    instructions: str | None = Field(None, description="a system message for this response only (not inherited)")
    previous_response_id: str | None = Field(None, pattern=RESPONSE_ID_PATTERN)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1, description="kvserve extension: reproducible sampling")
    store: bool = Field(True, description="keep the response (and its K/V) so later ones can continue from it")
    stream: bool = False
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    text: TextConfig | None = None
    cache_prompt: bool = Field(True, description="false: reuse no cached K/V (for no-cache baselines)")
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    reasoning: Any = None
    include: Any = None
    background: Any = None
    truncation: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    service_tier: Any = None
    stream_options: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None

    @model_validator(mode="after")
    def _reject_unsupported(self) -> ResponseRequest:
        reject_unsupported(self, UNSUPPORTED)
        if isinstance(self.input, list) and not self.input:
            raise PydanticCustomError("value_error", "input must hold at least one message")
        return self

    def input_messages(self) -> list[dict]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [m.as_chat() for m in self.input]


def usage_object(usage: list[int] | None) -> dict[str, Any] | None:
    """[prompt, completion, cached] tokens as the Responses API's usage."""
    if usage is None:
        return None
    prompt, completion, cached = usage
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def message_item(response_id: str, status: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    item_id = "msg_" + response_id.removeprefix("resp_")
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def response_object(response_id: str, model: str, record: dict[str, Any], parent: str | None) -> dict[str, Any]:
    """The Response resource, from a stored response's record (request fields, status, output, usage)."""
    status, text = record.get("status", "in_progress"), record.get("output_text")
    output = []
    if text is not None:
        item_status = status if status in ("completed", "incomplete") else "in_progress"
        output.append(message_item(response_id, item_status, text))
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": record.get("created_at", int(time.time())),
        "status": status,
        "model": model,
        "output": output,
        "usage": usage_object(record.get("usage")),
        "previous_response_id": parent,
        "instructions": record.get("instructions"),
        "max_output_tokens": record.get("max_output_tokens"),
        "temperature": record.get("temperature", 1.0),
        "top_p": record.get("top_p", 1.0),
        "store": record.get("store", True),
        "metadata": record.get("metadata") or {},
        "user": record.get("user"),
        "incomplete_details": incomplete,
        "error": record.get("error"),
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
    }

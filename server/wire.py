"""What the wire folders (openai/, anthropic/) share: the request body's base model and the validators and limits both
APIs apply the same way. Unknown fields and known-but-unimplemented ones are 400s, never ignored."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, model_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_TOOLS = 128
Unused = SkipJsonSchema[Any]  # accepted with its "not used" value, never documented as a feature


SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """Where the first string holding a lone surrogate (JSON's "\\ud800") sits in a request body, if anywhere.

    Such text cannot be encoded as UTF-8: tokenizers, templates and the journal would all fail on it.
    """
    if isinstance(value, str):
        return path or "body" if SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for name, item in items:
        found = lone_surrogate_at(item, f"{path}.{name}" if path else str(name))
        if found is not None:
            return found
    return None


class WireModel(BaseModel):
    """A request body: strings must be encodable text (a lone surrogate is a 400 naming where it is)."""

    @model_validator(mode="before")
    @classmethod
    def _reject_lone_surrogates(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where is not None:
            raise PydanticCustomError("lone_surrogate", "text with a lone surrogate (not valid UTF-8)", {"name": where})
        return data


def reject_unsupported(model: BaseModel, unsupported: dict[str, tuple[Any, ...]]) -> None:
    """A 400 naming the first unimplemented field the client set to something that means "use it"."""
    for name, unused in unsupported.items():
        if name in model.model_fields_set and getattr(model, name) not in unused:
            raise PydanticCustomError(
                "unsupported_parameter", "'{name}' is not supported by this server yet", {"name": name}
            )


def only_kinds(allowed: tuple[str | None, ...], what: str, why: str) -> Callable[[Any], Any]:
    """A before-validator: an item of a list (a content part, a block, a tool) whose `type` is not `allowed` is a
    400 naming the type, before the union's own errors (which would name none)."""

    def check(value: Any) -> Any:
        for item in value if isinstance(value, list) else []:
            kind = item.get("type") if isinstance(item, dict) else None
            if kind not in allowed:
                message = f"{what} of type '{{kind}}' are not supported{why}"
                raise PydanticCustomError("unsupported_parameter", message, {"kind": str(kind)[:40]})
        return value

    return check

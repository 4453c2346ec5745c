"""What the wire folders (openai/, anthropic/) share: the request body's base model and the validators and limits both
APIs apply the same way. Unknown fields and known-but-unimplemented ones are 400s, never ignored."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, Field, model_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_TOOLS = 128
Unused = SkipJsonSchema[Any]  # accepted with its "not used" value, never documented as a feature
MAX_STOP = 16  # stop sequences a request may give (OpenAI's 4 is too few for some clients' chat formats)
MAX_STOP_CHARS = 256


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
    """A request body: strings must be encodable text (a lone surrogate is a 400 naming where it is).

    `null_is_default` names the fields an SDK types as nullable (`Optional[float]`, `temperature=None`) that this
    server keeps non-null with a default: a null there means "not set", as it does to the API the SDK speaks."""

    null_is_default: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _reject_lone_surrogates(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where is not None:
            raise PydanticCustomError("lone_surrogate", "text with a lone surrogate (not valid UTF-8)", {"name": where})
        return data

    @model_validator(mode="before")
    @classmethod
    def _nulls_as_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in cls.null_is_default):
            return {k: v for k, v in data.items() if not (v is None and k in cls.null_is_default)}
        return data


def reject_unsupported(model: BaseModel, unsupported: dict[str, tuple[Any, ...]]) -> None:
    """A 400 naming the first unimplemented field the client set to something that means "use it". Raised by a
    nested model, the error's location completes the name (`tools.0.defer_loading`)."""
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
            kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)  # a model, validated
            if kind not in allowed:
                message = f"{what} of type '{{kind}}' are not supported{why}"
                raise PydanticCustomError("unsupported_parameter", message, {"kind": str(kind)[:40]})
        return value

    return check


def check_stop(value: Any, is_list_only: bool = False) -> Any:
    """A before-validator of stop sequences (chat and completions' `stop`, Messages' `stop_sequences`): the rule a
    value breaks, by name. Left to pydantic, a union of a string and a list answers every bad value with its first
    member's complaint ("Input should be a valid string"), whatever was wrong."""
    if value is None:
        return value
    if isinstance(value, str) and not is_list_only:
        items, what = [value], "the stop sequence"
    elif isinstance(value, list):
        items, what = value, "stop sequence {index}"
        if len(items) > MAX_STOP:
            raise PydanticCustomError(
                "stop_sequences",
                "at most {limit} stop sequences are allowed, not {count}",
                {"limit": MAX_STOP, "count": len(items)},
            )
    else:
        shape = "a list of strings" if is_list_only else "a string or a list of strings"
        raise PydanticCustomError("stop_sequences", f"stop sequences must be {shape}")
    for index, item in enumerate(items):
        name = what.format(index=index)
        if not isinstance(item, str):
            raise PydanticCustomError(
                "stop_sequences", f"{name} is not a string (each is a string of 1-{MAX_STOP_CHARS} characters)"
            )
        if not item:
            raise PydanticCustomError("stop_sequences", f"{name} is empty (each is 1-{MAX_STOP_CHARS} characters)")
        if len(item) > MAX_STOP_CHARS:
            raise PydanticCustomError(
                "stop_sequences",
                f"{name} is {{length}} characters long; at most {MAX_STOP_CHARS} are allowed",
                {"length": len(item)},
            )
    return value


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP)]
# The types say the rule in the OpenAPI document; `check_stop` enforces it first, and names what broke it.
Stop = Annotated[StopString | StopList | None, BeforeValidator(check_stop)]
StopSequences = Annotated[StopList | None, BeforeValidator(lambda value: check_stop(value, is_list_only=True))]

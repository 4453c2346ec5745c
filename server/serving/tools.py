"""Tools: how a request's functions reach the prompt, how calls are read back out of the reply.

Two ways into the prompt. A chat template that renders tools itself (Qwen, Hermes, Llama 3.1...)
gets them as `tools=` and the messages as OpenAI shapes them. Any other template gets the generic
prompt (docs/api.md): the functions listed in the system message, calls written as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes convention), an assistant's
earlier calls written back the same way and tool results sent as user messages inside
`<tool_response>` tags. Either way the messages keep one entry per request message, so token-exact
continuation (`continuation.py`) lines them up.

Out of the reply (`tool_reader.py`): `ToolReader` takes the text as it streams, passes on the content before the first
call, and yields each call once its block closes (Hermes `<tool_call>` blocks; for Llama-3-style
templates also a reply that is one JSON object `{"name", "parameters"}`); a block the reply ends
inside is a call cut short once its name is whole, never content. The whole reply read in
one go gives the same calls, with the same ids (derived from the request id), so a stream, a JSON
answer and the session's record of the reply always agree. `required` and a named choice are
enforced by a grammar (`grammar`, over `forced_arguments`: open object schemas closed, unbounded
strings bounded); `auto` is read, not forced.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from server.openai.formats import JSON, NamedToolChoice, ToolFields
from server.openai.responses import ResponseRequest
from server.serving.call_syntax import CALL_CLOSE, CALL_OPEN, PYTHON_TAG, CallSyntax, taught_by
from server.sessions.chat import ChatMessage, ToolCall

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"  # how the generic prompt wraps a tool result
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
GENERIC_PROMPT = (
    "# Tools\n\nYou can call functions to help with the request. Each one is described by a JSON schema:\n"
    "<tools>\n{tools}\n</tools>\n\nTo call a function, answer with its name and arguments as one JSON object "
    "inside <tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n</tool_call>'
)


@dataclass(slots=True, frozen=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(slots=True, frozen=True)
class ToolUse:
    """What a request asks about tools: the functions, whether and how it must call them."""

    specs: tuple[ToolSpec, ...]
    choice: str = "auto"  # none | auto | required | function (then `function` names it)
    function: str | None = None
    parallel: bool = True

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def reads_calls(self) -> bool:
        return bool(self.specs) and self.choice != "none"

    def definitions(self) -> list[dict[str, Any]]:
        return [spec.as_openai() for spec in self.specs]


def tool_use(req: ToolFields) -> ToolUse | None:
    """A chat request's tools (None: it has none)."""
    if not req.tools:
        return None
    specs = tuple(
        ToolSpec(t.function.name, t.function.description, t.function.parameters or NO_PARAMETERS) for t in req.tools
    )
    choice = req.tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        return ToolUse(specs, "function", choice.function.name, req.parallel_tool_calls)
    return ToolUse(specs, choice, None, req.parallel_tool_calls)


def responses_tool_use(req: ResponseRequest) -> ToolUse | None:
    """A Responses API request's function tools (the flat shape)."""
    if not req.tools:
        return None
    specs = tuple(ToolSpec(t.name, t.description, t.parameters or NO_PARAMETERS) for t in req.tools)
    choice = req.tool_choice or "auto"
    if isinstance(choice, str):
        return ToolUse(specs, choice, None, req.parallel_tool_calls)
    return ToolUse(specs, "function", choice.name, req.parallel_tool_calls)


@dataclass(slots=True, frozen=True)
class ToolFormat:
    native: bool  # the chat template renders tools and tool messages itself
    syntax: CallSyntax  # how the model writes a call
    wraps_results: bool = True  # tool results reach the prompt inside <tool_response> tags (generic prompt, Qwen...)


def chat_template(tokenizer: Any, tools: ToolUse | None) -> str | None:
    """The template `apply_chat_template` will use: a tokenizer may hold several by name (transformers picks
    `tool_use` for a request with tools, when there is one, else `default`)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, dict):
        return template
    if tools is not None and tools.specs and "tool_use" in template:
        return str(template["tool_use"])
    return str(template.get("default", next(iter(template.values()), "")))


def model_tool_format(tokenizer: Any, tools: ToolUse | None) -> ToolFormat:
    return tool_format(chat_template(tokenizer, tools))


def call_markers(tokenizer: Any, tools: ToolUse | None) -> frozenset[int]:
    """The tool-call tags a tokenizer has as special tokens (Hermes-2-Pro's, say): decoding would drop them, so a
    request that reads calls keeps them in its text."""
    if tools is None or not tools.reads_calls:
        return frozenset()
    special = set(getattr(tokenizer, "all_special_ids", []))
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    found = {tokenizer.convert_tokens_to_ids(marker) for marker in (CALL_OPEN, CALL_CLOSE, PYTHON_TAG)}
    return frozenset(i for i in found if isinstance(i, int) and i in special)


@lru_cache(maxsize=64)
def tool_format(template: str | None) -> ToolFormat:
    """What a chat template expects: its own tool rendering (it uses `tools`), and the call syntax it teaches."""
    text = template or ""
    native = bool(re.search(r"\btools\b", text))
    return ToolFormat(native, taught_by(template), not native or RESPONSE_OPEN in text)


def canonical_arguments(arguments: str | dict[str, Any]) -> str:
    """Arguments as compact JSON, so a client that re-serialises them still matches the session's record."""
    try:
        value = JSON.decode(arguments) if isinstance(arguments, str) else arguments
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return arguments if isinstance(arguments, str) else json.dumps(arguments)


def tool_call(ident: str, name: str, arguments: str | dict[str, Any]) -> ToolCall:
    """A call in chat's normal form (its arguments canonical), whoever wrote it."""
    return {"id": ident, "type": "function", "function": {"name": name, "arguments": canonical_arguments(arguments)}}


def call_id(request_id: str, index: int) -> str:
    """Derived, not random: the stream, the JSON answer and the session's record name a call alike."""
    return "call_" + hashlib.blake2b(f"{request_id}:{index}".encode(), digest_size=12).hexdigest()


def content_beside_calls(content: str) -> str:
    """Beside calls, content that is only whitespace (what streamed before a call, or null) is none."""
    return content if content.strip() else ""


def assistant_message(content: str, calls: list[ToolCall]) -> ChatMessage:
    """The normalized assistant message (what the session records and a client's echo is compared with)."""
    message: ChatMessage = {"role": "assistant", "content": content_beside_calls(content) if calls else content}
    if calls:
        message["tool_calls"] = calls
    return message


# -- into the prompt -------------------------------------------------------------------------
def for_template(
    messages: list[ChatMessage], tools: ToolUse | None, fmt: ToolFormat
) -> tuple[Sequence[Mapping[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to hand the chat template: as they are for a template that renders tools, the
    generic prompt's rewriting otherwise. No message is added or dropped, but a system message that carries
    the generic tool list when the conversation has none of its own."""
    definitions = tools.definitions() if tools is not None and tools.specs else None
    if fmt.native:
        return [_native(m) for m in messages], definitions
    out = [_generic(m) for m in messages]
    if definitions:
        listing = GENERIC_PROMPT.format(tools="\n".join(json.dumps(d, ensure_ascii=False) for d in definitions))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{listing}"}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out, None


def _native(message: ChatMessage) -> Mapping[str, Any]:
    if "tool_calls" not in message:
        return message
    calls = [
        {**c, "function": {**c["function"], "arguments": _loaded(c["function"]["arguments"])}}
        for c in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}  # templates read arguments as an object


def _generic(message: ChatMessage) -> ChatMessage:
    if message["role"] == "tool":
        return {"role": "user", "content": f"{RESPONSE_OPEN}\n{message['content']}\n{RESPONSE_CLOSE}"}
    if "tool_calls" not in message:
        return message
    blocks = [_call_block(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    text = "\n".join(blocks) if not message["content"] else message["content"] + "\n" + "\n".join(blocks)
    return {"role": "assistant", "content": text}


def _call_block(name: str, arguments: str) -> str:
    body = json.dumps({"name": name, "arguments": _loaded(arguments)}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def _loaded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# -- forcing calls ---------------------------------------------------------------------------
MAX_FORCED_STRING = 1024  # characters: a string in a forced call's arguments whose schema sets no bound
# An open object ({"type": "object"}, nothing said of its keys) in a forced call: any JSON object, this bounded.
MAX_OPEN_MEMBERS = 16  # members of an object, items of an array
MAX_OPEN_DEPTH = 3  # arrays and objects nested inside one
OPEN_KEY = "^.{1,64}$"
OBJECT_BOUNDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
STRING_BOUNDS = ("maxLength", "pattern", "format", "enum", "const")
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def forced_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters as a forced call holds them: every object schema that lists its keys
    (`properties`, `required`) and says nothing of `additionalProperties` is closed (only those keys, as OpenAI's
    strict mode reads a schema), and every string that sets no bound of its own (`maxLength`, `pattern`,
    `format`, `enum`, `const`) gets `maxLength: MAX_FORCED_STRING`. A grammar otherwise lets a model add keys, or
    grow a string, until max_tokens (LangChain's pydantic tools say neither). An object that says nothing of its
    keys at all (`{"type": "object"}`) is open: any JSON object (`open_object`), bounded the same way; closed, it
    could only ever be `{}`, and a `search` tool declared so could never be given a query. A copy: the request's
    tools are left as they are."""
    forced: dict[str, Any] = _forced(schema)
    return forced


def _forced(node: Any, in_all_of: bool = False) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [_forced(item) for item in node[key]]
    if isinstance(node.get("allOf"), list):  # its members are one object together: each closed alone would clash
        out["allOf"] = [_forced(item, in_all_of=True) for item in node["allOf"]]
    for key in SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {name: _forced(item) for name, item in node[key].items()}
    for key in ("items", "additionalProperties", "additionalItems", "contains"):
        if isinstance(node.get(key), dict):
            out[key] = _forced(node[key])
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    is_object = "object" in kinds or (not kinds and "properties" in node)
    is_open = not any(key in node for key in (*OBJECT_BOUNDS, "properties", "required"))
    if is_object and not in_all_of and is_open:
        out |= open_object(MAX_OPEN_DEPTH)
    elif is_object and not in_all_of and not any(key in node for key in OBJECT_BOUNDS):
        properties = dict(out.get("properties") or {})
        for name in node.get("required") or []:  # a required key the schema does not describe: any value
            if isinstance(name, str):
                properties.setdefault(name, {})
        out["properties"], out["additionalProperties"] = properties, False
    if "string" in kinds and not any(key in node for key in STRING_BOUNDS):
        out["maxLength"] = MAX_FORCED_STRING
    return out


def open_object(depth: int) -> dict[str, Any]:
    """Any JSON object, bounded: at most MAX_OPEN_MEMBERS members, keys of 1-64 characters, values nested `depth`
    deep at most (strings of MAX_FORCED_STRING characters, arrays of MAX_OPEN_MEMBERS items). Each bound is one a
    model looping inside the object would otherwise take to max_tokens."""
    return {
        "maxProperties": MAX_OPEN_MEMBERS,
        "patternProperties": {OPEN_KEY: _any_value(depth)},
        "additionalProperties": False,
    }


def _any_value(depth: int) -> dict[str, Any]:
    values: list[dict[str, Any]] = [
        {"type": "string", "maxLength": MAX_FORCED_STRING},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
    ]
    if depth > 0:
        values.append({"type": "array", "maxItems": MAX_OPEN_MEMBERS, "items": _any_value(depth - 1)})
        values.append({"type": "object", **open_object(depth - 1)})
    return {"anyOf": values}


def forced_specs(tools: ToolUse) -> list[ToolSpec]:
    """The functions a forced call may be to (the named one, or all)."""
    return [s for s in tools.specs if tools.choice != "function" or s.name == tools.function]


def grammar(tools: ToolUse, syntax: CallSyntax) -> str:
    """A Lark grammar (llguidance's, JSON schemas embedded) for `required` or a named choice: only calls, each
    to a declared function with arguments valid under its schema (`forced_arguments`), one or (with
    parallel_tool_calls) more. Each call's opening is literal text up to its arguments (`{"name":"f",
    "arguments":`): the name comes first, as the prompt asks, so a call cut short still says whose it is."""
    rules, names = [], []
    for index, spec in enumerate(forced_specs(tools)):
        schema = {
            **forced_arguments(spec.parameters or {"type": "object"}),
            "x-guidance": {"whitespace_flexible": False},
        }
        opening = json.dumps(syntax.opening(spec.name))
        rules.append(f'fn{index}: {opening} args{index} "}}"\nargs{index}: %json {json.dumps(schema)}')
        names.append(f"fn{index}")
    body = "body: " + " | ".join(names) + "\n" + "\n".join(rules)
    return syntax.grammar(body, is_many=tools.parallel and tools.choice != "function")

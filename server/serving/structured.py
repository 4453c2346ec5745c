"""Structured output: what a request's response_format or forced tool choice means as a grammar.

`response_format` text is no grammar; json_object is any JSON object; json_schema is its schema
(strict or not, the grammar holds every token to it). `tool_choice` required or a named function
is the tool-call grammar of the model's call syntax (`tools.grammar`), and wins over a
response_format. The grammar is compiled off the event loop, once per request (a fresh matcher);
one the library refuses is a 400 with its reason.
"""

from __future__ import annotations

import asyncio
from typing import Any

from server.engine.engine import Engine
from server.engine.grammar import Constraint, GrammarError, Grammars
from server.openai.errors import ApiError
from server.openai.formats import ResponseFormat
from server.serving import tools as tool_calls
from server.serving.tools import ToolUse


def schema_of(kind: str, schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema an output format asks for (None: free text)."""
    if kind == "text":
        return None
    return {"type": "object"} if kind == "json_object" else schema or {}


def format_schema(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """Chat and completions' response_format."""
    if response_format is None:
        return None
    spec = response_format.json_schema
    return schema_of(response_format.type, spec.schema_ if spec is not None else None)


def grammar_text(schema: dict[str, Any] | None, tools: ToolUse | None, style: str) -> tuple[str, str] | None:
    """(grammar, the parameter it comes from), or None when the request is free text."""
    try:
        if tools is not None and tools.is_forced:
            return Grammars.lark(tool_calls.grammar(tools, style)), "tool_choice"
        if schema is not None:
            return Grammars.json_schema(schema), "response_format"
    except GrammarError as exc:
        raise ApiError(400, "invalid_parameter", exc.message, "response_format") from exc
    return None


async def constraint(
    engine: Engine, schema: dict[str, Any] | None, tools: ToolUse | None, style: str
) -> Constraint | None:
    found = grammar_text(schema, tools, style)
    if found is None:
        return None
    grammar, param = found
    try:
        return await asyncio.to_thread(engine.grammars.compile, grammar)
    except GrammarError as exc:
        raise ApiError(400, "invalid_parameter", exc.message, "tools" if param == "tool_choice" else param) from exc

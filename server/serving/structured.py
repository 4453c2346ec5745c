"""Structured output: what a request's response_format or forced tool choice means as a grammar.

`response_format` text is no grammar; json_object is any JSON object; json_schema is its schema
(strict or not, the grammar holds every token to it). `tool_choice` required or a named function
is the tool-call grammar of the model's call syntax (`tools.grammar`), and wins over a
response_format. The grammar is compiled off the event loop, once per request (a fresh matcher,
its forced start walked so the library's limits trip now); one the library refuses, or a schema
with no finite document, is a 400 naming the parameter it came from, before the request is admitted.
"""

from __future__ import annotations

import asyncio
from typing import Any

from server.engine.engine import Engine
from server.engine.grammar import Constraint, GrammarError, Grammars
from server.openai.errors import ApiError
from server.openai.formats import ResponseFormat
from server.serving import tools as tool_calls
from server.serving.call_syntax import CallSyntax
from server.serving.json_schema import finite_document_problem
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


async def constraint(
    engine: Engine, schema: dict[str, Any] | None, tools: ToolUse | None, syntax: CallSyntax, format_param: str
) -> Constraint | None:
    """The request's grammar, compiled (None: free text). `format_param`: the API's name of its output format
    (response_format, text.format, output_config.format). Forced calls' grammar is walked from each function's
    call opening too, so a function's arguments past the library's limits are found before generating, whichever
    function the model would pick."""
    starts: dict[str, str] = {}  # "function 'f'" -> its call's opening
    if tools is not None and tools.is_forced:
        specs = tool_calls.forced_specs(tools)
        for spec in specs:
            problem = finite_document_problem(tool_calls.forced_arguments(spec.parameters))
            if problem is not None:
                raise refused(f"function '{spec.name}' parameters: {problem}", "tools")
        starts = {f"function '{s.name}'": syntax.start(s.name) for s in specs}
        grammar, param = Grammars.lark(tool_calls.grammar(tools, syntax)), "tools"
    elif schema is None:
        return None
    else:
        problem, param = finite_document_problem(schema), format_param
        if problem is not None:
            raise refused(f"the JSON schema cannot be used: {problem}", param)
        try:
            grammar = Grammars.json_schema(schema)
        except GrammarError as exc:
            raise refused(exc.message, param) from exc
    try:
        return await asyncio.to_thread(engine.grammars.compile, grammar, starts)
    except GrammarError as exc:
        raise refused(exc.message, param) from exc


def refused(message: str, param: str) -> ApiError:
    """A 400 naming the parameter in its message too (Anthropic's error envelope has no `param`)."""
    return ApiError(400, "invalid_parameter", f"'{param}': {message}", param)

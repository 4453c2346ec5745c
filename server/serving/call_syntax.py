"""How a model writes a tool call: one class per syntax, holding everything that differs between them.

A chat template teaches its model one way of calling: Hermes' `<tool_call>` blocks (the generic prompt,
Qwen, Hermes-2-Pro...) or Llama 3's bare JSON reply (`{"name": ..., "parameters": {...}}`, calls joined by `;`,
perhaps after `<|python_tag|>`). The syntax says how a call opens (what a forced call's grammar writes before
its arguments, and the text its grammar is walked from), how the forcing grammar wraps the calls, and whether
a reply is a bare JSON call (the reader then reads it whole at the end). Nothing else branches on it.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from functools import lru_cache

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


class CallSyntax(ABC):
    name: str  # as logged and compared in tests
    arguments_key: str  # the key a call's arguments are written under

    def opening(self, function: str) -> str:
        """A call's text up to its arguments, compact (as the grammar writes it): the name first."""
        return f'{{"name":{json.dumps(function)},"{self.arguments_key}":'

    @abstractmethod
    def start(self, function: str) -> str:
        """A forced call's first text, its tag included (what the grammar forces once the function is chosen)."""

    @abstractmethod
    def grammar(self, body: str, is_many: bool) -> str:
        """The Lark grammar of a forced reply: `body` (the rule `body`: one call's JSON, whichever function) as
        this syntax writes one call, or (`is_many`) one or more."""

    @abstractmethod
    def json_reply(self, opening: str) -> bool | None:
        """Whether a reply that opens with `opening` is a bare JSON call (read whole at its end); None while the
        opening cannot tell yet."""

    def __repr__(self) -> str:
        return f"<call syntax {self.name}>"


class Hermes(CallSyntax):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call, after any content."""

    name, arguments_key = "hermes", "arguments"

    def start(self, function: str) -> str:
        return CALL_OPEN + "\n" + self.opening(function)

    def grammar(self, body: str, is_many: bool) -> str:
        more = ' ("\\n" call)*' if is_many else ""
        return f'start: call{more}\ncall: "{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}"\n{body}\n'

    def json_reply(self, opening: str) -> bool | None:
        return False  # calls are tagged blocks, read as they close


class Llama3Json(CallSyntax):
    """A reply that is the call: `{"name": ..., "parameters": {...}}` (`;` between calls), perhaps after
    `<|python_tag|>`; any other reply is content."""

    name, arguments_key = "llama3_json", "parameters"

    def start(self, function: str) -> str:
        return self.opening(function)

    def grammar(self, body: str, is_many: bool) -> str:
        more = ' (";" body)*' if is_many else ""
        return f"start: body{more}\n{body}\n"

    def json_reply(self, opening: str) -> bool | None:
        text = opening.lstrip()
        if not text or PYTHON_TAG.startswith(text):
            return None
        return text.startswith(("{", PYTHON_TAG))


HERMES, LLAMA3_JSON = Hermes(), Llama3Json()


@lru_cache(maxsize=64)
def taught_by(template: str | None) -> CallSyntax:
    """The syntax a chat template teaches: Llama 3's JSON where a template that renders tools writes
    `<|python_tag|>` or `"parameters"` and no `<tool_call>` tag; Hermes' blocks otherwise (the generic prompt's)."""
    text = template or ""
    renders_tools = bool(re.search(r"\btools\b", text))
    if renders_tools and (PYTHON_TAG in text or '"parameters"' in text) and CALL_OPEN not in text:
        return LLAMA3_JSON
    return HERMES

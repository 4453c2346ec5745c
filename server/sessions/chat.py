"""Chat's normal form: the messages a chat transcript holds, the tool calls in them (a reply is one such message).

Every API's conversation is brought to this one form (serving/prompts.py, messages.py, response_items.py),
so that a session's record of a reply and a client's echo of it compare equal. TypedDicts: plain dicts at
run time, written to the journal and the shared store as JSON just as they are.
"""

from __future__ import annotations

from typing import Literal, TypedDict

Role = Literal["system", "user", "assistant", "tool"]  # a `developer` message is a system message here


class FunctionCall(TypedDict):
    name: str
    arguments: str  # JSON text, compact when it parses (tools.canonical_arguments); a call cut short: its text so far


class ToolCall(TypedDict):
    id: str  # derived from the request id for calls the server read (tools.call_id); a client's own otherwise
    type: Literal["function"]
    function: FunctionCall


class _Message(TypedDict):
    role: Role
    content: str  # "" for none (null, or an assistant message that only made calls)


class ChatMessage(_Message, total=False):  # the optional keys (NotRequired needs Python 3.11)
    name: str  # the participant's name, as a chat completions request gave it
    tool_calls: list[ToolCall]  # an assistant message's calls
    tool_call_id: str  # a tool message: the call it answers

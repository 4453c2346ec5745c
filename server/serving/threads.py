"""Anthropic's message threads on the session store: the server holds a conversation, a turn sends only its new
messages (`thread` on the Messages API; both of Anthropic's SDKs' tool runners send it by default).

A `create` keeps the turn as a node of the store (kind `message`, keyed by the answer's id: the tenant's, journaled,
shared through Redis like a stored response); a `continue` names a previous answer and sends only the new
messages: the node's conversation, its `system` and tools, are the prompt's start, continued token-exactly from its
transcript and K/V. Each message is continued once (the parent is marked by a compare-and-set); unknown, foreign
or unfinished ones are 404 `thread_not_found`, and the SDKs then replay the conversation as a new thread.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from server.engine.engine import Engine
from server.openai.errors import ApiError
from server.serving.core import Serving
from server.serving.pipeline import Conversation, History, Place, Placement, Turn
from server.serving.tools import ToolSpec, ToolUse
from server.sessions.errors import SessionBusy, SessionNotFound
from server.sessions.record import CompletedTurn, Session, SessionKey
from server.sessions.store import SessionStore

THREAD_KIND = "message"  # a thread's node in the store: the answer it holds, keyed by that answer's id
MESSAGE_ID = r"^msg_[0-9a-f]{32}$"  # the ids this server gives answers (apis.py: its prefix and a uuid's hex)


def keep_nodes(store: SessionStore) -> None:
    """At start: nodes record their turn as it completes; those a previous run never finished go."""
    store.on_turn(THREAD_KIND, record_node)
    for key in store.session_keys(THREAD_KIND):
        view = store.view(key)
        if view is not None and view.extras.get("status") == "in_progress":
            store.delete(key)


@dataclass(slots=True, frozen=True)
class ThreadHistory(History):
    """A thread continued (Anthropic's message threads): the conversation its node holds, `system` and the tools
    included, then the request's new messages; the prompt continues the node's transcript token-exactly. The tool
    choice is the request's own (a turn may change it), over the thread's tools."""

    previous_id: str
    choice: str = "auto"  # as ToolUse's
    function: str | None = None
    parallel: bool = True

    async def read(self, serving: Serving, engine: Engine, turn: Turn) -> Conversation:
        assert turn.messages is not None
        node = await serving.off_loop(thread_node, serving.store, turn.tenant, self.previous_id)
        if node is None or node.extras.get("status") != "completed":
            raise thread_not_found(self.previous_id)
        if node.model_id != engine.model_id:
            message = f"the thread was made with model {node.model_id!r}: continue it with that model"
            raise ApiError(400, "thread_fingerprint_mismatch", message, "model")
        return Conversation(node.messages + turn.messages, node, self._tools(node.tools))

    def _tools(self, definitions: list[dict[str, Any]] | None) -> ToolUse | None:
        specs = tuple(
            ToolSpec(d["function"]["name"], d["function"].get("description"), d["function"]["parameters"])
            for d in definitions or []
        )
        if self.choice in ("required", "function") and not any(
            self.choice == "required" or spec.name == self.function for spec in specs
        ):
            message = "tool_choice names a tool the thread does not have" if specs else "the thread has no tools"
            raise ApiError(400, "invalid_parameter", message, "tool_choice")
        return ToolUse(specs, self.choice, self.function, self.parallel) if specs else None


@dataclass(slots=True, frozen=True)
class ThreadNode(Place):
    """A thread's turn is a node of the store (kind `message`, keyed by the answer's id, the tenant's, kept like a
    stored response), the engine's session: it records the turn. A continue first marks its parent continued by
    this node: each message is continued once (a second continue is refused, and the client's SDK replays the
    conversation as a new thread)."""

    parent_id: str | None

    async def place(self, serving: Serving, engine: Engine, turn: Turn, num_tokens: int) -> Placement:
        store, key = serving.store, SessionKey(turn.tenant, turn.request_id, THREAD_KIND)
        serving.check_quota(key, num_tokens, engine)  # before the node exists
        parent = None
        if self.parent_id is not None:
            parent = SessionKey(turn.tenant, self.parent_id, THREAD_KIND)
            await serving.off_loop(claim, store, parent, key.name)
        ttl, extras = serving.settings.response_retention_s, {"status": "in_progress"}
        await serving.off_loop(store.create, key, engine.model_id, ttl, parent=self.parent_id, extras=extras)
        # A node whose turn did not complete goes (a parent it claimed is then free again: it names no node).
        return Placement(key, parent, lambda: serving.off_loop(store.delete, key))


def thread_node(store: SessionStore, tenant: str, message_id: str) -> Session | None:
    if not re.fullmatch(MESSAGE_ID, message_id):
        return None  # never one of ours: found nowhere
    return store.view(SessionKey(tenant, message_id, THREAD_KIND))


def claim(store: SessionStore, parent: SessionKey, child: str) -> None:
    """Mark the node `parent` continued by `child`, once: refused while another continue of it runs, and once one
    completed. A mark naming a node that no longer exists (its turn failed) is free."""
    node = store.view(parent)
    if node is None or node.extras.get("status") != "completed":
        raise thread_not_found(parent.name)
    held = node.extras.get("continued_by")
    other = store.view(SessionKey(parent.tenant, held, THREAD_KIND)) if isinstance(held, str) else None
    if other is not None and other.extras.get("status") == "in_progress":
        raise continue_in_flight(parent.name)
    if other is not None:
        message = f"message {parent.name!r} was continued already (by {held!r}); continue from the thread's latest"
        raise ApiError(400, "thread_already_continued", message, "thread.previous_message_id")
    try:
        store.mark(parent, "continued_by", child, held)
    except SessionNotFound as exc:
        raise thread_not_found(parent.name) from exc
    except SessionBusy as exc:  # another request marked it meanwhile (here or on another replica)
        raise continue_in_flight(parent.name) from exc


def record_node(extras: dict[str, Any], turn: CompletedTurn) -> None:
    """The store's hook for thread nodes: the turn completed, so the node can be continued."""
    extras.update(status="completed", finish_reason=turn.finish_reason)


def thread_not_found(message_id: str) -> ApiError:
    message = f"no thread holds message {message_id!r}; send the whole conversation with thread.type 'create'"
    return ApiError(404, "thread_not_found", message, "thread.previous_message_id")


def continue_in_flight(message_id: str) -> ApiError:
    message = f"another request is continuing message {message_id!r}; continue from its answer when it ends"
    return ApiError(400, "thread_continue_in_flight", message, "thread.previous_message_id")

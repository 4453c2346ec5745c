"""A session: its key, the token transcript turn by turn, its chat messages, and what a turn reports.

The transcript is the source of truth (K/V only saves recomputation); the journal writes the
record to disk when a turn completes, before the client hears that it did. Nothing here knows
about tensors: K/V lives in server/kv, found by the transcript's prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

from server.sessions.chat import ChatMessage
from server.sessions.errors import InvalidTurn, SessionModeMismatch

RECORD_VERSION = 1
# Kept records: sessions, stored responses and message-thread nodes (Anthropic's threads); buckets keep nothing.
STORED_KINDS = ("session", "response", "message")
KINDS = (*STORED_KINDS, "bucket")


@dataclass(slots=True, frozen=True)
class SessionKey:
    """Where a request's state lives: a tenant's session, stored response, message-thread node or cache bucket."""

    tenant: str
    name: str
    kind: str = "session"  # session | response | message | bucket (prompt_cache_key: shared, never locks)

    @property
    def is_bucket(self) -> bool:
        return self.kind == "bucket"


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens not fed to the model in this request
    cache_write_tokens: int = 0  # prompt tokens this request computed and kept in the cache (0: cache_prompt off)


@dataclass(slots=True)
class Turn:
    end: int  # transcript length once this turn completed
    num_messages: int  # chat messages the transcript holds by then


@dataclass(slots=True, frozen=True)
class CompletedTurn:
    """What the engine reports when a request completes; the store turns it into session state."""

    transcript_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    messages: list[ChatMessage] | None  # the request's chat messages (None: a completion, not chat)
    is_prefill_only: bool = False  # generated nothing (max_tokens 0): no turn, the record stays as it was
    reply: ChatMessage | None = None  # chat: the reply as answered (content, tool calls); None: its text
    tools: list[dict[str, Any]] | None = None  # chat: the tool definitions the prompt rendered


class SessionRecord(TypedDict):
    """A session as the journal and the shared store write it (JSON): `Session.to_record`, read by `from_record`."""

    version: int
    session: list[str]  # tenant, name, kind
    model: str
    transcript_ids: list[int]
    turns: list[list[int]]  # [end, num_messages] per turn
    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None
    ttl_s: float
    parent: str | None
    record: dict[str, Any]  # the extras
    created_at: float
    last_used_at: float
    rev: int
    op: str
    epoch: str


@dataclass(slots=True)
class Session:
    key: SessionKey
    model_id: str
    transcript_ids: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=lambda: [Turn(0, 0)])  # turns[0]: the base (system prompt)
    messages: list[ChatMessage] = field(default_factory=list)  # chat messages the transcript holds
    tools: list[dict[str, Any]] | None = None  # the tool definitions its prompt rendered (a change: no continuation)
    ttl_s: float = 3600.0
    parent: str | None = None  # responses: the previous response; forks: the session branched from
    extras: dict[str, Any] = field(default_factory=dict)  # what the kind's own code keeps (responses: fields, result)
    created_at: float = 0.0  # unix time
    last_use: float = 0.0  # monotonic clock
    last_use_wall: float = 0.0  # unix time, for reporting and restarts
    is_in_use: bool = False
    rev: int = 0  # how many times the record was written
    # The operation that wrote the record (replicas: a change commits only on top of the one it read) and the
    # shared store's epoch it was written in ("": never shared; see shared_state.py)
    op: str = ""
    epoch: str = ""
    # Made on first use by the request holding it, which has not ended yet: if that request fails (or is cancelled),
    # the session goes with it (nothing is left behind, as a failed turn leaves a session as it was)
    is_claim: bool = False

    @property
    def num_turns(self) -> int:
        return len(self.turns) - 1

    def apply(self, turn: CompletedTurn) -> None:
        """The transcript becomes the turn's prompt and reply, a turn after the ones its prompt still holds.

        A prompt that extends the transcript holds every turn. One that does not (an edited history, a full
        re-render, a retried turn) holds only the turns that end where its tokens and its messages still
        agree with the transcript's: later marks would name points of a conversation no longer held, so
        they go, and a fork or rewind to any turn gives exactly the conversation at that turn.
        """
        prompt_ids = turn.transcript_ids[: turn.usage.prompt_tokens]
        num_held_ids = common_prefix_len(self.transcript_ids, prompt_ids)
        num_held_messages = _num_same(self.messages, turn.messages or [])
        held = [t for t in self.turns if t.end <= num_held_ids and t.num_messages <= num_held_messages]
        self.transcript_ids = list(turn.transcript_ids)
        if turn.messages is None or self.key.is_bucket:  # a bucket is a cache key: it keeps no prompt text
            self.messages = []
        else:
            self.messages = [*turn.messages, turn.reply or {"role": "assistant", "content": turn.text}]
        self.tools = turn.tools
        # Marks grow turn by turn: when the base (the system prompt prefilled at creation) is not held, none is.
        self.turns = [*(held or [Turn(0, 0)]), Turn(len(self.transcript_ids), len(self.messages))]

    def with_turn(
        self, turn: CompletedTurn, hook: Callable[[dict[str, Any], CompletedTurn], None] | None, now: float
    ) -> Session:
        """A copy with `turn` applied (and the kind's `hook` on its extras), last used at wall time `now`."""
        staged = self.copy()
        staged.apply(turn)
        if hook is not None:
            hook(staged.extras, turn)
        staged.last_use_wall = now
        return staged

    def copy(self) -> Session:
        """A detached copy, safe to read or change outside the store's lock."""
        return replace(
            self,
            transcript_ids=list(self.transcript_ids),
            turns=list(self.turns),
            messages=[m.copy() for m in self.messages],
            extras=dict(self.extras),
        )

    def branch(self, num_turns: int) -> dict[str, Any]:
        """The fields of a new session holding this one's first `num_turns` turns (a fork)."""
        self.check_turn(num_turns)
        turns = list(self.turns[: num_turns + 1])
        return {
            "transcript_ids": list(self.transcript_ids[: turns[-1].end]),
            "messages": [m.copy() for m in self.messages[: turns[-1].num_messages]],
            "tools": self.tools,
            "turns": turns,
            "parent": self.key.name,
        }

    def check_mode(self, is_chat: bool) -> None:
        """A session never switches between a chat and a completion transcript: one would replace the other."""
        if self.key.kind == "session" and self.transcript_ids and bool(self.messages) != is_chat:
            held, use = ("chat", "/v1/chat/completions") if self.messages else ("completion", "/v1/completions")
            raise SessionModeMismatch(f"session {self.key.name!r} holds a {held} transcript: use {use}")

    def check_turn(self, num_turns: int) -> None:
        if not 0 <= num_turns <= self.num_turns:
            raise InvalidTurn(f"turn must be between 0 and {self.num_turns}, the session's number of turns")

    def cut(self, num_turns: int) -> None:
        """Keep turns 1..num_turns (and the base)."""
        self.turns = self.turns[: num_turns + 1]
        last = self.turns[-1]
        self.transcript_ids = self.transcript_ids[: last.end]
        self.messages = self.messages[: last.num_messages]

    def to_record(self) -> SessionRecord:
        return {
            "version": RECORD_VERSION,
            "session": [self.key.tenant, self.key.name, self.key.kind],
            "model": self.model_id,
            "transcript_ids": self.transcript_ids,
            "turns": [[t.end, t.num_messages] for t in self.turns],
            "messages": self.messages,
            "tools": self.tools,
            "ttl_s": self.ttl_s,
            "parent": self.parent,
            "record": self.extras,
            "created_at": self.created_at,
            "last_used_at": self.last_use_wall,
            "rev": self.rev,
            "op": self.op,
            "epoch": self.epoch,
        }

    @classmethod
    def from_record(cls, data: Mapping[str, Any], now_mono: float, now_wall: float) -> Session:
        """A record read back (a journal file, the shared store): JSON as found, checked here (KeyError,
        TypeError, ValueError when it is not a SessionRecord of this version)."""
        if data.get("version") != RECORD_VERSION:
            raise ValueError(f"record version {data.get('version')!r}")
        tenant, name, kind = data["session"]
        if kind not in KINDS:
            raise ValueError(f"record kind {kind!r}")
        last_wall = float(data["last_used_at"])
        return cls(
            key=SessionKey(str(tenant), str(name), str(kind)),
            model_id=str(data["model"]),
            transcript_ids=[int(t) for t in data["transcript_ids"]],
            turns=[Turn(int(end), int(n)) for end, n in data["turns"]],
            messages=list(data["messages"]),
            tools=data.get("tools"),
            ttl_s=float(data["ttl_s"]),
            parent=data.get("parent"),
            extras=dict(data.get("record") or {}),
            created_at=float(data["created_at"]),
            last_use=now_mono - max(0.0, now_wall - last_wall),
            last_use_wall=last_wall,
            rev=int(data.get("rev", 0)),
            op=str(data.get("op") or ""),
            epoch=str(data.get("epoch") or ""),
        )


@dataclass(slots=True, frozen=True)
class SessionInfo:
    key: SessionKey
    model_id: str
    num_turns: int
    num_transcript_tokens: int
    num_base_tokens: int  # the system prompt prefilled at creation
    is_in_use: bool
    created_at: float  # unix time
    last_use: float  # unix time
    expires_at: float  # unix time
    parent: str | None

    @classmethod
    def of(cls, session: Session) -> SessionInfo:
        return cls(
            key=session.key,
            model_id=session.model_id,
            num_turns=session.num_turns,
            num_transcript_tokens=len(session.transcript_ids),
            num_base_tokens=session.turns[0].end,
            is_in_use=session.is_in_use,
            created_at=session.created_at,
            last_use=session.last_use_wall,
            expires_at=session.last_use_wall + session.ttl_s,
            parent=session.parent,
        )


def _num_same(a: list[ChatMessage], b: list[ChatMessage]) -> int:
    """How many leading messages a and b share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share; equal runs are compared a slice at a time (C speed)."""
    n = min(len(a), len(b))
    i, step = 0, 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i

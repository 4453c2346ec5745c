"""A session record: the token transcript turn by turn, its chat messages, and what a turn reports.

The transcript is the source of truth (K/V snapshots only save recomputation); journal.py
writes it to disk when a turn completes, before the client hears that it did.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from server.engine.types import InvalidTurn, SessionKey, Usage

RECORD_VERSION = 1


@dataclass(slots=True)
class Turn:
    end: int  # transcript length once this turn completed
    num_messages: int  # chat messages the transcript holds by then


@dataclass(slots=True)
class CompletedTurn:
    """What the engine reports when a request completes; the store turns it into session state."""

    transcript_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    messages: list[dict] | None  # the request's chat messages (None: a completion, not chat)
    is_base: bool = False  # a prefill-only request: sets the session's starting point, not a turn


@dataclass(slots=True)
class Entry:
    key: SessionKey
    model_id: str
    transcript_ids: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=lambda: [Turn(0, 0)])  # turns[0]: the base (system prompt)
    messages: list[dict] = field(default_factory=list)  # chat messages held by the transcript, last one generated
    ttl_s: float = 3600.0
    parent: str | None = None  # responses: the previous response; forks: the session branched from
    record: dict[str, Any] = field(default_factory=dict)  # responses: request fields and result
    created_at: float = 0.0  # unix time
    last_use: float = 0.0  # monotonic clock
    last_use_wall: float = 0.0  # unix time, for reporting and restarts
    is_in_use: bool = False
    cache: Any = None  # per-session engine only: this session's DynamicCache
    cached_ids: list[int] = field(default_factory=list)
    nbytes: int = 0

    @property
    def num_turns(self) -> int:
        return len(self.turns) - 1

    def apply(self, turn: CompletedTurn) -> None:
        self.transcript_ids = list(turn.transcript_ids)
        if turn.messages is None or self.key.is_bucket:  # a bucket is a cache key: it keeps no prompt text
            self.messages = []
        else:
            reply = [] if turn.is_base else [{"role": "assistant", "content": turn.text}]
            self.messages = [*turn.messages, *reply]
        if self.key.kind == "response":  # what GET /v1/responses/{id} reports
            usage = turn.usage
            self.record.update(
                status="completed" if turn.finish_reason == "stop" else "incomplete",
                output_text=turn.text,
                finish_reason=turn.finish_reason,
                usage=[usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens],
            )
        mark = Turn(len(self.transcript_ids), len(self.messages))
        if turn.is_base:
            self.turns = [mark]
        else:
            self.turns.append(mark)

    def copy(self) -> Entry:
        """A detached copy of the record (no cache), safe to read outside the store's lock."""
        return replace(
            self,
            transcript_ids=list(self.transcript_ids),
            turns=list(self.turns),
            messages=[dict(m) for m in self.messages],
            record=dict(self.record),
            cache=None,
            cached_ids=[],
        )

    def branch(self, num_turns: int) -> dict[str, Any]:
        """The fields of a new session holding this one's first `num_turns` turns (a fork)."""
        self.check_turn(num_turns)
        turns = list(self.turns[: num_turns + 1])
        return {
            "transcript_ids": list(self.transcript_ids[: turns[-1].end]),
            "messages": [dict(m) for m in self.messages[: turns[-1].num_messages]],
            "turns": turns,
            "parent": self.key.name,
        }

    def check_turn(self, num_turns: int) -> None:
        if not 0 <= num_turns <= self.num_turns:
            raise InvalidTurn(f"turn must be between 0 and {self.num_turns}, the session's number of turns")

    def cut(self, num_turns: int) -> None:
        """Keep turns 1..num_turns (and the base)."""
        self.turns = self.turns[: num_turns + 1]
        last = self.turns[-1]
        self.transcript_ids = self.transcript_ids[: last.end]
        self.messages = self.messages[: last.num_messages]

    def to_record(self) -> dict:
        return {
            "version": RECORD_VERSION,
            "session": [self.key.tenant, self.key.name, self.key.kind],
            "model": self.model_id,
            "transcript_ids": self.transcript_ids,
            "turns": [[t.end, t.num_messages] for t in self.turns],
            "messages": self.messages,
            "ttl_s": self.ttl_s,
            "parent": self.parent,
            "record": self.record,
            "created_at": self.created_at,
            "last_used_at": self.last_use_wall,
        }

    @classmethod
    def from_record(cls, data: dict, now_mono: float, now_wall: float) -> Entry:
        if data.get("version") != RECORD_VERSION:
            raise ValueError(f"record version {data.get('version')!r}")
        tenant, name, kind = data["session"]
        last_wall = float(data["last_used_at"])
        return cls(
            key=SessionKey(tenant, name, kind),
            model_id=data["model"],
            transcript_ids=[int(t) for t in data["transcript_ids"]],
            turns=[Turn(int(end), int(n)) for end, n in data["turns"]],
            messages=list(data["messages"]),
            ttl_s=float(data["ttl_s"]),
            parent=data.get("parent"),
            record=dict(data.get("record") or {}),
            created_at=float(data["created_at"]),
            last_use=now_mono - max(0.0, now_wall - last_wall),
            last_use_wall=last_wall,
        )


@dataclass(slots=True)
class SessionInfo:
    key: SessionKey
    model_id: str
    num_turns: int
    num_transcript_tokens: int
    num_base_tokens: int  # the system prompt prefilled at creation
    num_cached_tokens: int  # per-session engine: tokens of K/V held in the store
    nbytes: int
    is_in_use: bool
    created_at: float  # unix time
    last_use: float  # unix time
    expires_at: float  # unix time
    parent: str | None


def info_of(entry: Entry) -> SessionInfo:
    return SessionInfo(
        key=entry.key,
        model_id=entry.model_id,
        num_turns=entry.num_turns,
        num_transcript_tokens=len(entry.transcript_ids),
        num_base_tokens=entry.turns[0].end,
        num_cached_tokens=len(entry.cached_ids),
        nbytes=entry.nbytes,
        is_in_use=entry.is_in_use,
        created_at=entry.created_at,
        last_use=entry.last_use_wall,
        expires_at=entry.last_use_wall + entry.ttl_s,
        parent=entry.parent,
    )


@dataclass(slots=True)
class StoreStats:
    num_entries: int
    nbytes: int
    num_evictions: int
    num_expired: int


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

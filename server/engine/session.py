"""A session record and its journal: the transcript, turn by turn, written to disk as JSON.

The transcript is the source of truth (K/V snapshots only save recomputation), so it is
written, atomically, when a turn completes and before the client hears that it did: a
killed server loses no completed turn. One small JSON file per session; snapshots live
next to it in the tier store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.engine.types import SessionKey, Usage

log = logging.getLogger("kvserve.sessions")
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
        if turn.messages is None:
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


class Journal:
    """One JSON file per session under `directory`; None: sessions live in memory only."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    def path_for(self, key: SessionKey) -> Path:
        assert self.directory is not None
        tenant_dir = hashlib.sha256(key.tenant.encode()).hexdigest()[:16]
        return self.directory / tenant_dir / f"{key.kind}-{key.name}.json"

    def save(self, key: SessionKey, record: dict) -> None:
        if self.directory is None or key.is_bucket:
            return
        path = self.path_for(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(record, separators=(",", ":")))
        os.replace(partial, path)  # atomic: a reader sees the old turn or the new one, never half

    def delete(self, key: SessionKey) -> None:
        if self.directory is not None:
            self.path_for(key).unlink(missing_ok=True)

    def load_all(self) -> list[dict]:
        if self.directory is None or not self.directory.exists():
            return []
        records = []
        for path in sorted(self.directory.glob("*/*.json")):
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError) as exc:
                log.warning("skipping unreadable session record %s: %s", path, exc)
        return records

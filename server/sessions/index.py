"""The session store's indexes: what a page, a quota check or an expiry sweep needs, without a walk over every
session. All are kept under the store's lock, updated whenever a session is added, changed or removed.

- creation order per (tenant, kind): a page of a listing costs the page;
- counts and transcript tokens per tenant: a quota check costs nothing;
- transcripts sorted per (tenant, model): the longest prefix a transcript shares with any other one is the
  longer of its common prefixes with its two neighbours, so "who else reaches these K/V blocks" is two
  comparisons, not a walk;
- expiry times in a heap (stale entries are skipped when they surface): expiring costs what expires;
- idle sessions per model, least recently used first: what may leave the device, without a sort.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple

from sortedcontainers import SortedDict, SortedList

from server.sessions.record import STORED_KINDS, Session, SessionKey, common_prefix_len


class Reach(NamedTuple):
    """How much of a transcript another transcript of the tenant shares."""

    num_tokens: int  # the longest common prefix with any other
    is_covered: bool  # the transcript ends there: it is a prefix of another, which reaches all its blocks
    other_ends: bool  # the other ends there: it reaches (part of) the block the common prefix ends in

    def num_blocks(self, num_own: int, block_size: int) -> int:
        """How many of the transcript's `num_own` blocks (in chain order) the other reaches."""
        if self.is_covered:
            return num_own
        whole, rest = divmod(self.num_tokens, block_size)
        return whole + (1 if rest and self.other_ends else 0)


@dataclass(slots=True)
class TenantIndex:
    created: dict[str, SortedDict] = field(default_factory=dict)  # kind -> (created_at, name) -> key
    counts: Counter[str] = field(default_factory=Counter)  # kind -> sessions of that kind
    num_tokens: int = 0  # transcript tokens of its sessions and responses (buckets keep nothing)
    transcripts: dict[str, SortedList] = field(default_factory=dict)  # model -> [(transcript, name, kind)]


class Forgotten:
    """Deleted or expired sessions' transcripts, per model, until that model's engine takes them."""

    def __init__(self, limit: int = 100_000) -> None:
        self._by_model: dict[str, deque[tuple[SessionKey, list[int]]]] = {}
        self._limit = limit

    def add(self, session: Session) -> None:
        by_model = self._by_model.setdefault(session.model_id, deque(maxlen=self._limit))
        by_model.append((session.key, session.transcript_ids))

    def take(self, model_id: str) -> list[tuple[SessionKey, list[int]]]:
        mine = self._by_model.get(model_id)  # empty, the common case: asked on every engine step
        if not mine:
            return []
        taken = list(mine)
        mine.clear()
        return taken


class SessionIndex:
    def __init__(self) -> None:
        self._tenants: dict[str, TenantIndex] = {}
        self._expiry: list[tuple[float, int, SessionKey]] = []  # (expires at, touch, key)
        self._touch = itertools.count()
        self._touches: dict[SessionKey, int] = {}
        self._idle: dict[str, OrderedDict[SessionKey, None]] = {}  # model -> idle sessions, oldest use first

    def _tenant(self, tenant: str) -> TenantIndex:
        return self._tenants.setdefault(tenant, TenantIndex())

    # -- membership ------------------------------------------------------------------------
    def add(self, session: Session) -> None:
        key, index = session.key, self._tenant(session.key.tenant)
        index.created.setdefault(key.kind, SortedDict())[(session.created_at, key.name)] = key
        index.counts[key.kind] += 1
        self._add_transcript(index, session)
        self.touch(session)

    def remove(self, session: Session) -> None:
        key, index = session.key, self._tenant(session.key.tenant)
        index.created[key.kind].pop((session.created_at, key.name), None)
        index.counts[key.kind] -= 1
        self._remove_transcript(index, session)
        self._touches.pop(key, None)
        self._idle.get(session.model_id, OrderedDict()).pop(key, None)

    def retranscribe(self, session: Session, transcript_ids: list[int]) -> None:
        """The session's transcript becomes `transcript_ids` (a new list: transcripts are never changed in place)."""
        index = self._tenant(session.key.tenant)
        self._remove_transcript(index, session)
        session.transcript_ids = transcript_ids
        self._add_transcript(index, session)

    def _add_transcript(self, index: TenantIndex, session: Session) -> None:
        if session.key.is_bucket:
            return
        index.num_tokens += len(session.transcript_ids)
        by_model = index.transcripts.setdefault(session.model_id, SortedList())
        by_model.add((session.transcript_ids, session.key.name, session.key.kind))  # unique: removal bisects

    def _remove_transcript(self, index: TenantIndex, session: Session) -> None:
        if session.key.is_bucket:
            return
        index.num_tokens -= len(session.transcript_ids)
        index.transcripts[session.model_id].remove((session.transcript_ids, session.key.name, session.key.kind))

    # -- questions -------------------------------------------------------------------------
    def page(self, tenant: str, kind: str, after: tuple[float, str] | None, limit: int) -> list[SessionKey]:
        """Up to `limit` keys of the tenant's sessions of `kind`, oldest first, after `after` (created, name)."""
        created = self._tenant(tenant).created.get(kind)
        if not created:
            return []
        found = created.irange(minimum=after, inclusive=(False, True)) if after else created.irange()
        return [created[item] for item in itertools.islice(found, limit)]

    def counts(self) -> Counter[str]:
        """Sessions by kind, over every tenant."""
        return sum((index.counts for index in self._tenants.values()), Counter())

    def usage(self, tenant: str, exclude: SessionKey, excluded: Session | None) -> tuple[int, int]:
        """(the tenant's buckets, or its kept records (sessions, responses, thread nodes), as `exclude` is one or
        not; their transcript tokens), `exclude` (`excluded` when it exists) left out."""
        index = self._tenant(tenant)
        counts, num_tokens = index.counts, index.num_tokens
        same = counts["bucket"] if exclude.is_bucket else sum(counts[kind] for kind in STORED_KINDS)
        if excluded is not None:
            same -= 1
            num_tokens -= 0 if exclude.is_bucket else len(excluded.transcript_ids)
        return same, num_tokens

    def reach(self, tenant: str, model_id: str, transcript: list[int], exclude: SessionKey | None) -> Reach:
        """The longest prefix of `transcript` another of the tenant's transcripts on the model starts with."""
        by_model = self._tenant(tenant).transcripts.get(model_id)
        best = Reach(0, False, False)
        if not by_model:
            return best
        at = by_model.bisect_left((transcript,))
        skip = (exclude.name, exclude.kind) if exclude is not None else None
        # Its predecessor and successor among the others: within two places each way, the one left out aside.
        for other, name, kind in by_model.islice(max(0, at - 2), at + 2):
            if (name, kind) != skip:
                n = common_prefix_len(other, transcript)
                best = max(best, Reach(n, n == len(transcript), n == len(other)))
        return best

    # -- expiry ------------------------------------------------------------------------------
    def busy(self, session: Session) -> None:
        """A request took the session: not idle until it is touched again."""
        self._idle.get(session.model_id, OrderedDict()).pop(session.key, None)

    def idle(self, model_id: str) -> list[SessionKey]:
        """Idle sessions and responses of a model, least recently used first."""
        return list(self._idle.get(model_id, ()))

    def touch(self, session: Session) -> None:
        """The session was used (and is idle now): it expires `ttl_s` from now (its previous expiry entry goes
        stale) and is the most recently used."""
        if not session.key.is_bucket:
            idle = self._idle.setdefault(session.model_id, OrderedDict())
            idle.pop(session.key, None)
            idle[session.key] = None
        touch = next(self._touch)
        self._touches[session.key] = touch
        heapq.heappush(self._expiry, (session.last_use + session.ttl_s, touch, session.key))
        if len(self._expiry) > 2 * len(self._touches) + 1024:  # too many stale entries: rebuild
            self._expiry = [entry for entry in self._expiry if self._touches.get(entry[2]) == entry[1]]
            heapq.heapify(self._expiry)

    def due(self, now: float) -> list[SessionKey]:
        """Keys whose latest expiry time has passed (taken off the heap; a session in use is touched again
        when it is released)."""
        found = []
        while self._expiry and self._expiry[0][0] < now:
            _, touch, key = heapq.heappop(self._expiry)
            if self._touches.get(key) == touch:
                found.append(key)
        return found

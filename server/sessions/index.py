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
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from sortedcontainers import SortedDict, SortedKeyList

from server.sessions.record import Session, SessionKey, common_prefix_len


class Reach(NamedTuple):
    """How much of a transcript another transcript of the tenant shares."""

    num_tokens: int  # the longest common prefix with any other
    is_whole: bool  # one of the two ends there (one is a prefix of the other): a block it ends in is reached too

    def num_blocks(self, block_size: int) -> int:
        """The transcript's blocks the other reaches: the full ones in the common prefix, and the one it ends in."""
        whole, rest = divmod(self.num_tokens, block_size)
        return whole + (1 if rest and self.is_whole else 0)


def _transcript_of(entry: tuple[list[int], SessionKey]) -> list[int]:
    return entry[0]


@dataclass(slots=True)
class TenantIndex:
    created: dict[str, SortedDict] = field(default_factory=dict)  # kind -> (created_at, name) -> key
    counts: Counter[str] = field(default_factory=Counter)  # kind -> sessions of that kind
    num_tokens: int = 0  # transcript tokens of its sessions and responses (buckets keep nothing)
    transcripts: dict[str, SortedKeyList] = field(default_factory=dict)  # model -> [(transcript, key)]


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
        by_model = index.transcripts.setdefault(session.model_id, SortedKeyList(key=_transcript_of))
        by_model.add((session.transcript_ids, session.key))

    def _remove_transcript(self, index: TenantIndex, session: Session) -> None:
        if session.key.is_bucket:
            return
        index.num_tokens -= len(session.transcript_ids)
        index.transcripts[session.model_id].remove((session.transcript_ids, session.key))

    # -- questions -------------------------------------------------------------------------
    def page(self, tenant: str, kind: str, after: tuple[float, str] | None, limit: int) -> list[SessionKey]:
        """Up to `limit` keys of the tenant's sessions of `kind`, oldest first, after `after` (created, name)."""
        created = self._tenant(tenant).created.get(kind)
        if not created:
            return []
        found = created.irange(minimum=after, inclusive=(False, True)) if after else created.irange()
        return [created[item] for item in itertools.islice(found, limit)]

    def usage(self, tenant: str, exclude: SessionKey, excluded: Session | None) -> tuple[int, int]:
        """(the tenant's buckets, or its sessions and responses, as `exclude` is one or not; their transcript
        tokens), `exclude` (`excluded` when it exists) left out."""
        index = self._tenant(tenant)
        counts, num_tokens = index.counts, index.num_tokens
        same = counts["bucket"] if exclude.is_bucket else counts["session"] + counts["response"]
        if excluded is not None:
            same -= 1
            num_tokens -= 0 if exclude.is_bucket else len(excluded.transcript_ids)
        return same, num_tokens

    def reach(self, tenant: str, model_id: str, transcript: list[int], exclude: SessionKey | None) -> Reach:
        """The longest prefix of `transcript` another of the tenant's transcripts on the model starts with."""
        by_model = self._tenant(tenant).transcripts.get(model_id)
        best = Reach(0, False)
        if not by_model:
            return best
        at = by_model.bisect_key_left(transcript)
        for other, key in by_model.islice(max(0, at - 1), at + 2):
            if key != exclude:
                n = common_prefix_len(other, transcript)
                best = max(best, Reach(n, n in (len(other), len(transcript))))
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

"""Session and stored-response records shared by replicas, in Redis (torch-free).

Each record is a hash `kvserve:rec:<tenant>:<kind>:<name>` with the record's JSON and its revision
(`rev`, how many times it was written). A change commits only on top of the revision its writer
read (compare-and-set, in one Lua script), so two replicas can never both append turn k: the
second is refused and its turn is not applied. A record expires with its session's TTL, renewed
by every write and every use. A delete leaves a tombstone for the TTL, so a replica holding a
stale copy learns the session is gone instead of bringing it back.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

from server.sessions.errors import SessionBusy, SharedStoreUnavailable
from server.sessions.health import SharedStoreHealth
from server.sessions.record import SessionKey

log = logging.getLogger("kvserve.sessions")
GONE = "gone"  # load(): the record was deleted (a tombstone), not merely never written

# KEYS: record, tombstone. ARGV: expected rev, new rev, record JSON, TTL in ms. The current rev, or "ok".
SAVE = """
local current = redis.call('hget', KEYS[1], 'rev') or '0'
if current ~= ARGV[1] then return current end
redis.call('hset', KEYS[1], 'rev', ARGV[2], 'record', ARGV[3])
redis.call('pexpire', KEYS[1], ARGV[4])
redis.call('del', KEYS[2])
return 'ok'
"""


class SharedRecords:
    def __init__(self, url: str, timeout_s: float = 1.0, health: SharedStoreHealth | None = None) -> None:
        """`health`: whether the shared store answers, as every user of it sees (a new one when not given)."""
        import redis  # only with a shared store configured

        self.health = health or SharedStoreHealth()
        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self.client: Any = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._save = self.client.register_script(SAVE)

    def load(self, key: SessionKey) -> dict[str, Any] | str | None:
        """The record as last committed, GONE when it was deleted, None when no replica wrote one."""
        with self._answering():
            pipe = self.client.pipeline(transaction=False)
            pipe.hget(_record(key), "record")
            pipe.exists(_tombstone(key))
            data, deleted = pipe.execute()
        if data is not None:
            record: dict[str, Any] = json.loads(data)
            return record
        return GONE if deleted else None

    def save(self, key: SessionKey, record: dict[str, Any], expected_rev: int) -> None:
        """Commit `record` (its `rev`) only if the shared copy is still at `expected_rev` (0: none). Raises
        SessionBusy when another replica moved it on, SharedStoreUnavailable when Redis does not answer."""
        args = [expected_rev, record["rev"], json.dumps(record, separators=(",", ":")), _ms(float(record["ttl_s"]))]
        with self._answering():
            answer = self._save(keys=[_record(key), _tombstone(key)], args=args)
        if answer != b"ok":
            held = int(answer)
            what = "already exists" if expected_rev == 0 else "was changed by another replica"
            raise SessionBusy(f"{key.kind} {key.name!r} {what} (at revision {held}, this replica had {expected_rev})")

    def touch(self, key: SessionKey, ttl_s: float) -> None:
        """A use without a change: the record lives another TTL. Best effort."""
        try:
            with self._answering():
                self.client.pexpire(_record(key), _ms(ttl_s))
        except SharedStoreUnavailable:
            log.warning("the shared record of %s was not renewed: the shared store did not answer", key.name)

    def delete(self, key: SessionKey, ttl_s: float) -> None:
        with self._answering():
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(_record(key))
            pipe.set(_tombstone(key), 1, px=_ms(ttl_s))
            pipe.execute()

    def close(self) -> None:
        self.client.close()

    @contextlib.contextmanager
    def _answering(self) -> Iterator[None]:
        """The client's connection errors, as SharedStoreUnavailable; the outcome told to `health`."""
        ticket = self.health.ticket()
        try:
            yield
        except self._errors as exc:
            self.health.report(ticket, False)
            raise SharedStoreUnavailable(f"the shared store did not answer ({type(exc).__name__})") from exc
        self.health.report(ticket, True)


def _ms(seconds: float) -> int:
    """A TTL in Redis' milliseconds (at least 1: 0 would mean no expiry to some commands, an error to others)."""
    return max(1, int(seconds * 1000))


def _record(key: SessionKey) -> str:
    return f"kvserve:rec:{key.tenant}:{key.kind}:{key.name}"


def _tombstone(key: SessionKey) -> str:
    return f"kvserve:gone:{key.tenant}:{key.kind}:{key.name}"

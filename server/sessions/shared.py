"""Session and stored-response records shared by replicas, in Redis (torch-free).

Each record is a hash `kvserve:rec:<tenant>:<kind>:<name>`: the record's JSON, its revision (`rev`, how many
times it was written), the id of the operation that wrote it (`op`) and the ids of the last few operations that
did (`ops`). A change commits only on top of the operation its writer read (compare-and-set in one Lua script),
so two replicas can never both append turn k, even on equal revisions of histories that diverged: the second is
refused and its turn is not applied. A record expires with its session's TTL, renewed by every write and use. A
delete leaves a tombstone for the TTL, so a replica holding a stale copy learns the session is gone.

Every change names the epoch it was read in (`shared_state.py`): after Redis lost its data, no change of the old
epoch commits, and no copy is ever written back (Redis is the truth; a replica's journal is a cache of it). A
change whose answer never came is resolved before anyone is told anything: `SharedStoreState.resolve`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

from server.sessions.errors import SessionBusy, SharedStoreLost, SharedStoreUnavailable
from server.sessions.record import SessionKey, SessionRecord
from server.sessions.shared_state import ABORTED_TTL_MS, EPOCH_KEY, SharedStoreState, abort_key

log = logging.getLogger("kvserve.sessions")
GONE = "gone"  # load(): the record was deleted (a tombstone), not merely never written
NUM_OPS_KEPT = 8  # operation ids a record remembers: what a late question about one of them is answered from

# KEYS: record, tombstone, epoch, aborted marker of this op. ARGV: epoch, expected op ("" for none), this op,
# rev, record JSON, TTL in ms. "ok" (now, or already: a resend), "epoch", "aborted", or "moved:<rev>".
SAVE = f"""
if redis.call('get', KEYS[3]) ~= ARGV[1] then return 'epoch' end
if redis.call('exists', KEYS[4]) == 1 then return 'aborted' end
local current = redis.call('hget', KEYS[1], 'op') or ''
if current == ARGV[3] then return 'ok' end
if current ~= ARGV[2] then return 'moved:' .. (redis.call('hget', KEYS[1], 'rev') or '0') end
local ops = ARGV[3]
local n = 1
for op in string.gmatch(redis.call('hget', KEYS[1], 'ops') or '', '%S+') do
  if n < {NUM_OPS_KEPT} then ops = ops .. ' ' .. op; n = n + 1 end
end
redis.call('hset', KEYS[1], 'rev', ARGV[4], 'record', ARGV[5], 'op', ARGV[3], 'ops', ops)
redis.call('pexpire', KEYS[1], ARGV[6])
redis.call('del', KEYS[2])
return 'ok'
"""

# KEYS: record, tombstone, epoch, aborted marker. ARGV: epoch, this op, TTL in ms. "ok", "epoch" or "aborted".
DELETE = """
if redis.call('get', KEYS[3]) ~= ARGV[1] then return 'epoch' end
if redis.call('exists', KEYS[4]) == 1 then return 'aborted' end
redis.call('del', KEYS[1])
redis.call('set', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 'ok'
"""

# KEYS: record, tombstone, aborted marker. ARGV: the op, the marker's TTL. "applied" when the record (or the
# tombstone, for a delete) was written by it; else "aborted", with the marker that refuses it should it run late.
RESOLVE = """
local ops = ' ' .. (redis.call('hget', KEYS[1], 'ops') or '') .. ' '
if string.find(ops, ' ' .. ARGV[1] .. ' ', 1, true) then return 'applied' end
if redis.call('get', KEYS[2]) == ARGV[1] then return 'applied' end
redis.call('set', KEYS[3], '1', 'PX', ARGV[2])
return 'aborted'
"""


class SharedRecords:
    def __init__(self, url: str, timeout_s: float = 1.0, state: SharedStoreState | None = None) -> None:
        """`state`: whether the shared store answers and its epoch, as every user of it sees (a new one when not
        given)."""
        import redis  # only with a shared store configured

        self.state = state or SharedStoreState()
        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self.client: Any = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._save = self.client.register_script(SAVE)
        self._delete = self.client.register_script(DELETE)
        self._resolve = self.client.register_script(RESOLVE)

    def load(self, key: SessionKey) -> SessionRecord | str | None:
        """The record as last committed (its `op` beside it), GONE when it was deleted, None when Redis holds
        neither (never written, expired, or lost)."""
        with self._answering():
            pipe = self.client.pipeline(transaction=False)
            pipe.hmget(_record(key), "record", "op")
            pipe.exists(_tombstone(key))
            (data, op), deleted = pipe.execute()
        if data is not None:
            record: SessionRecord = json.loads(data)  # as `save` committed it (Session.from_record checks it)
            record["op"] = op.decode() if op is not None else ""
            return record
        return GONE if deleted else None

    def epoch(self) -> str:
        """The epoch of Redis' data now (set when there is none); raises SharedStoreUnavailable."""
        with self._answering():
            return self.state.epoch(self.client)

    def save(self, key: SessionKey, record: SessionRecord, expected_op: str, change: str = "a change") -> None:
        """Commit `record` (its `op` and `rev`) only if the shared copy is still the one `expected_op` wrote ("":
        none) in the epoch `record["epoch"]` names. Raises SessionBusy when another replica moved it on,
        SharedStoreUnavailable when it was not applied because Redis did not answer (SharedStoreLost: Redis lost
        its data since that epoch), SharedStoreUncertain when that cannot be known."""
        op = record["op"]  # and record["epoch"]: the epoch it was read in, which the script checks
        keys = [_record(key), _tombstone(key), EPOCH_KEY, abort_key(op)]
        data = json.dumps(record, separators=(",", ":"))
        args: list[str | int] = [record["epoch"], expected_op, op, record["rev"], data]
        args.append(_ms(float(record["ttl_s"])))
        answer = self._change(lambda: self._save(keys=keys, args=args), key, op, f"{key.kind} {key.name!r}: {change}")
        if answer.startswith(b"moved:"):
            held = int(answer.removeprefix(b"moved:"))
            what = "already exists" if not expected_op else "was changed by another replica"
            had = record["rev"] - 1
            raise SessionBusy(f"{key.kind} {key.name!r} {what} (at revision {held}; this replica had {had})")

    def touch(self, key: SessionKey, ttl_s: float) -> None:
        """A use without a change: the record lives another TTL. Best effort."""
        try:
            with self._answering():
                self.client.pexpire(_record(key), _ms(ttl_s))
        except SharedStoreUnavailable:
            log.warning("the shared record of %s was not renewed: the shared store did not answer", key.name)

    def delete(self, key: SessionKey, ttl_s: float, op: str) -> None:
        """Delete the record, leaving a tombstone (its value: `op`, what the outcome is asked by)."""
        epoch = self.epoch()
        keys = [_record(key), _tombstone(key), EPOCH_KEY, abort_key(op)]
        args: list[str | int] = [epoch, op, _ms(ttl_s)]
        self._change(lambda: self._delete(keys=keys, args=args), key, op, f"{key.kind} {key.name!r}: a delete")

    def close(self) -> None:
        self.client.close()

    def _change(self, send: Any, key: SessionKey, op: str, what: str) -> bytes:
        """Send a change; one whose answer never came is resolved (`SharedStoreState.resolve`). The answer: b"ok"
        or b"moved:<rev>"; raises SharedStoreUnavailable when it was not applied, SharedStoreUncertain."""
        with self._answering():
            self.client.ping()  # a connection that answers: an error below may have left the change in Redis
        ticket = self.state.ticket()
        try:
            answer: bytes = send()
            self.state.report(ticket, True)
        except self._errors:
            self.state.report(ticket, False)
            keys = [_record(key), _tombstone(key), abort_key(op)]
            ask = lambda: self._resolve(keys=keys, args=[op, ABORTED_TTL_MS])  # noqa: E731
            outcome = self.state.resolve(ask, what, self._errors)
            if outcome != b"applied":
                raise SharedStoreUnavailable(f"{what} was not applied: the shared store did not answer") from None
            return b"ok"
        if answer == b"epoch":
            with contextlib.suppress(*self._errors):
                self.state.read_epoch(self.client)  # take note of the new epoch now: the listeners drop what Redis lost
            raise SharedStoreLost(
                f"{what} was not applied: the shared store lost its data (restarted without persistence, or flushed), "
                f"this {key.kind} with it"
            )
        if answer == b"aborted":  # a resend of a change already resolved as not applied
            raise SharedStoreUnavailable(f"{what} was not applied: the shared store did not answer")
        return answer

    @contextlib.contextmanager
    def _answering(self) -> Iterator[None]:
        """The client's connection errors, as SharedStoreUnavailable; the outcome told to `state`."""
        ticket = self.state.ticket()
        try:
            yield
        except self._errors as exc:
            self.state.report(ticket, False)
            raise SharedStoreUnavailable(f"the shared store did not answer ({type(exc).__name__})") from exc
        self.state.report(ticket, True)


class EvictingStore(RuntimeError):
    """The shared store may evict keys when it is full: a record or tombstone evicted would be a session lost or
    a deleted one back, with nothing to tell it from one that expired."""


def refuse_evicting_store(records: SharedRecords) -> None:
    """At start: refuse a Redis whose policy can evict records (`maxmemory` set and a policy other than
    noeviction). One that does not let its configuration be read (a managed service) is warned about."""
    try:
        policy = records.client.config_get("maxmemory-policy").get("maxmemory-policy", b"")
        limit = records.client.config_get("maxmemory").get("maxmemory", b"0")
    except records._errors as exc:
        log.warning(
            "the shared store's eviction policy could not be read (%s): it must be noeviction, or have no maxmemory, "
            "or sessions may be lost (docs/deploy.md)",
            type(exc).__name__,
        )
        return
    policy = policy.decode() if isinstance(policy, bytes) else str(policy)
    limit = limit.decode() if isinstance(limit, bytes) else str(limit)
    if policy != "noeviction" and limit not in ("0", ""):
        raise EvictingStore(
            f"the Redis it names has maxmemory {limit} with maxmemory-policy {policy}: it could "
            "evict session records and tombstones (lost or deleted sessions served again). Give it "
            "maxmemory-policy noeviction (and persistence), or no maxmemory; put K/V blocks, which may be evicted, "
            "in another Redis with KVSERVE_SHARED_BLOCKS_URL (docs/deploy.md)"
        )


def _ms(seconds: float) -> int:
    """A TTL in Redis' milliseconds (at least 1: 0 would mean no expiry to some commands, an error to others)."""
    return max(1, int(seconds * 1000))


def _record(key: SessionKey) -> str:
    return f"kvserve:rec:{key.tenant}:{key.kind}:{key.name}"


def _tombstone(key: SessionKey) -> str:
    return f"kvserve:gone:{key.tenant}:{key.kind}:{key.name}"

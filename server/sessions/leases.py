"""Whose turn it is on a session, across replicas: a lease per session in the shared store.

One process needs no lease: the store's own busy flag already keeps a session to one request
(`LocalLeases`). With replicas behind a load balancer the same session can reach two of them at
once; `RedisLeases` then holds `kvserve:lease:<tenant>:<kind>:<name>` in Redis, set only if absent,
with a random token and an expiry. A holder renews its leases while it works (a thread, every third
of the lease), gives a lease back only if it still holds it (compare-and-delete), and a replica that
dies holding one loses it when it expires. Redis is imported only when a shared URL is configured.
"""

from __future__ import annotations

import logging
import secrets
import threading
from typing import Any, Protocol

from server.sessions.errors import SessionBusy, SharedStoreUnavailable, SharedStoreUncertain
from server.sessions.record import SessionKey
from server.sessions.shared_state import ABORTED_TTL_MS, EPOCH_KEY, SharedStoreState, abort_key

log = logging.getLogger("kvserve.leases")
# Delete or extend the key only while it still holds our token: a lease that expired and was taken by
# another replica is never touched.
GIVE_BACK = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
# KEYS: lease, aborted marker of this token. ARGV: token, lease in ms. 1 when the lease is ours (now, or by this
# very take resent), 0 when another holder has it or this take was resolved as not taken.
TAKE = """
if redis.call('exists', KEYS[2]) == 1 then return 0 end
if redis.call('get', KEYS[1]) == ARGV[1] then return 1 end
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""
# KEYS: lease, aborted marker. ARGV: token, the marker's TTL. Whether a take whose answer never came holds the lease.
RESOLVE_TAKE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return 'applied' end
redis.call('set', KEYS[2], '1', 'PX', ARGV[2])
return 'aborted'
"""


class Leases(Protocol):
    def take(self, key: SessionKey) -> str | None:
        """A token when the lease is ours now; None when another holder has it. Raises SharedStoreUnavailable."""
        ...

    def give_back(self, key: SessionKey, token: str) -> None: ...

    def close(self) -> None: ...

    @property
    def is_up(self) -> bool | None:
        """Whether the shared store answered its last call (None: there is none)."""
        ...


class LeaseBook:
    """The leases this process holds, by session: taken when a turn starts, given back when it ends."""

    def __init__(self, leases: Leases) -> None:
        self.leases = leases
        self._tokens: dict[SessionKey, str] = {}
        self._lock = threading.Lock()

    @property
    def is_up(self) -> bool | None:
        return self.leases.is_up

    def take(self, key: SessionKey) -> None:
        """Raises SessionBusy when another replica holds it, SharedStoreUnavailable when the store is down."""
        token = self.leases.take(key)
        if token is None:
            raise SessionBusy(f"session {key.name!r} has a request in flight on another replica")
        with self._lock:
            self._tokens[key] = token

    def give_back(self, key: SessionKey) -> None:
        with self._lock:
            token = self._tokens.pop(key, None)
        if token is not None:
            self.leases.give_back(key, token)

    def close(self) -> None:
        self.leases.close()


class LocalLeases:
    """One process: the session store's busy flag is the whole lock."""

    def take(self, key: SessionKey) -> str | None:
        return ""

    def give_back(self, key: SessionKey, token: str) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def is_up(self) -> bool | None:
        return None


class RedisLeases:
    def __init__(self, url: str, lease_s: float, timeout_s: float = 1.0, state: SharedStoreState | None = None) -> None:
        """`state`: whether the shared store answers and its epoch, as every user of it sees (a new one when not
        given); the renewer reads the epoch on each round, so a Redis that lost its data is noticed soon."""
        import redis  # only with a shared store configured

        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self.client: Any = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.lease_ms = int(lease_s * 1000)
        self._give_back, self._renew = self.client.register_script(GIVE_BACK), self.client.register_script(RENEW)
        self._take, self._resolve = self.client.register_script(TAKE), self.client.register_script(RESOLVE_TAKE)
        self._held: dict[str, str] = {}  # redis key -> our token
        self._lock = threading.Lock()
        self.state = state or SharedStoreState()
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, name="kvserve-leases", daemon=True)
        self._renewer.start()

    def take(self, key: SessionKey) -> str | None:
        """Our token when the lease is ours now, None when another holder has it. Raises SharedStoreUnavailable (not
        taken). A take whose answer never came is resolved first: taken, or fenced off so that it never is."""
        name, token = _name(key), secrets.token_hex(16)
        ticket = self.state.ticket()
        try:
            self.client.ping()  # a connection that answers: an error below may have left the take in Redis
        except self._errors as exc:
            self.state.report(ticket, False)
            raise SharedStoreUnavailable(f"the shared store did not answer ({type(exc).__name__})") from exc
        ticket = self.state.ticket()
        try:
            taken = bool(self._take(keys=[name, abort_key(token)], args=[token, self.lease_ms]))
            self.state.report(ticket, True)
        except self._errors:
            self.state.report(ticket, False)
            keys = [name, abort_key(token)]
            what = f"the lease of {key.kind} {key.name!r}"
            try:
                answer = self.state.resolve(
                    lambda: self._resolve(keys=keys, args=[token, ABORTED_TTL_MS]), what, self._errors
                )
            except SharedStoreUncertain:  # a take that may still run: the turn does not; such a lease expires
                raise SharedStoreUnavailable(
                    f"{what} was not taken: the shared store did not answer (if it takes it late, the session is busy "
                    "on other replicas until the lease expires)"
                ) from None
            if answer != b"applied":
                raise SharedStoreUnavailable(f"{what} was not taken: the shared store did not answer") from None
            taken = True
        if not taken:
            return None
        with self._lock:
            self._held[name] = token
        return token

    def give_back(self, key: SessionKey, token: str) -> None:
        """Compare-and-delete: idempotent, and a late one never touches a lease taken since (another token)."""
        name = _name(key)
        with self._lock:
            self._held.pop(name, None)
        try:
            self._give_back(keys=[name], args=[token])
        except self._errors:  # it expires on its own
            log.warning("lease of %s not given back: the shared store did not answer", key.name)

    def close(self) -> None:
        self._stop.set()
        self._renewer.join(5)
        self.client.close()

    @property
    def is_up(self) -> bool | None:
        return self.state.is_up

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_ms / 3000):
            try:
                self.renew_once()
            except Exception:  # never let the renewer die: leases held would expire mid-turn
                log.exception("renewing leases failed")

    def renew_once(self) -> None:
        """Extend every lease held (or ping, holding none), read the store's epoch, and record whether it
        answered."""
        with self._lock:
            held = list(self._held.items())
        ticket = self.state.ticket()
        try:
            for name, token in held:
                if not self._renew(keys=[name], args=[token, self.lease_ms]):
                    log.warning("lease %s was lost (expired before it was renewed)", name)
            if not held:
                self.client.ping()
            found = self.client.get(EPOCH_KEY)
            if found is None:
                self.state.read_epoch(self.client)  # lost with the rest: a new one, and the listeners run
            else:
                self.state.seen(found.decode())
        except self._errors:
            if self.state.report(ticket, False):
                log.warning("the shared store does not answer: session turns are refused until it does")
        else:
            if self.state.report(ticket, True) is False:
                log.info("the shared store answers again")


def _name(key: SessionKey) -> str:
    return f"kvserve:lease:{key.tenant}:{key.kind}:{key.name}"

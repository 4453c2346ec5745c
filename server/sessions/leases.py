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

from server.sessions.errors import SessionBusy, SharedStoreUnavailable
from server.sessions.health import SharedStoreHealth
from server.sessions.record import SessionKey

log = logging.getLogger("kvserve.leases")
# Delete or extend the key only while it still holds our token: a lease that expired and was taken by
# another replica is never touched.
GIVE_BACK = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"


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
    def __init__(
        self, url: str, lease_s: float, timeout_s: float = 1.0, health: SharedStoreHealth | None = None
    ) -> None:
        """`health`: whether the shared store answers, as every user of it sees (a new one when not given)."""
        import redis  # only with a shared store configured

        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self.client: Any = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.lease_ms = int(lease_s * 1000)
        self._give_back, self._renew = self.client.register_script(GIVE_BACK), self.client.register_script(RENEW)
        self._held: dict[str, str] = {}  # redis key -> our token
        self._lock = threading.Lock()
        self.health = health or SharedStoreHealth()  # the renewer pings when it has nothing to renew
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, name="kvserve-leases", daemon=True)
        self._renewer.start()

    def take(self, key: SessionKey) -> str | None:
        name, token = _name(key), secrets.token_hex(16)
        ticket = self.health.ticket()
        try:
            taken = self.client.set(name, token, nx=True, px=self.lease_ms)
        except self._errors as exc:
            self.health.report(ticket, False)
            raise SharedStoreUnavailable(f"the shared store did not answer ({type(exc).__name__})") from exc
        self.health.report(ticket, True)
        if not taken:
            return None
        with self._lock:
            self._held[name] = token
        return token

    def give_back(self, key: SessionKey, token: str) -> None:
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
        return self.health.is_up

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_ms / 3000):
            self.renew_once()

    def renew_once(self) -> None:
        """Extend every lease held (or ping, holding none), and record whether the store answered."""
        with self._lock:
            held = list(self._held.items())
        ticket = self.health.ticket()
        try:
            for name, token in held:
                if not self._renew(keys=[name], args=[token, self.lease_ms]):
                    log.warning("lease %s was lost (expired before it was renewed)", name)
            if not held:
                self.client.ping()
        except self._errors:
            if self.health.report(ticket, False):
                log.warning("the shared store does not answer: session turns are refused until it does")
        else:
            if self.health.report(ticket, True) is False:
                log.info("the shared store answers again")


def _name(key: SessionKey) -> str:
    return f"kvserve:lease:{key.tenant}:{key.kind}:{key.name}"

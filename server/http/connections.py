"""Connections no client can use to freeze the server: bounded in number and in the time to send a request.

A client that opens sockets and sends half a request header holds a file descriptor each. So:
the descriptor limit is raised to its hard limit at start; the number of open connections is kept
below it (when one more arrives, the oldest connection still waiting for its request is closed to
make room); a request whose header does not arrive whole within `header_timeout_s` is closed (the
body has its own limit, in the gate); and "out of file descriptors" accept errors, should they
happen anyway, are logged once per interval with a count, not once per try.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kvserve.connections")
RESERVED_DESCRIPTORS = 128  # model files, state files, pipes, threads: what the process needs besides sockets
ACCEPT_ERROR_INTERVAL_S = 10.0
MAX_CONNECTIONS_UNLIMITED = 65_536  # with no limit on open files: still a bound
# In a request's scope["state"]: the status uvicorn itself sent for it, past the application (the gate logs that).
SENT_BY_SERVER = "kvserve.sent_by_server"


def raise_descriptor_limit() -> int:
    """Raise the soft limit of open files to the hard one and say so; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        log.info("open files limit raised from %d to %d (the hard limit)", soft, hard)
        soft = hard
    else:
        log.info("open files limit: %d (the hard limit)", soft)
    return soft


def default_max_connections(descriptor_limit: int) -> int:
    if descriptor_limit == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_UNLIMITED
    return max(16, descriptor_limit - max(RESERVED_DESCRIPTORS, descriptor_limit // 10))


class ConnectionGuard:
    """The open connections, oldest first; shared by every connection of one server."""

    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self._open: OrderedDict[GuardedH11Protocol, None] = OrderedDict()
        self.num_evicted = 0

    def opened(self, connection: GuardedH11Protocol) -> None:
        self._open[connection] = None
        if len(self._open) <= self.max_connections:
            return
        waiting = next((c for c in self._open if c.is_reading_header), None)
        victim = waiting if waiting is not None else connection  # all busy with requests: the newcomer goes
        self.num_evicted += 1
        victim.close("the server is at its connection limit")

    def closed(self, connection: GuardedH11Protocol) -> None:
        self._open.pop(connection, None)

    def protocol(self) -> type[GuardedH11Protocol]:
        """The uvicorn HTTP protocol class to serve with (`uvicorn.Config(http=...)`)."""
        guard = self

        class Guarded(GuardedH11Protocol):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(guard, *args, **kwargs)

        return Guarded


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on each request header and a place in the guard's count."""

    def __init__(self, guard: ConnectionGuard, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._guard = guard
        self._deadline: asyncio.TimerHandle | None = None
        inner = self.app

        async def app(scope: Any, receive: Any, send: Any) -> None:
            self._disarm()  # the header arrived whole: the request is the application's now
            await inner(scope, receive, send)

        self.app = app

    @property
    def is_reading_header(self) -> bool:
        return self._deadline is not None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        self._guard.opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._guard.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._arm()  # the first bytes of a new request on a kept-alive connection
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """uvicorn answers a request it cannot read (a malformed chunked body, say) itself and closes. When that
        request has reached the application already (its header was whole; the gate was reading its body), the
        gate must log and count that 400, not a 500 for an answer that never came from it."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and not cycle.response_complete:
            cycle.scope.setdefault("state", {})[SENT_BY_SERVER] = 400
        super().send_400_response(msg)

    def close(self, reason: str) -> None:
        log.debug("closing connection from %s: %s", self.client, reason)
        self._disarm()
        self.transport.close()

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self._guard.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        self.close(f"no whole request header within {self._guard.header_timeout_s:g} s")


def throttle_accept_errors(loop: asyncio.AbstractEventLoop, interval_s: float = ACCEPT_ERROR_INTERVAL_S) -> None:
    """asyncio logs every failed accept(); out of descriptors, that is millions of lines: log one per interval."""
    previous = loop.get_exception_handler()
    state = {"last": 0.0, "suppressed": 0}

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - state["last"] < interval_s:
            state["suppressed"] += 1
            return
        log.error(
            "cannot accept connections: %s (%d more such errors in the last %g s)",
            context.get("exception"),
            state["suppressed"],
            interval_s,
        )
        state["last"], state["suppressed"] = now, 0

    loop.set_exception_handler(handler)

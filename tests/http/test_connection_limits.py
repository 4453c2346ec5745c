"""The connection guard at its exact boundaries, on real sockets: uvicorn in this process with kvserve's guarded
HTTP protocol and a plain ASGI app (no model), so only this test's sockets are open and every step is an event:
an answer, or the server closing a connection."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from server.http.connections import ConnectionGuard
from tests.helpers import DEADLINE_S, wait_until

REQUEST = b"GET /ping HTTP/1.1\r\nHost: guard\r\n\r\n"
PARTIAL_HEADER = b"GET /ping HTTP/1.1\r\nHost: guard\r\nX-Slow: "  # never finished


async def ping(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
    await send({"type": "http.response.body", "body": b"pong"})


@contextlib.contextmanager
def guarded_server(max_connections: int, header_timeout_s: float) -> Iterator[tuple[int, ConnectionGuard]]:
    guard = ConnectionGuard(max_connections, header_timeout_s)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # uvicorn's own keep-alive timeout far away: a connection closed here was closed by the guard.
    config = uvicorn.Config(
        ping,
        host="127.0.0.1",
        port=port,
        http=guard.protocol(),
        lifespan="off",
        log_level="warning",
        timeout_keep_alive=600,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, DEADLINE_S, "the server to start")
    try:
        yield port, guard
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)


def answer(sock: socket.socket) -> bytes:
    """The status line of the next response on `sock`, or b"" when the server closed it instead."""
    data = b""
    while not (b"\r\n\r\n" in data and data.endswith(b"pong")):
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return b""
        if not chunk:
            return b""
        data += chunk
    return data.split(b"\r\n", 1)[0]


def is_closed_by_peer(sock: socket.socket) -> bool:
    """Waits (up to the generous deadline) for the server to close `sock`; False if it sends data or stays open."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)


def test_exactly_max_connections_are_kept_and_one_more_is_refused():
    limit = 6
    with guarded_server(limit, header_timeout_s=600) as (port, guard), contextlib.ExitStack() as stack:
        held = []
        for _ in range(limit):  # one at a time, each answered: kept alive, and between requests
            sock = stack.enter_context(connect(port))
            sock.sendall(REQUEST)
            assert answer(sock) == b"HTTP/1.1 200 OK", f"connection {len(held) + 1} of {limit} was refused"
            held.append(sock)
        assert guard.num_evicted == 0
        extra = stack.enter_context(connect(port))  # one over: no connection waits for a header, so it goes
        assert is_closed_by_peer(extra), f"connection {limit + 1} of {limit} was kept"
        assert guard.num_evicted == 1
        for sock in held:  # the ones within the limit were left alone
            sock.sendall(REQUEST)
            assert answer(sock) == b"HTTP/1.1 200 OK"


def test_the_next_request_on_a_kept_alive_connection_has_a_header_deadline_too():
    with guarded_server(16, header_timeout_s=1) as (port, guard), connect(port) as sock:
        sock.sendall(REQUEST)
        assert answer(sock) == b"HTTP/1.1 200 OK"  # the first request, whole: kept alive
        sock.sendall(PARTIAL_HEADER)  # the second one's header never ends
        assert is_closed_by_peer(sock), "a header that never ends must not hold a kept-alive connection"
        assert guard.num_evicted == 0  # closed by the header deadline, not to make room

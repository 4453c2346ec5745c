"""A TCP proxy in front of a real redis-server that can hold back what clients send: a command held here is one
"sent, not answered" (the client times out and closes its connection, the bytes are still on their way), which the
test then lets reach Redis when it chooses, before or after the replica's question about its outcome. It makes
the order of the two, which a paused Redis leaves to chance, the test's to set."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

from tests.helpers import DEADLINE_S


class HoldingProxy:
    def __init__(self, redis_port: int) -> None:
        self.redis_port = redis_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._lock = threading.Lock()
        self._rules: list[tuple[bytes, list[tuple[socket.socket, bytes]], threading.Event]] = []
        self._closing: set[socket.socket] = set()  # upstreams whose client went away while their bytes were held
        self._sockets: list[socket.socket] = []
        self._is_closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self, marker: bytes) -> tuple[list[tuple[socket.socket, bytes]], threading.Event]:
        """From now on, client bytes holding `marker` are kept here (with all that follows on their connection)
        until `release`; the event is set when the first such bytes arrive."""
        held: list[tuple[socket.socket, bytes]] = []
        arrived = threading.Event()
        with self._lock:
            self._rules.append((marker, held, arrived))
        return held, arrived

    def release(self, marker: bytes) -> int:
        """Let the bytes held for `marker` reach Redis (then the close of a connection whose client left); stop
        holding. Returns how many pieces went."""
        with self._lock:
            rule = next(r for r in self._rules if r[0] == marker)
            self._rules.remove(rule)
            pieces = list(rule[1])
        for upstream, data in pieces:
            with contextlib.suppress(OSError):
                upstream.sendall(data)
                if upstream in self._closing:
                    upstream.shutdown(socket.SHUT_WR)  # as a paused Redis would find it: the bytes, then the close
        return len(pieces)

    def close(self) -> None:
        self._is_closed = True
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._is_closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.redis_port), timeout=DEADLINE_S)
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, self._held_for(upstream)), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True).start()

    def _held_for(self, upstream: socket.socket) -> Callable[[bytes], bool]:
        """Whether bytes a client sends now are kept back: they hold a marker, or their connection has bytes
        held already (what follows a held command must not overtake it)."""

        def check(data: bytes) -> bool:
            with self._lock:
                for marker, held, arrived in self._rules:
                    if marker in data or any(up is upstream for up, _ in held):
                        held.append((upstream, data))
                        arrived.set()
                        return True
            return False

        return check

    def _pump(self, source: socket.socket, dest: socket.socket, held: Callable[[bytes], bool] | None) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if not data:
                with self._lock:
                    is_held = held is not None and any(up is dest for _, pieces, _ in self._rules for up, _ in pieces)
                    if is_held:
                        self._closing.add(dest)
                if not is_held:
                    with contextlib.suppress(OSError):
                        dest.shutdown(socket.SHUT_WR)
                return
            if held is not None and held(data):
                continue
            try:
                dest.sendall(data)
            except OSError:
                return

"""How `kvserve serve` stops: SIGTERM and SIGINT in every phase (start-up asked to stop at its next safe point, a
drain once it serves), and an exit that cannot wait for a thread still computing inside torch."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import types
import typing
from pathlib import Path

from server.startup import Startup


class StopSignals:
    """SIGTERM and SIGINT, from the settings' check on (uvicorn takes them over while it serves): each asks
    start-up to stop (server/startup.py) and is remembered. None ends the process by the default action half-way
    through, and none is lost: one that comes just before uvicorn takes over is handed to it."""

    def __init__(self, startup: Startup) -> None:
        self.startup = startup
        self.received: list[int] = []
        self._before: dict[int, typing.Any] = {}

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._before[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def _handle(self, sig: int, frame: types.FrameType | None) -> None:
        self.received.append(sig)
        self.startup.stop()


def exit_now(code: int) -> typing.NoReturn:
    """Exit while a thread still computes: without the interpreter's finalization, which would end that thread
    inside torch by pthread_exit and abort the process (exit 134). What this process started (a kernel build's
    ninja and compilers, inductor's workers) is asked to stop first; what a stopped phase leaves (a conversion's
    partial directory, a build's lock file) the next start removes."""
    for pid in children():
        with contextlib.suppress(OSError):  # ended meanwhile
            os.kill(pid, signal.SIGTERM)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def children() -> list[int]:
    """The processes whose parent is this one (Linux: /proc; none found elsewhere)."""
    me, found = os.getpid(), []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == me:  # the name, in parentheses, may hold spaces
                found.append(int(entry.name))
    return found


def draining_server():
    import uvicorn

    class Server(uvicorn.Server):
        """First SIGTERM/SIGINT: drain (503 to new requests, running ones finish within the grace period; models
        still loading stop at their next safe point), then stop; the app's shutdown writes the sessions' K/V.
        A second signal stops at once, without waiting for running requests; the app's shutdown still runs.
        The signal handlers only set flags (they run between two bytecodes of the main thread, which may hold
        any lock then): the drain is watched from the event loop's ticks."""

        def __init__(self, config, app, grace_s: float, signals: StopSignals) -> None:
            super().__init__(config)
            self._app, self._grace_s, self._signals = app, grace_s, signals
            self._drain_until: float | None = None  # time.monotonic() when the drain ends the requests left
            self.failures: dict[str, str] = {}  # when every model failed to load: each one's reason

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                if self._signals.received:  # came after main's last look, before uvicorn's handlers: not lost
                    self.handle_exit(self._signals.received[-1], None)
                yield

        async def on_tick(self, counter: int) -> bool:
            """Also stop (the app's shutdown runs as after a signal) once every model has failed to load: a server
            with nothing to serve would answer /ready 503 and /health 200 for ever, and never be restarted. And
            once a drain is over: no request left, or the grace period gone."""
            host = getattr(self._app.state, "host", None)
            if host is not None and host.has_failed and not self.should_exit:
                self.failures = host.failures
                logging.getLogger("kvserve").error("no model could be loaded: stopping")
                self.should_exit = True
            if host is not None and self._drain_until is not None and not self.should_exit:
                if host.num_active and time.monotonic() >= self._drain_until:
                    logging.getLogger("kvserve").warning("grace period over: ending %d requests", host.num_active)
                self.should_exit = not host.num_active or time.monotonic() >= self._drain_until
            return await super().on_tick(counter)

        def handle_exit(self, sig, frame) -> None:
            self._signals.startup.stop()  # models still loading stop loading
            host = getattr(self._app.state, "host", None)
            if host is not None and self._drain_until is None:
                self._drain_until = time.monotonic() + self._grace_s
                host.begin_drain()
                return
            # Before the app's state exists, or a second signal. Never uvicorn's own handling, whose force_exit
            # (a second Ctrl-C) skips the app's shutdown: the engines' threads would run on, inside torch, into
            # the interpreter's exit, and no K/V would be saved.
            self.should_exit = True

    return Server

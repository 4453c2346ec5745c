"""Start-up's phases, and stopping it at a safe point when the process is asked to stop.

`kvserve serve` builds its app in the main thread ("app"), then loads each model on a thread of its own
(server/hosting.py): converting a GGUF file ("convert"), loading the weights and measuring the dtype ("load"),
building or checking the attention kernels ("kernels"), torch.compile ("compile") and CUDA graph capture
("capture"). A signal can arrive in any of them: a supervisor stops pods that are still starting.

The loading thread must not be inside torch when the interpreter exits: Python (before 3.14) ends a daemon
thread that wakes during finalization with pthread_exit, whose forced unwinding through torch's C++ frames
(pybind11's GIL release) calls std::terminate: "terminate called without an active exception", exit 134.
So a stop is cooperative: `stop()` asks, and the next safe point (`enter`, `check`) raises `StartupStopped`,
which unwinds the thread through each phase's own cleanup (a conversion's partial directory removed, its
lock released); the host waits for that, bounded (server/hosting.py, server/__main__.py).

`stop()` is called from signal handlers, which run on the main thread between two of its bytecodes: it sets a
flag and takes no lock (one the main thread held when the signal came would never be released), and every wait
for it polls.

Test hook: KVSERVE_TEST_HOLD_PHASE=<phase> makes start-up log "test hook: start-up held in phase <phase>" when
it enters that phase and wait there, its thread inside torch as a phase's work is, until it is asked to stop;
<phase>:stuck never lets go (a phase that outlasts the grace period). Tests send their signal on the log
line, exactly while the phase runs; nothing else sets it.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("kvserve")
PHASES = ("app", "convert", "load", "kernels", "compile", "capture")
HOLD_ENV = "KVSERVE_TEST_HOLD_PHASE"


class StartupStopped(BaseException):
    """Raised at a safe point once a stop was asked: a request, like KeyboardInterrupt, so a BaseException. The
    phases' `except Exception` turn a failure into a fallback (eager instead of compiled, SDPA instead of a kernel)
    and must not take it for one."""


class Startup:
    def __init__(self, hold: str | None = None) -> None:
        """`hold`: the test hook's value (see the module's docstring); None: no hold."""
        phase, _, mode = (hold or "").partition(":")
        if hold is not None and (phase not in PHASES or mode not in ("", "stuck") or (phase, mode) == ("app", "stuck")):
            raise ValueError(f"{HOLD_ENV}: {hold!r} is not one of {', '.join(PHASES)}, optionally with :stuck")
        self.hold = phase or None
        self.is_stuck = mode == "stuck"
        self.phase = "app"  # the phase running now (the last one entered)
        self._is_stopping = False
        self.stop_time: float | None = None  # time.monotonic() of the first stop request

    @classmethod
    def from_environment(cls) -> Startup:
        return cls(os.environ.get(HOLD_ENV))

    @property
    def is_stopping(self) -> bool:
        return self._is_stopping

    def stop(self) -> None:
        """Ask start-up to stop at its next safe point (any thread, a signal handler too)."""
        if self.stop_time is None:
            self.stop_time = time.monotonic()
        self._is_stopping = True

    def check(self) -> None:
        """A safe point: raises StartupStopped once a stop was asked."""
        if self._is_stopping:
            raise StartupStopped(self.phase)

    def enter(self, phase: str) -> None:
        """`phase` begins (a safe point before and after the test hook's hold)."""
        assert phase in PHASES, phase
        self.check()
        self.phase = phase
        if phase == self.hold:
            self._hold(phase)
        self.check()

    def _hold(self, phase: str) -> None:
        log.warning("test hook: start-up held in phase %s (%s)", phase, HOLD_ENV)
        if phase == "app":  # the main thread, where the signal handlers run
            while not self._is_stopping:
                time.sleep(0.01)
            return
        import torch

        work = torch.ones(256, 256)
        while self.is_stuck or not self._is_stopping:  # each call releases and retakes the GIL, as real work does
            work = torch.tanh(work)

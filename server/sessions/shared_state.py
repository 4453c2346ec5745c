"""What this replica knows of the shared store (Redis): whether it answers, and which epoch of its data it holds
(torch-free). /ready, the `kvserve:shared_store_up` gauge and every user of the store read it.

**Answers.** Calls run on several threads (requests reading and committing records, taking leases; the lease
renewer), and one can be preempted between its answer and writing it down: a ping that succeeded just before
Redis stopped must not overwrite the failure a later call saw. Each call takes a ticket before it asks; an
outcome counts only when no call begun after it has reported already.

**Epochs.** Redis holds `kvserve:epoch`, a random id the first replica sets. A restart without persistence or a
FLUSHALL loses it with everything else, and the next replica to look sets a new one. Every change a replica
commits names the epoch it read (the scripts refuse another), and the lease renewer reads it on each round, so
data loss is noticed within a third of a lease: then the listeners run (the replica drops the copies of records
and the memory of blocks Redis no longer holds), and nothing of the old epoch is ever written back.

**Uncertain outcomes.** A command that was sent but not answered (a socket timeout: Redis paused, a network
partition) may still run later, since Redis executes what it has read. Every change carries an operation id;
`resolve` asks Redis, over a new connection, whether that operation applied, and if it did not, leaves a marker
that makes the late command refuse itself. Redis runs both in one order or the other, so the answer holds.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from server.sessions.errors import SharedStoreUncertain

log = logging.getLogger("kvserve.sessions")
EPOCH_KEY = "kvserve:epoch"
ABORTED_TTL_MS = 24 * 3600 * 1000  # a late command is refused for this long after its operation was resolved


def abort_key(op: str) -> str:
    return f"kvserve:aborted:{op}"


def new_op() -> str:
    """An operation id: what a change is known by when its outcome must be asked for again."""
    return secrets.token_hex(16)


class SharedStoreState:
    def __init__(self, resolve_s: float = 10.0) -> None:
        """`resolve_s`: how long an uncertain outcome is asked after before the client is told it is unknown."""
        self.resolve_s = resolve_s
        self._lock = threading.Lock()
        self._num_tickets = 0
        self._reported = 0  # the ticket of the outcome held now
        self._up = True
        self._epoch: str | None = None
        self._listeners: list[Callable[[], object]] = []

    # -- answers ----------------------------------------------------------------------
    @property
    def is_up(self) -> bool:
        return self._up

    def ticket(self) -> int:
        with self._lock:
            self._num_tickets += 1
            return self._num_tickets

    def report(self, ticket: int, is_up: bool) -> bool | None:
        """Record a call's outcome; returns the state it replaced when it changed it (for logging), else None."""
        with self._lock:
            if ticket < self._reported:
                return None  # a later call's outcome is newer news
            self._reported, was_up = ticket, self._up
            self._up = is_up
            return was_up if was_up != is_up else None

    # -- epochs -----------------------------------------------------------------------
    def on_epoch_change(self, listener: Callable[[], object]) -> None:
        """`listener()` runs (on the thread that noticed) each time Redis is found to have lost its data."""
        self._listeners.append(listener)

    def epoch(self, client: Any) -> str:
        """The epoch Redis holds now (set if it has none: the first replica, or the first after a loss)."""
        if self._epoch is not None:
            return self._epoch
        return self.read_epoch(client)

    def read_epoch(self, client: Any) -> str:
        """Ask Redis for its epoch (setting one if it has none) and take note; raises the client's errors."""
        client.set(EPOCH_KEY, secrets.token_hex(16), nx=True)
        found = client.get(EPOCH_KEY)
        epoch = found.decode() if isinstance(found, bytes) else str(found)
        self.seen(epoch)
        return epoch

    def seen(self, epoch: str) -> None:
        """Take note of the epoch Redis holds; a change runs the listeners on a thread of their own (the one that
        noticed may hold locks they take)."""
        with self._lock:
            was, self._epoch = self._epoch, epoch
        if was is not None and was != epoch:
            threading.Thread(target=self._tell, args=(was, epoch), name="kvserve-epoch", daemon=True).start()

    def _tell(self, was: str, epoch: str) -> None:
        for listener in self._listeners:
            try:
                listener()
            except Exception:
                log.exception("a listener of the shared store's epoch failed")
        log.warning(
            "the shared store lost its data (epoch %s, now %s: restarted without persistence, or flushed); this "
            "replica dropped its copies of what it held",
            was,
            epoch,
        )

    def held_epoch(self) -> str | None:
        return self._epoch

    # -- uncertain outcomes -----------------------------------------------------------------
    def resolve(self, ask: Callable[[], Any], what: str, errors: tuple[type[Exception], ...]) -> Any:
        """`ask()` (a script that answers whether an operation applied, fencing it off if not) until Redis
        answers or `resolve_s` passes; raises SharedStoreUncertain then."""
        deadline = time.monotonic() + self.resolve_s
        pause = 0.05
        log.warning("%s: the shared store did not answer; asking whether it applied", what)
        while True:
            ticket = self.ticket()
            try:
                answer = ask()
            except errors:
                self.report(ticket, False)
                if time.monotonic() + pause > deadline:
                    raise SharedStoreUncertain(
                        f"{what}: the shared store stopped answering after it was sent, so it may or may not have "
                        "been applied; read the session before sending it again"
                    ) from None
                time.sleep(pause)
                pause = min(2 * pause, 1.0)
                continue
            self.report(ticket, True)
            log.warning("%s: resolved (%s)", what, answer)
            return answer

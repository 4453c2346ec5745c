"""Whether the shared store (Redis) answers, as the replica's every use of it says (torch-free): /ready and the
`kvserve:shared_store_up` gauge read it."""

from __future__ import annotations

import threading


class SharedStoreHealth:
    """Whether the shared store answers: the outcome of the call that *began* last, whoever made it.

    Calls run on several threads (requests reading and committing records, taking leases; the lease
    renewer), and one can be preempted between its answer and writing it down: a ping that succeeded
    just before Redis stopped must not overwrite the failure a later call saw. Each call takes a ticket
    before it asks; an outcome counts only when no call begun after it has reported already.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._num_tickets = 0
        self._reported = 0  # the ticket of the outcome held now
        self._up = True

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

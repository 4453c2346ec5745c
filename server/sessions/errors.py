"""What the session store refuses; `code` follows the design's error table."""

from __future__ import annotations

from server.errors import Refused


class SessionError(Refused):
    code = "session_error"


class SessionBusy(SessionError):
    code = "session_busy"

    def __init__(self, message: str, since: float | None = None) -> None:
        """`since`: when (unix time) the request holding it started, where this process knows it."""
        super().__init__(message)
        self.since = since


class SessionModelMismatch(SessionError):
    code = "session_model_mismatch"


class SessionModeMismatch(SessionError):
    code = "session_mode_mismatch"


class SessionNotFound(SessionError):
    code = "session_not_found"


class InvalidTurn(SessionError):
    code = "invalid_parameter"


class QuotaExceeded(SessionError):
    """A new session would take its tenant past `max_sessions_per_tenant` (checked under the store's lock)."""

    code = "quota_exceeded"


class StateUnavailable(SessionError):
    """The journal could not record a change: it was not applied either (memory and disk never disagree)."""

    code = "state_unavailable"


class SharedStoreUnavailable(SessionError):
    """The shared store (Redis) did not answer: what needs it is refused, never done without it."""

    code = "shared_store_unavailable"


class SharedStoreLost(SharedStoreUnavailable):
    """The shared store lost its data (restarted without persistence, or flushed) since the record a change was made
    on was read: the change was not applied, and the record is gone with the rest. Never "as before"."""


class SharedStoreUncertain(SessionError):
    """A change was sent to the shared store, which stopped answering before it said whether it applied, and did not
    answer the question either within the resolve deadline: it may have applied, or may still apply until Redis
    answers the question (which then fences it off). The client is told exactly that, never "as before"."""

    code = "shared_store_uncertain"

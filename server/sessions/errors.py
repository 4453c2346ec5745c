"""What the session store refuses; `code` follows the design's error table."""

from __future__ import annotations


class SessionError(Exception):
    code = "session_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SessionBusy(SessionError):
    code = "session_busy"


class SessionModelMismatch(SessionError):
    code = "session_model_mismatch"


class SessionNotFound(SessionError):
    code = "session_not_found"


class InvalidTurn(SessionError):
    code = "invalid_parameter"

"""Errors in the OpenAI envelope: {"error": {"message", "type", "param", "code"}}, message bounded."""

from __future__ import annotations

from typing import Any

MAX_MESSAGE_CHARS = 512
MAX_PARAM_CHARS = 128
RETRY_AFTER_S = 1
RETRIED = ("server_overloaded", "session_busy")  # refusals worth retrying soon: they say when (Retry-After)

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}

# The codes the engine and the session store answer with -> HTTP status.
CODE_STATUS = {
    "session_busy": 409,
    "session_mode_mismatch": 409,
    "session_model_mismatch": 400,
    "context_length_exceeded": 400,
    "server_overloaded": 429,
    "request_timeout": 504,
    "out_of_memory": 503,
    "slow_reader": 429,
    "quota_exceeded": 429,
    "shutting_down": 503,
    "not_ready": 503,
    "state_unavailable": 503,
    "shared_store_unavailable": 503,
    "shared_store_uncertain": 503,
    "internal_error": 500,
    "cancelled": 499,
    "session_not_found": 404,
    "invalid_parameter": 400,
}


class ApiError(Exception):
    def __init__(
        self, status: int, code: str, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.code, self.message, self.param)

    @classmethod
    def of(cls, code: str, message: str, param: str | None = None) -> ApiError:
        """An error the engine or the session store answered with, at its status (429s say when to retry)."""
        status = CODE_STATUS.get(code, 500)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if code in RETRIED else None
        return cls(status, code, message, param, headers)


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    if param is not None and len(param) > MAX_PARAM_CHARS:
        param = param[: MAX_PARAM_CHARS - 3] + "..."  # a field name can be as long as the body allows
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def failure_body(code: str, message: str) -> tuple[dict[str, Any], int]:
    """A turn that failed once admitted, as an error body and its status (a stream sends the body alone)."""
    status = CODE_STATUS.get(code, 500)
    return error_body(status, code, message), status

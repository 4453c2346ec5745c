"""Exception handlers: every failure leaves in the OpenAI envelope, FastAPI's validation errors included."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.anthropic.answers import error_envelope
from server.errors import Refused
from server.openai.errors import ApiError, error_body
from server.serving.apis import envelope_of

log = logging.getLogger("kvserve.api")


def validation_error(exc: RequestValidationError) -> ApiError:
    """The first problem pydantic found, as a 400 naming the field (never the 422 default, never the input)."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _is_type_tag(p)]
    param = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, "invalid_json", "the request body is not valid JSON")
    if kind == "extra_forbidden":
        return ApiError(400, "unsupported_parameter", f"unknown parameter '{param}'", param)
    if kind == "lone_surrogate":
        where = (err.get("ctx") or {}).get("name") or param
        return ApiError(
            400, "invalid_parameter", f"'{where}' holds text that is not valid UTF-8 (a lone surrogate)", where
        )
    if kind in ("unsupported_parameter", "invalid_parameter"):  # our own refusals, naming the field in ctx
        name = (err.get("ctx") or {}).get("name")
        if name is None:
            return ApiError(400, kind, str(err.get("msg")), param)
        # A nested model names its own field ('effort'); where it sits completes it ('output_config.effort').
        where = name if param is None or name.startswith(param) else f"{param}.{name}"
        return ApiError(400, kind, str(err.get("msg")).replace(f"'{name}'", f"'{where}'", 1), where)
    if kind == "missing":
        if param is None:
            return ApiError(400, "invalid_json", "the request body is missing")
        return ApiError(400, "invalid_parameter", f"missing required parameter '{param}'", param)
    where = f"'{param}': " if param else ""
    return ApiError(400, "invalid_parameter", f"{where}{err.get('msg')}", param)


def _is_type_tag(part) -> bool:
    """Union members add their type to an error's loc ("str", "list[str]", "TextPart"): not a field name."""
    text = str(part)
    return (
        text in {"str", "int", "float", "bool", "list", "dict"}
        or "[" in text
        or text[:1].isupper()
        or text.startswith("constrained-")  # an Annotated member of a union
    )


def _counted(request: Request, err: ApiError) -> ApiError:
    """A refused generation request counts in the failure series (the model is unknown if the body was not valid)."""
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.on_refused(request.url.path, getattr(request.state, "model", "unknown"), err.code)
    return err


def envelope(path: str, status: int, code: str, message: str, param: str | None = None) -> dict:
    """The error body clients of that route parse: its API's (Anthropic's on /v1/messages), else OpenAI's."""
    if envelope_of(path) == "anthropic":
        return error_envelope(status, code, message)
    return error_body(status, code, message, param)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        _counted(request, exc)
        body = envelope(request.url.path, exc.status, exc.code, exc.message, exc.param)
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Refused)
    async def _refused(request: Request, exc: Refused) -> JSONResponse:
        return await _api_error(request, ApiError.of(exc.code, exc.message))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = _counted(request, validation_error(exc))
        return JSONResponse(envelope(request.url.path, err.status, err.code, err.message, err.param), err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own 400 is a body it could not decode (e.g. invalid UTF-8): as invalid as bad JSON.
        code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        where = f"{request.method} {request.url.path[:200]}"
        message = {404: f"no such route: {where}", 405: f"{where}: method not allowed on this route"}
        text = message.get(exc.status_code, str(exc.detail))
        return JSONResponse(
            envelope(request.url.path, exc.status_code, code, text),
            exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(envelope(request.url.path, 500, "internal_error", "internal server error"), 500)

"""The OpenAPI document as the server behaves, and /docs served from a package (no CDN: it works offline; no
online validator; a Content-Security-Policy of its own that allows its one inline script by hash).

FastAPI's generated document is corrected where it would mislead a client or a generated SDK:
validation failures are 400s in the error envelope (never 422), each operation lists the error
statuses it can answer, streaming operations say they answer `text/event-stream` too, the
operations that take a session document the `X-Session-ID` header (sent and echoed), keys are a
bearer (or `x-api-key`) security scheme, and output-token fields show the server's limit.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib.resources import files
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from server.serving.apis import APIS, GENERATION_PATHS, envelope_of

DOCS_STATIC = "/docs/static"
OPEN_PATHS = frozenset({"/health", "/ready", "/docs", "/openapi.json"})  # need no key (with /metrics when set so)
GENERATION = (400, 401, 404, 408, 409, 413, 429, 503, 504)
STATUS_TEXT = {
    400: "Invalid request: invalid_parameter, unsupported_parameter (names the field), invalid_json, "
    "context_length_exceeded, session_model_mismatch",
    401: "invalid_api_key: a missing or unknown key",
    404: "model_not_found, session_not_found, response_not_found (another tenant's ids included)",
    408: "body_timeout: the body did not arrive in time",
    409: "session_busy (a request of this session is in flight since the time its message says, or another replica "
    "moved it on; with Retry-After), session_mode_mismatch",
    413: "request_too_large",
    429: "server_overloaded (with Retry-After), quota_exceeded, slow_reader",
    503: "not_ready, model_failed (it failed to load, and why), shutting_down, out_of_memory, state_unavailable, "
    "shared_store_unavailable, shared_store_uncertain",
    504: "request_timeout",
}
ERRORS: dict[tuple[str, str], tuple[int, ...]] = {
    **{("post", path): GENERATION for path in GENERATION_PATHS},
    ("post", "/v1/messages/count_tokens"): (400, 401, 404, 413, 503),
    ("post", "/tokenize"): (400, 401, 404, 413, 503),
    ("post", "/detokenize"): (400, 401, 404, 413, 503),
    ("get", "/v1/models"): (401,),
    ("get", "/v1/models/{model_id}"): (401, 404),
    ("post", "/v1/sessions"): (400, 401, 404, 409, 413, 429, 503),
    ("get", "/v1/sessions"): (400, 401),
    ("get", "/v1/sessions/{session_id}"): (400, 401, 404, 503),
    ("delete", "/v1/sessions/{session_id}"): (400, 401, 404, 409, 503),
    ("post", "/v1/sessions/{session_id}/fork"): (400, 401, 404, 409, 429, 503),
    ("post", "/v1/sessions/{session_id}/rewind"): (400, 401, 404, 409, 503),
    ("get", "/v1/responses/{response_id}"): (400, 401, 404),
    ("get", "/v1/responses/{response_id}/input_items"): (400, 401, 404),
    ("delete", "/v1/responses/{response_id}"): (400, 401, 404, 503),
    ("get", "/ready"): (503,),
    ("get", "/metrics"): (401,),
}
STREAMS = {api.path: api.streams for api in APIS}
SESSION_PATHS = GENERATION_PATHS
SESSION_HEADER = {
    "name": "X-Session-ID",
    "in": "header",
    "required": False,
    "description": "the session to continue (created on first use); the same as the body's session_id",
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,128}$"},
}
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "maxLength": 512},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"type": "string"},
            },
        }
    },
}
ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}, "code": {"type": "string"}},
        },
    },
}
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def install(app: FastAPI, max_tokens_limit: int) -> None:
    """Our /openapi.json and /docs (FastAPI's own docs_url must be None)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = honest(build(), max_tokens_limit)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
    app.mount(DOCS_STATIC, StaticFiles(directory=str(files("fastapi_offline") / "static")), name="docs-static")
    page = get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="kvserve API",
        swagger_js_url=f"{DOCS_STATIC}/swagger-ui-bundle.js",
        swagger_css_url=f"{DOCS_STATIC}/swagger-ui.css",
        swagger_favicon_url=f"{DOCS_STATIC}/favicon.png",
        # Swagger UI's default sends the document's address to validator.swagger.io for a badge: no outside calls
        swagger_ui_parameters={"validatorUrl": None},
    )
    body = bytes(page.body)  # built once: the policy holds its inline script's hash
    policy = docs_policy(body.decode())

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(body, headers={"Content-Security-Policy": policy})


def docs_policy(page: str) -> str:
    """The /docs page's Content-Security-Policy: its files from this server, the one inline script that starts
    Swagger UI allowed by its hash (no 'unsafe-inline'), requests ("Try it out") to this server only."""
    scripts = re.findall(r"<script>(.*?)</script>", page, flags=re.DOTALL)
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in scripts)
    return (
        f"default-src 'none'; script-src 'self' {hashes}; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


def honest(schema: dict[str, Any], max_tokens_limit: int) -> dict[str, Any]:
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["Error"], schemas["AnthropicError"] = ERROR_SCHEMA, ANTHROPIC_ERROR_SCHEMA
    components["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer", "description": "an API key (KVSERVE_API_KEYS)"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key", "description": "the same key"},
    }
    schema["security"] = [{"bearer": []}, {"apiKey": []}]
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            _correct(path, method, operation)
    _cap_token_fields(schemas, max_tokens_limit)
    return schema


def _correct(path: str, method: str, operation: dict[str, Any]) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    error = "AnthropicError" if envelope_of(path) == "anthropic" else "Error"
    for status in ERRORS.get((method, path), (400, 401)):
        responses[str(status)] = {
            "description": STATUS_TEXT[status],
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}},
        }
        if status in (409, 429):
            responses[str(status)]["headers"] = {
                "Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}
            }
    if path in STREAMS:
        ok = responses.setdefault("200", {"description": "Successful Response"})
        # A media type object has no description in OpenAPI 3.1: the event format is the schema's
        events = {"schema": {"type": "string", "description": STREAMS[path]}}
        ok.setdefault("content", {})["text/event-stream"] = events
    if path in SESSION_PATHS:
        operation.setdefault("parameters", []).append(SESSION_HEADER)
        header = {"description": "the session the answer used", "schema": {"type": "string"}}
        responses.setdefault("200", {"description": "Successful Response"}).setdefault("headers", {})
        responses["200"]["headers"]["X-Session-ID"] = header
    if path in OPEN_PATHS:
        operation["security"] = []


def _cap_token_fields(schemas: dict[str, Any], limit: int) -> None:
    """Show the server's max_tokens limit (clients and schema-driven tests see it)."""
    for component in schemas.values():
        for name in TOKEN_FIELDS:
            field = component.get("properties", {}).get(name)
            for option in (field or {}).get("anyOf", [field] if field else []):
                if option.get("type") == "integer":
                    option["maximum"] = limit

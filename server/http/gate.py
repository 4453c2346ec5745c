"""The first thing every HTTP request meets (pure ASGI, so streaming passes through untouched).

It names the request (X-Request-ID) and the replica answering it (X-Kvserve-Replica: behind a
load balancer, which process served it), finds its tenant from the API key (401 before the body
is even read), enforces the body size limit (413), adds the security headers every answer carries
(errors of its own included), and writes one access-log line and the request counter when the
response is done. Log lines carry ids, never request content.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid

from server.http.auth import DEFAULT_TENANT, KeyRing
from server.http.connections import SENT_BY_SERVER
from server.http.errors import envelope

log = logging.getLogger("kvserve.access")
OPEN_PREFIXES = ("/docs/", "/playground/")  # the docs' and the playground's files need no key, like their pages
# On every answer: no MIME sniffing, never framed (clickjacking), and a Content-Security-Policy that lets a JSON or
# event-stream body load and run nothing. The HTML pages (/docs, the playground) send their own, fitted to them.
SECURITY_HEADERS = ((b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"))
API_POLICY = (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'")
REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
CLIENT_CLOSED = 499  # nginx's status for a client that left before it was answered (and kvserve's `cancelled`)


class Gate:
    def __init__(
        self,
        app,
        keys: KeyRing,
        max_body_bytes: int,
        open_paths: set[str],
        on_response=None,
        body_timeout_s=30.0,
        replica: str = "",
    ) -> None:
        self.app, self.keys, self.max_body_bytes, self.open_paths = app, keys, max_body_bytes, open_paths
        self.named = [(b"x-kvserve-replica", replica.encode())] if replica else []
        self.body_timeout_s = body_timeout_s
        self.on_response = on_response  # (route, status, seconds) -> None: the metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-request-id", "")
        request_id = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        outcome = {"status": 500, "session": None, "started": False, "complete": False, "is_left": False}

        async def send_tracked(message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                outcome["complete"] = True
            if message["type"] == "http.response.start":
                outcome["status"], outcome["started"] = message["status"], True
                for key, value in message.get("headers", []):
                    if key.lower() == b"x-session-id":
                        outcome["session"] = value.decode("latin-1")
                named = [(b"x-request-id", request_id.encode()), *self.named, *_security(message)]
                message = {**message, "headers": [*message.get("headers", []), *named]}
            await send(message)

        try:
            tenant = self._tenant(scope["path"], headers)
            if tenant is None:
                message = _auth_message(headers)
                await _error(
                    send_tracked, scope["path"], 401, "invalid_api_key", message, {"WWW-Authenticate": "Bearer"}
                )
                return
            state["tenant"] = tenant
            replay = await self._read_body(scope["path"], headers, receive, send_tracked)
            if replay is not None:
                await self._answer(scope, replay, send_tracked, outcome)
            else:
                outcome["is_left"] = not outcome["started"]  # no body to answer: the connection ended first
        finally:
            self._done(scope, state, outcome, time.monotonic() - started)

    def _done(self, scope, state: dict, outcome: dict, seconds: float) -> None:
        """One access-log line (ids and counts, never content) and the request counter, with the status the
        client was sent: the app's or the gate's; uvicorn's own 400 for a body it could not read; 499 when the
        connection ended before any answer. Never a 500 that no one sent."""
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        status = outcome["status"]
        if not outcome["started"]:
            status = state.get(SENT_BY_SERVER) or (CLIENT_CLOSED if outcome["is_left"] else status)
        log.info(
            "%s %s %d %.0fms tenant=%s request=%s session=%s",
            scope["method"],
            route,
            status,
            seconds * 1000,
            state.get("tenant", "-"),
            state["request_id"],
            outcome["session"] or state.get("session") or "-",
        )
        if self.on_response is not None:
            self.on_response(route, status, seconds)

    async def _answer(self, scope, receive, send, outcome: dict) -> None:
        """The app's answer; an unexpected error becomes a 500 envelope here, so the connection stays usable
        (Starlette would send its 500 and re-raise, and uvicorn then drops the keep-alive connection)."""
        try:
            await self.app(scope, receive, send)
        except Exception:
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            if outcome["started"] and not outcome["complete"]:
                raise  # half a response is out: only closing the connection can tell the client
            if not outcome["started"]:
                await _error(send, scope["path"], 500, "internal_error", "internal server error")

    def _tenant(self, path: str, headers: dict) -> str | None:
        if not self.keys:
            return DEFAULT_TENANT
        scheme, _, token = headers.get("authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        token = token or headers.get("x-api-key", "").strip()  # Anthropic's clients send the key so
        tenant = self.keys.tenant_for(token) if token else None
        if tenant is None and (path in self.open_paths or path.startswith(OPEN_PREFIXES)):
            return DEFAULT_TENANT  # /health, /ready (and /metrics when configured so) need no key
        return tenant

    async def _read_body(self, path: str, headers: dict, receive, send):
        """The whole body, checked against the limit, replayed to the app; None when already answered."""
        limit = self.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _error(send, path, 413, "request_too_large", f"the request body is larger than {limit} bytes")
            return None
        chunks, size, more = [], 0, True
        deadline = time.monotonic() + self.body_timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                message = f"the request body did not arrive whole within {self.body_timeout_s:g} s"
                await _error(send, path, 408, "body_timeout", message, {"Connection": "close"})
                return None
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > limit:
                await _error(send, path, 413, "request_too_large", f"the request body is larger than {limit} bytes")
                return None
        body, is_replayed = b"".join(chunks), False

        async def replay():
            nonlocal is_replayed
            if not is_replayed:
                is_replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client going away

        return replay


def _security(start: dict) -> list[tuple[bytes, bytes]]:
    """The security headers an answer lacks: the strict policy unless the route set its own (a page's)."""
    present = {key.lower() for key, _ in start.get("headers", [])}
    return [(key, value) for key, value in (*SECURITY_HEADERS, API_POLICY) if key not in present]


def _auth_message(headers: dict) -> str:
    if not headers.get("authorization") and not headers.get("x-api-key"):
        return "this server needs an API key: send 'Authorization: Bearer <key>'"
    return "invalid API key"


async def _error(send, path: str, status: int, code: str, message: str, extra: dict | None = None) -> None:
    body = json.dumps(envelope(path, status, code, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

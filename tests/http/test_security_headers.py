"""Security headers on every answer: no MIME sniffing, never framed, and a Content-Security-Policy fitted to what
the answer is (the API's JSON and event streams run nothing; /docs and the playground run only their own files),
and /docs rendered by a real Chromium under its policy without calling anywhere else."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from tests.http import playground_driver as drive
from tests.http.conftest import wait_ready
from tests.http.test_playground import browser_or_skip

API_POLICY = "default-src 'none'; frame-ancestors 'none'"
CHAT = "/v1/chat/completions"


def directives(policy: str) -> dict[str, list[str]]:
    parsed = {}
    for directive in filter(None, (part.strip() for part in policy.split(";"))):
        name, *sources = directive.split()
        parsed[name] = sources
    return parsed


def assert_protected(headers) -> dict[str, list[str]]:
    """The headers every answer carries; the policy's directives, for the caller's own checks."""
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["x-frame-options"] == "DENY"
    assert len(headers.get_list("content-security-policy")) == 1  # one policy, never a page's and the strict one
    policy = directives(headers["content-security-policy"])
    assert policy["frame-ancestors"] == ["'none'"]
    assert policy["default-src"] == ["'none'"]  # whatever is not named is refused
    return policy


def test_api_answers_and_streams_run_nothing(client):
    for r in (client.get("/v1/models"), client.get("/openapi.json"), client.get("/health")):
        assert r.status_code == 200
        assert_protected(r.headers)
        assert r.headers["content-security-policy"] == API_POLICY
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    with client.stream("POST", CHAT, json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert_protected(r.headers)
        assert r.headers["content-security-policy"] == API_POLICY


def test_error_answers_carry_them_too(client):
    refused = client.post(CHAT, json={"model": "tiny", "messages": []})  # the route's own 400
    unknown = client.get("/v1/sessions/sess-nobody-has")  # 404
    nowhere = client.get("/no/such/path")  # no route at all
    too_large = client.post(CHAT, content=b"x", headers={"content-length": str(10**9)})  # the gate's own 413
    for r, status in ((refused, 400), (unknown, 404), (nowhere, 404), (too_large, 413)):
        assert r.status_code == status, r.text
        assert_protected(r.headers)
        assert r.headers["content-security-policy"] == API_POLICY


def test_a_401_before_the_body_is_read_carries_them(tiny_spec):
    with TestClient(create_app(Settings(api_keys="sk-headers-0001:alice"), specs=[tiny_spec])) as guarded:
        wait_ready(guarded)
        r = guarded.get("/v1/models")
        assert r.status_code == 401
        assert_protected(r.headers)
        assert r.headers["content-security-policy"] == API_POLICY


def test_the_docs_page_runs_only_its_own_files_and_its_one_inline_script(client):
    r = client.get("/docs")
    assert r.headers["content-type"].startswith("text/html")
    policy = assert_protected(r.headers)
    assert "'unsafe-inline'" not in policy["script-src"]
    assert "'unsafe-eval'" not in policy["script-src"]
    assert "'unsafe-inline'" not in policy["style-src"]
    for name in ("script-src", "style-src", "img-src", "connect-src"):
        assert "'self'" in policy[name], name
        elsewhere = [s for s in policy[name] if s.startswith(("http", "*")) or (s.endswith(":") and s != "data:")]
        assert not elsewhere, name
    inline = re.findall(r"<script>(.*?)</script>", r.text, flags=re.DOTALL)
    assert len(inline) == 1  # Swagger UI's start: allowed by its hash, nothing else inline
    hashes = [s for s in policy["script-src"] if s.startswith("'sha256-")]
    assert len(hashes) == 1


def test_the_docs_page_sends_nothing_to_an_outside_validator(client):
    """Swagger UI's default validatorUrl has a page on any host but localhost fetch a badge from swagger.io."""
    page = client.get("/docs").text
    start = page[page.index("SwaggerUIBundle({") :]
    assert '"validatorUrl": null' in start
    assert "swagger.io" not in page


def test_the_playground_page_runs_only_its_own_files(client):
    r = client.get("/")
    assert r.status_code == 200
    policy = assert_protected(r.headers)
    for name in ("script-src", "style-src", "connect-src"):
        assert policy[name] == ["'self'"], name  # no inline script or style, no other origin
    static = client.get("/playground/static/app.js")
    assert static.headers["x-content-type-options"] == "nosniff"
    assert static.headers["content-type"].startswith(("text/javascript", "application/javascript"))


@pytest.fixture(scope="module")
def browser():
    sync_playwright = browser_or_skip()
    # kvserve.test is this machine: a page served on a host that is not localhost, as a deployment's would be
    args = [*drive.ARGS, "--host-resolver-rules=MAP kvserve.test 127.0.0.1"]
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=drive.CHROMIUM, headless=True, args=args)
        yield launched
        launched.close()


def test_swagger_ui_renders_every_operation_under_its_policy(live, browser):
    base, _engine = live
    site = base.replace("127.0.0.1", "kvserve.test")
    context = browser.new_context()
    context.add_init_script(drive.RECORD_VIOLATIONS)
    page = context.new_page()
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(site + "/docs")
    document = json.loads(page.evaluate("fetch('/openapi.json').then(r => r.text())"))
    num_operations = sum(len(operations) for operations in document["paths"].values())
    page.wait_for_function(
        f"() => document.querySelectorAll('.opblock').length === {num_operations}", timeout=drive.WAIT_MS
    )
    assert page.locator(".opblock-summary-path[data-path='/v1/responses']").count() >= 1
    page.wait_for_load_state("networkidle")
    assert drive.violations(page) == []  # Swagger UI needed nothing its policy refuses
    assert [url for url in requested if not url.startswith(site)] == []  # and called nowhere else
    context.close()

"""Driving the playground page in Chromium (Playwright): shared by its test and bench/playground_shot.py."""

from __future__ import annotations

import shutil

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# How the sandbox starts a browser: no GPU, no network of its own, no first-run work.
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]  # fmt: skip
WAIT_MS = 120_000
# Predicates are passed as functions ("() => ..."): a bare expression, polled, is eval'd in the page, which its
# Content-Security-Policy (no 'unsafe-eval') refuses.
# Every Content-Security-Policy violation on the page, from before its first script (context.add_init_script)
RECORD_VIOLATIONS = """
window.cspViolations = [];
document.addEventListener("securitypolicyviolation", (e) => window.cspViolations.push(
  `${e.effectiveDirective} blocked ${e.blockedURI || "inline"} (${e.sourceFile}:${e.lineNumber})`));
"""


def violations(page) -> list[str]:
    return page.evaluate("window.cspViolations")


def open_with_key(page, base: str, key: str | None) -> None:
    page.goto(base + "/")
    if key is not None:
        page.wait_for_function("() => document.querySelector('[data-testid=status]').textContent.includes('API key')")
        page.fill("[data-testid=api-key]", key)
        page.locator("[data-testid=api-key]").dispatch_event("change")
    page.wait_for_function("() => document.querySelector('[data-testid=model]').options.length > 0", timeout=WAIT_MS)


def new_session(page, system: str) -> str:
    page.fill("[data-testid=system]", system)
    page.click("[data-testid=new-session]")
    page.wait_for_function("() => document.querySelector('[data-testid=session-name]').textContent.includes('sess_')")
    return page.locator("[data-testid=session-name]").inner_text().removeprefix("session ")


def send(page, text: str) -> None:
    """One turn, waited for to its end."""
    done = len(turns(page))
    page.fill("[data-testid=message]", text)
    page.click("[data-testid=send]")
    page.wait_for_function(
        f"() => document.querySelectorAll('[data-testid=turn][data-status=done]').length == {done + 1}", timeout=WAIT_MS
    )


def recompute(page, index: int) -> None:
    page.locator("[data-testid=turn][data-status=done]").nth(index).locator("[data-testid=recompute]").click()
    page.wait_for_function(
        "() => document.querySelectorAll('svg[data-testid=ttft-chart] rect.no-cache').length >= 1", timeout=WAIT_MS
    )


def turns(page) -> list:
    return page.locator("[data-testid=turn][data-status=done]").all()

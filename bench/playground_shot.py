"""The playground on the default model, in headless Chromium: the screenshot the README shows.

python bench/playground_shot.py [--out docs/playground.png]

Starts `kvserve serve` on the default model, opens the page, makes a session with a long system prompt,
has three turns, recomputes the last one without the cache and saves the page. The same flow as
tests/http/test_playground.py (which runs on the tiny model in CI); needs Chromium and playwright.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, spawn_server
from playwright.sync_api import sync_playwright

from tests.http import playground_driver as drive

SYSTEM = (
    "You are a concise travel assistant for a train company. You answer in two sentences at most, you name "
    "stations and times when you know them, and you never invent a price. When a question is unclear, you "
    "ask one short question back. " * 12
)
TURNS = ["Which city should I visit in Italy?", "How do I get there from Paris?", "And what should I see first?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "playground.png")
    args = parser.parse_args()
    state = tempfile.TemporaryDirectory()  # a fresh state directory: no session of an earlier run shows
    proc, base = spawn_server(["--state-dir", state.name])
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=drive.CHROMIUM, headless=True, args=drive.ARGS)
            page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            drive.open_with_key(page, base.removesuffix("/v1"), None)
            page.fill("[data-testid=max-tokens]", "40")
            drive.new_session(page, SYSTEM)
            for text in TURNS:
                drive.send(page, text)
            drive.recompute(page, len(TURNS) - 1)
            page.wait_for_timeout(5500)  # the session list and pool refresh every 5 s
            page.screenshot(path=str(args.out), full_page=True)
            for turn in drive.turns(page):
                print(turn.locator("[data-testid=turn-stats]").inner_text())
            browser.close()
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""A server holding 10,000 sessions: what a listing page, a session creation and a 7 MiB prompt cost.

In-process (uvicorn in a thread) on the tiny test model, memory only. The point is that none of
these grows with the number of sessions, and that a prompt beyond the context is refused by its
size before it is tokenized (tests/http/test_responsiveness.py proves both by behaviour). It also
measures what the issue asked of /health: its slowest answer while 8 clients list 1,000 sessions each.

    python bench/crowded.py [--sessions 10000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from server.sessions.record import SessionKey
from server.settings import Settings
from tests.http.conftest import serve_live
from tests.tiny import save_tiny


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def list_concurrently(base: str, num_clients: int) -> None:
    def one(i: int) -> None:
        with httpx.Client(base_url=base, timeout=60) as client:
            client.get("/v1/sessions", params={"limit": 1000, "after": f"s{i * 1000:05d}"}).raise_for_status()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(num_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def health_while(client: httpx.Client, work) -> float:
    """The slowest /health answer, in seconds, while `work()` runs on another thread."""
    worker = threading.Thread(target=work)
    worker.start()
    slowest = 0.0
    while worker.is_alive():
        slowest = max(slowest, timed(lambda: client.get("/health").raise_for_status()))
        time.sleep(0.02)
    worker.join()
    return slowest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=10_000)
    args = parser.parse_args()
    spec = save_tiny(Path(tempfile.mkdtemp()))
    settings = Settings(max_sessions_per_tenant=3 * args.sessions, state_dir=None)
    with serve_live([spec], settings) as (base, engine), httpx.Client(base_url=base, timeout=60) as client:
        for i in range(args.sessions):
            engine.store.create(SessionKey("default", f"s{i:05d}"), "tiny")
        pages = [
            timed(lambda i=i: client.get("/v1/sessions", params={"limit": 1000, "after": f"s{i:05d}"}))
            for i in range(5)
        ]
        health = health_while(client, lambda: list_concurrently(base, 8))
        creates = [timed(lambda: client.post("/v1/sessions", json={})) for _ in range(20)]
        body = {"model": "tiny", "messages": [{"role": "user", "content": "word " * (7 * 2**20 // 5)}]}
        huge = timed(lambda: client.post("/v1/chat/completions", json=body))
    print(f"{args.sessions} sessions: a page of 1,000 in {1000 * statistics.median(pages):.0f} ms (median of 5)")
    print(f"  /health while 8 clients list a page of 1,000 each: slowest {1000 * health:.0f} ms")
    print(f"  creating one: median {1000 * statistics.median(creates):.1f} ms, max {1000 * max(creates):.1f} ms (20)")
    print(f"  a 7 MiB prompt refused (400 context_length_exceeded) in {huge:.2f} s")


if __name__ == "__main__":
    main()

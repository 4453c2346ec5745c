"""Sustained load: N concurrent streaming clients for a fixed time, then check nothing leaked.

python bench/load.py [--clients 32] [--seconds 60] [--max-tokens 24]

Spawns the server on the default model (loopback). Each client loops: half of them hold a
session and keep adding turns (reset after 4), the others send stateless one-shot chats.
Every request streams; an error event, a non-200 status or a stream without [DONE] counts
as an error. Before and after: the server's RSS, and from /metrics the pool usage and the
running/waiting requests, which must be back to zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, event_text, machine_line, replace_section, spawn_server, sse_event

MODEL = "smollm2-135m-instruct"
QUESTIONS = ["Name a river.", "Name a mountain.", "Say hello.", "Count to three.", "Name a color.", "Name a city."]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def gauges(client: httpx.AsyncClient) -> dict:
    text = (await client.get("/metrics")).text
    wanted = ("kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc")
    found = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines() if line.startswith(wanted)}
    device = next(line for line in text.splitlines() if line.startswith('kvserve:kv_cache_bytes{tier="device"}'))
    return found | {"cached_mib": float(device.split()[-1]) / 2**20}


async def one_turn(client, messages, session: str | None, stats: dict, max_tokens: int) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0.7}
    if session:
        body["session_id"] = session
    started, first, text, done = time.perf_counter(), None, "", False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                stats["errors"].append(f"status {r.status_code}")
                return ""
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                event = sse_event(line)
                if event and event_text(event):
                    first = first or time.perf_counter()
                    text += event_text(event)
    except (httpx.HTTPError, RuntimeError) as exc:
        stats["errors"].append(type(exc).__name__ + ": " + str(exc)[:80])
        return ""
    if not done:
        stats["errors"].append("stream ended without [DONE]")
    stats["requests"] += 1
    stats["chars"] += len(text)
    if first:
        stats["ttft"].append(first - started)
    return text


async def client_loop(client, index: int, deadline: float, stats: dict, max_tokens: int) -> None:
    has_session, turn, messages = index % 2 == 0, 0, []
    while time.monotonic() < deadline:
        question = QUESTIONS[(index + turn) % len(QUESTIONS)]
        if not has_session or turn % 4 == 0:
            messages = []
        messages.append({"role": "user", "content": question})
        session = f"load-{index}-{turn // 4}" if has_session else None
        reply = await one_turn(client, messages, session, stats, max_tokens)
        messages.append({"role": "assistant", "content": reply})
        turn += 1


async def run(args, proc, base: str) -> dict:
    stats = {"requests": 0, "chars": 0, "errors": [], "ttft": []}
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await one_turn(client, [{"role": "user", "content": "Warm up."}], None, stats, 4)
        before = {"rss_mib": rss_mib(proc.pid), **await gauges(client)}
        stats.update(requests=0, chars=0, ttft=[])
        deadline = time.monotonic() + args.seconds
        started = time.monotonic()
        await asyncio.gather(*(client_loop(client, i, deadline, stats, args.max_tokens) for i in range(args.clients)))
        elapsed = time.monotonic() - started
        health = time.perf_counter()
        (await client.get("/health")).raise_for_status()
        health_ms = (time.perf_counter() - health) * 1000
        after = {"rss_mib": rss_mib(proc.pid), **await gauges(client)}
    ttft = sorted(stats["ttft"])
    return {
        "clients": args.clients,
        "seconds": round(elapsed, 1),
        "requests": stats["requests"],
        "errors": stats["errors"],
        "requests_per_s": stats["requests"] / elapsed,
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p95_s": ttft[int(0.95 * (len(ttft) - 1))] if ttft else None,
        "health_ms_after": health_ms,
        "before": before,
        "after": after,
    }


def gauge_row(label: str, g: dict) -> str:
    running = g.get("kvserve:num_requests_running", 0)
    waiting = g.get("kvserve:num_requests_waiting", 0)
    usage = 100 * g.get("kvserve:kv_cache_usage_perc", 0)
    return (
        f"| {label} | {g['rss_mib']:.0f} MiB | {running:.0f} | {waiting:.0f} | {usage:.1f}% "
        f"| {g['cached_mib']:.0f} MiB |"
    )


def report(r: dict) -> str:
    lines = [
        "## Load: concurrent streaming clients",
        "",
        f"`python bench/load.py --clients {r['clients']}` ({machine_line()}): {r['clients']} clients streaming "
        f"chat turns for {r['seconds']} s on the default model (half on sessions, half stateless).",
        "",
        "| requests | errors | requests/s | TTFT p50 | TTFT p95 |",
        "|---:|---:|---:|---:|---:|",
        f"| {r['requests']} | {len(r['errors'])} | {r['requests_per_s']:.2f} | {r['ttft_p50_s']:.2f} s "
        f"| {r['ttft_p95_s']:.2f} s |",
        "",
        "| | server RSS | requests running | waiting | pool blocks in use | K/V kept in the pool as cache |",
        "|---|---:|---:|---:|---:|---:|",
        gauge_row("before (after one warm-up request)", r["before"]),
        gauge_row("after", r["after"]),
        "",
        "Pool blocks in use return to 0: every request gave back what it held. RSS grows by the K/V the pool "
        "keeps as prefix cache (idle blocks, reusable and evicted least recently used first; the pool is "
        "allocated lazily, so its pages count once touched) plus allocator caches; it is bounded by "
        "KVSERVE_KV_BUDGET_BYTES, not by the number of requests served.",
        "",
        f"/health answered in {r['health_ms_after']:.0f} ms right after the run."
        + (f" Errors: {sorted(set(r['errors']))[:5]}" if r["errors"] else ""),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    proc, base = spawn_server(["--state-dir", ""])
    try:
        result = asyncio.run(run(args, proc, base.removesuffix("/v1")))
    finally:
        proc.terminate()
        proc.wait(60)
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "load.json").write_text(json.dumps(result, indent=2))
    print(report(result))
    if not args.no_docs:
        replace_section(ROOT / "docs" / "benchmarks.md", "load", report(result))
    if result["errors"] or result["after"].get("kvserve:kv_cache_usage_perc", 0) > 0:
        sys.exit(1)


if __name__ == "__main__":
    main()

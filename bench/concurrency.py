"""Concurrency benchmark over HTTP: many multi-turn conversations at once, and a shared system prompt.

1. For 1, 4, 8 and 16 concurrent conversations (each on its own session, a few turns):
   aggregate decode tokens/s, p50/p95 time to first token, p50 inter-token latency.
2. N new conversations sharing a ~1,500-token system prompt, one after another: the TTFT of
   the 2nd..Nth against a fresh prompt holding only their own tokens; and the same
   conversations with every cache bypassed (cached_tokens must be 0 on each).
Writes a section of docs/benchmarks.md and docs/concurrency.png.

    python bench/concurrency.py      # starts its own servers (two configurations) on the default model
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
from common import ROOT, StreamTimer, machine_line, replace_section, spawn_server
from multiturn import system_prompt

NO_CACHE = {"cache_prompt": False}


async def stream(client: httpx.AsyncClient, path: str, body: dict, headers=None) -> dict:
    timer = StreamTimer()
    async with client.stream("POST", path, json=body, headers=headers or {}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            timer.feed(line)
    return timer.result()


async def conversation(client, model: str, index: int, args) -> list[dict]:
    messages = [{"role": "system", "content": f"You are assistant number {index}. Answer briefly."}]
    rows, session = [], f"conc-{index}-{time.time_ns()}"
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"Tell me fact {turn + 1} about the number {index}."})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        row = await stream(client, "/chat/completions", body, {"X-Session-ID": session})
        rows.append(row)
        messages.append({"role": "assistant", "content": row["text"]})
    return rows


async def level(base: str, model: str, num: int, args) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(conversation(client, model, i, args) for i in range(num)))
        wall = time.perf_counter() - start
    rows = [r for conv in results for r in conv]
    ttfts = sorted(r["ttft_s"] for r in rows)
    gaps = [g for r in rows for g in r["gaps"]]
    return {
        "conversations": num,
        "aggregate_tok_s": sum(r["completion_tokens"] for r in rows) / wall,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p95_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
        "itl_p50_ms": 1000 * statistics.median(gaps),
        "decode_tok_s_per_stream": statistics.median(r["decode_tok_s"] for r in rows),
    }


async def shared_prompt(base: str, model: str, num: int, extra: dict) -> list[dict]:
    """`num` new conversations, one after another, all opening with the same long system prompt."""
    rows = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        for i in range(num):
            messages = [
                {"role": "system", "content": system_prompt()},
                {"role": "user", "content": f"I am traveller {i}. Which section should I read first?"},
            ]
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                **extra,
            }
            row = await stream(client, "/chat/completions", body, {"X-Session-ID": f"shared-{i}-{time.time_ns()}"})
            fresh_body = {
                "model": model,
                "prompt": [1000 + (7919 * k) % 20000 for k in range(row["prompt_tokens"] - row["cached_tokens"])],
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
                **NO_CACHE,
            }
            row["fresh_ttft_s"] = (await stream(client, "/completions", fresh_body))["ttft_s"]
            rows.append(row)
    return rows


def run_server(server_args: list[str], body):
    proc, base = spawn_server(server_args)
    try:
        return asyncio.run(body(base))
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--levels", default="1,4,8,16")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--shared", type=int, default=6, help="conversations sharing the long system prompt")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    args = parser.parse_args()
    levels = [int(n) for n in args.levels.split(",")]

    async def batching(base):
        results = {"levels": [], "shared": None, "shared_no_cache": None}
        for num in levels:
            results["levels"].append(await level(base, args.model, num, args))
            print(json.dumps(results["levels"][-1]), flush=True)
        results["shared"] = await shared_prompt(base, args.model, args.shared, {})
        results["shared_no_cache"] = await shared_prompt(base, args.model, args.shared, NO_CACHE)
        return results

    results = run_server([], batching)
    if any(r["cached_tokens"] for r in results["shared_no_cache"]):
        print("the no-cache baseline reported cached tokens", file=sys.stderr)
        return 1
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "concurrency.json").write_text(json.dumps(results, indent=1, default=str))
    report(Path(args.out), results, args)
    return 0


def report(out: Path, results: dict, args) -> None:
    from concurrency_report import render

    out.mkdir(parents=True, exist_ok=True)
    replace_section(out / "benchmarks.md", "concurrency", render(out, results, args, machine_line()))


if __name__ == "__main__":
    sys.exit(main())

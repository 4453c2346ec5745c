"""How many sessions survive a restart: SIGTERM (drain + K/V saved) and SIGKILL (transcripts only).

python bench/restart.py [--sessions 8] [--turns 2]

Spawns the server on the default model with a fresh state directory, runs --turns chat turns
on each of --sessions sessions, stops it, starts it again on the same directory, and counts
the sessions listed with all their completed turns, and how the next turn found its K/V
(X-Cache-Source: disk = restored from the snapshot, none = recomputed). Once with SIGTERM,
once with SIGKILL sent right after the last turn's response.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine_line, replace_section, spawn_server

QUESTIONS = ["Name a river.", "Why is it long?", "Which sea does it reach?", "Say it again in one word."]


def chat(base: str, sid: str, messages: list[dict]) -> httpx.Response:
    body = {"model": "smollm2-135m-instruct", "session_id": sid, "messages": messages, "max_tokens": 24}
    r = httpx.post(base + "/chat/completions", json=body | {"temperature": 0}, timeout=300)
    r.raise_for_status()
    return r


def run_turns(base: str, args) -> dict[str, list[dict]]:
    conversations = {}
    for i in range(args.sessions):
        sid = httpx.post(base + "/sessions", json={"system": f"You are assistant number {i}."}).json()["id"]
        messages: list[dict] = []
        for question in QUESTIONS[: args.turns]:
            messages.append({"role": "user", "content": question})
            reply = chat(base, sid, messages).json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": reply})
        conversations[sid] = messages
    return conversations


def one_restart(sig: signal.Signals, args) -> dict:
    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as state:
        extra = ["--state-dir", state, "--host-kv-budget-bytes", "0"]
        proc, base = spawn_server(extra)
        conversations = run_turns(base, args)
        started = time.perf_counter()
        proc.send_signal(sig)
        code = proc.wait(120)
        stop_s = time.perf_counter() - started
        proc, base = spawn_server(extra)
        try:
            listed = {s["id"]: s for s in httpx.get(base + "/sessions", params={"limit": 1000}).json()["data"]}
            intact, sources = 0, {"disk": 0, "device": 0, "none": 0, "host": 0}
            for sid, messages in conversations.items():
                if listed.get(sid, {}).get("turns") == args.turns:
                    intact += 1
                r = chat(base, sid, [*messages, {"role": "user", "content": "Thanks."}])
                sources[r.headers["X-Cache-Source"]] += 1
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    return {
        "signal": sig.name,
        "exit_code": code,
        "stop_s": stop_s,
        "sessions": len(conversations),
        "intact": intact,
        "next_turn_source": sources,
    }


def report(rows: list[dict], args) -> str:
    lines = [
        "## Restarts: sessions surviving SIGTERM and SIGKILL",
        "",
        f"`python bench/restart.py` ({machine_line()}): {args.sessions} sessions x {args.turns} chat turns on the "
        "default model, then the signal, a restart on the same state directory, and one more turn per session.",
        "",
        "| signal | exit code | stop took | sessions listed with every turn | next turn's K/V: restored from disk "
        "| recomputed |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        src = row["next_turn_source"]
        lines.append(
            f"| {row['signal']} | {row['exit_code']} | {row['stop_s']:.1f} s | {row['intact']} / {row['sessions']} "
            f"| {src['disk']} | {src['none'] + src['device']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    rows = [one_restart(signal.SIGTERM, args), one_restart(signal.SIGKILL, args)]
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "restart.json").write_text(json.dumps(rows, indent=2))
    print(report(rows, args))
    if not args.no_docs:
        replace_section(ROOT / "docs" / "benchmarks.md", "restart", report(rows, args))


if __name__ == "__main__":
    main()

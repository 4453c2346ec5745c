"""Kill the server in the middle of streams, restart it, and check that no completed turn was lost.

python bench/faults.py [--sessions 6] [--rounds 3]

Each round: --sessions clients run chat turns on their own sessions (streaming) against a
server with a state directory; after a random delay the server is killed (SIGKILL) while
streams are open; it is restarted on the same directory. A turn counts as completed when
its client received the final chunk and [DONE]. After every restart each session must
report at least as many turns as its client completed (one more is fine: the server
journals a turn before it sends the final event), and the next turn must work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, event_text, machine_line, replace_section, spawn_server, sse_event

MODEL = "smollm2-135m-instruct"


async def turn(client, sid: str, messages: list[dict]) -> str | None:
    """The reply text when the turn completed (final chunk and [DONE] received), else None."""
    body = {"model": MODEL, "session_id": sid, "messages": messages, "max_tokens": 32, "stream": True}
    text, finished, done = "", False, False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body | {"temperature": 0}) as r:
            if r.status_code != 200:
                return None
            async for line in r.aiter_lines():
                done = done or line == "data: [DONE]"
                event = sse_event(line)
                if event:
                    text += event_text(event)
                    finished = finished or any(c.get("finish_reason") for c in event.get("choices", []))
    except (httpx.HTTPError, RuntimeError):
        return None
    return text if finished and done else None


async def client_loop(base: str, sid: str, state: dict) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        while True:
            messages = state["messages"] + [{"role": "user", "content": f"Tell me fact number {state['done'] + 1}."}]
            reply = await turn(client, sid, messages)
            if reply is None:
                return  # the server went away mid-turn
            state["messages"] = [*messages, {"role": "assistant", "content": reply}]
            state["done"] += 1


async def one_round(base: str, sessions: dict, kill_after_s: float) -> None:
    tasks = [asyncio.create_task(client_loop(base, sid, state)) for sid, state in sessions.items()]
    await asyncio.sleep(kill_after_s)
    sessions["__kill__"]()  # SIGKILL while streams are open
    await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as state_dir:
        extra = ["--state-dir", state_dir]
        proc, base = spawn_server(extra)
        base = base.removesuffix("/v1")
        sessions = {f"fault-{i}": {"messages": [], "done": 0} for i in range(args.sessions)}
        for number in range(1, args.rounds + 1):
            delay = rng.uniform(4, 10)
            asyncio.run(one_round(base, sessions | {"__kill__": lambda p=proc: p.send_signal(signal.SIGKILL)}, delay))
            proc.wait(30)
            proc, base = spawn_server(extra)
            base = base.removesuffix("/v1")
            listed = {
                s["id"]: s["turns"] for s in httpx.get(base + "/v1/sessions", params={"limit": 1000}).json()["data"]
            }
            lost = sum(max(0, state["done"] - listed.get(sid, 0)) for sid, state in sessions.items())
            extra_turns = sum(max(0, listed.get(sid, 0) - state["done"]) for sid, state in sessions.items())
            completed = sum(state["done"] for state in sessions.values())
            rows.append(
                {
                    "round": number,
                    "killed_after_s": round(delay, 1),
                    "completed_turns": completed,
                    "lost": lost,
                    "journaled_not_delivered": extra_turns,
                }
            )
            for sid, state in sessions.items():  # count on from the server's view (a journaled, undelivered turn)
                state["done"] = max(state["done"], listed.get(sid, 0))
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    report = render(rows, args)
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "faults.json").write_text(json.dumps(rows, indent=2))
    print(report)
    if not args.no_docs:
        replace_section(ROOT / "docs" / "benchmarks.md", "faults", report)
    if any(row["lost"] for row in rows):
        sys.exit(1)


def render(rows: list[dict], args) -> str:
    lines = [
        "## Faults: SIGKILL in the middle of streams",
        "",
        f"`python bench/faults.py` ({machine_line()}): {args.sessions} sessions streaming chat turns, the server "
        f"killed with SIGKILL at a random moment and restarted on the same state directory, {args.rounds} times.",
        "",
        "| round | killed after | turns completed so far (client view) | lost | journaled, final event not delivered |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['round']} | {row['killed_after_s']} s | {row['completed_turns']} | {row['lost']} "
            f"| {row['journaled_not_delivered']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

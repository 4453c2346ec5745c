"""Multi-turn benchmark against any OpenAI-compatible server: with a session vs without.

A conversation with a ~1,500-token system prompt and 8 user turns runs twice over HTTP:
once on a session (kvserve continues from the cached K/V) and once stateless (the baseline
must report cached_tokens == 0 on every turn, or the run fails). Per turn: prompt tokens,
cached tokens, time to first token, decode tokens/s. Also: the TTFT of a fresh prompt made
of only each turn's new text, and HF generate() in-process on turn 8's prompt for the
decode-rate comparison. Writes docs/benchmarks.md (table) and docs/multiturn_ttft.png.

    python bench/multiturn.py --spawn                 # start kvserve on the default model
    python bench/multiturn.py --base-url http://127.0.0.1:8000/v1 --model NAME
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import StreamTimer, hf_decode_rate, render_report, spawn_server

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["rivers", "mountains", "deserts", "forests", "oceans", "islands", "glaciers", "volcanoes"]
QUESTIONS = [
    "Summarise the guide's advice on {} in two sentences.",
    "What is the most important safety rule for {}?",
    "Give one example trip involving {}.",
    "Which season suits {} best, and why?",
    "List three things to pack for {}.",
    "What mistake do beginners make with {}?",
    "How should a group plan a day around {}?",
    "End with a one-line tip about {}.",
]


def system_prompt(num_paragraphs: int = 22) -> str:
    """A deterministic ~1,500-token system prompt (a field guide)."""
    paragraphs = []
    for i in range(num_paragraphs):
        topic = TOPICS[i % len(TOPICS)]
        paragraphs.append(
            f"Section {i + 1} on {topic}: travellers who visit {topic} should check the weather the day before, "
            f"carry enough water, tell someone their route, and respect local rules. Guides in region {i + 1} "
            f"recommend starting early, resting every hour, and keeping a printed map, because phones fail in "
            f"remote {topic}."
        )
    return "You are a concise travel assistant. Use this field guide.\n\n" + "\n".join(paragraphs)


def stream_request(client: httpx.Client, url: str, body: dict, headers: dict | None = None) -> dict:
    """One streamed request; returns text, ttft, decode rate and usage."""
    timer = StreamTimer()
    with client.stream("POST", url, json=body, headers=headers or {}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            timer.feed(line)
    return timer.result()


def conversation(client, base, model, mode, replies, args) -> tuple[list[dict], list[dict]]:
    messages = [{"role": "system", "content": system_prompt()}]
    session = f"bench-{int(time.time() * 1000)}"
    rows = []
    for turn in range(args.turns):
        question = QUESTIONS[turn % len(QUESTIONS)].format(TOPICS[turn % len(TOPICS)])
        messages.append({"role": "user", "content": question})
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if args.ignore_eos:
            body["ignore_eos"] = True
        if mode == "baseline":
            body.update(json.loads(args.no_cache_body))  # bypass every cache, prefix sharing included
        headers = {"X-Session-ID": session} if mode == "session" else {}
        row = stream_request(client, base + "/chat/completions", body, headers)
        row["turn"] = turn + 1
        rows.append(row)
        reply = replies[turn] if replies else row["text"]  # the baseline replays the same history
        messages.append({"role": "assistant", "content": reply})
        print(
            f"{mode:>9} turn {turn + 1}: prompt {row['prompt_tokens']:5d} cached {row['cached_tokens']:5d} "
            f"ttft {row['ttft_s'] * 1000:7.1f} ms  decode {row['decode_tok_s']:6.1f} tok/s",
            flush=True,
        )
    return rows, messages


def fresh_new_tokens(client, base, model, session_rows, no_cache_body: dict) -> list[dict]:
    """TTFT of a stateless prompt of as many tokens as each session turn computed: the floor a cache can reach.

    The prompt is token ids in [1000, 21000): their count, not their content, sets the cost.
    """
    rows = []
    for row in session_rows:
        num_new = row["prompt_tokens"] - row["cached_tokens"]
        body = {
            "model": model,
            "prompt": [1000 + (7919 * i) % 20000 for i in range(num_new)],
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **no_cache_body,
        }
        rows.append(stream_request(client, base + "/completions", body))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--spawn", action="store_true", help="start `kvserve serve` on a free port for the run")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--hf-model-dir", help="transformers dir for the in-process generate() comparison")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    parser.add_argument(
        "--no-cache-body", default='{"cache_prompt": false}', help="JSON merged into baseline requests to bypass caches"
    )
    parser.add_argument("--server-args", default="", help="extra `kvserve serve` flags with --spawn")
    args = parser.parse_args()
    proc = None
    if args.spawn:
        proc, args.base_url = spawn_server(args.server_args.split())
    try:
        with httpx.Client(timeout=600) as client:
            session_rows, messages = conversation(client, args.base_url, args.model, "session", None, args)
            replies = [m["content"] for m in messages if m["role"] == "assistant"]
            baseline_rows, _ = conversation(client, args.base_url, args.model, "baseline", replies, args)
            fresh_rows = fresh_new_tokens(
                client, args.base_url, args.model, session_rows, json.loads(args.no_cache_body)
            )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    if any(r["cached_tokens"] for r in baseline_rows):
        print("baseline reported cached tokens: it is not a no-cache baseline", file=sys.stderr)
        return 1
    first_prompt = messages[:2]  # HF generate() on the first and the last turn's prompt: the same context range
    hf = hf_decode_rate(args, [first_prompt, messages[:-1]], session_rows[-1]["completion_tokens"])
    summary = summarise(session_rows, baseline_rows, fresh_rows, hf)
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    raw = {"session": session_rows, "baseline": baseline_rows, "fresh": fresh_rows, "summary": summary}
    (results / "multiturn.json").write_text(json.dumps(raw, indent=1))
    render_report(Path(args.out), session_rows, baseline_rows, fresh_rows, summary, args)
    print(json.dumps(summary, indent=2))
    return 0


def summarise(session_rows, baseline_rows, fresh_rows, hf) -> dict:
    later = [r["ttft_s"] for r in session_rows[1:]]
    fresh = [r["ttft_s"] for r in fresh_rows[1:]]
    server_rate = statistics.median(r["decode_tok_s"] for r in session_rows + baseline_rows)
    return {
        "turn_last_ttft_speedup": baseline_rows[-1]["ttft_s"] / session_rows[-1]["ttft_s"],
        "median_later_ttft_over_fresh_new_tokens": statistics.median(later) / statistics.median(fresh),
        "server_decode_tok_s": server_rate,
        "hf_generate_decode_tok_s": hf,
        "server_over_hf_decode": server_rate / hf if hf else None,
    }


if __name__ == "__main__":
    sys.exit(main())

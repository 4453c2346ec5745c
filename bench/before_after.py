"""Before and after a change, side by side in one run: the multi-turn and the 8-conversation benchmarks.

The source tree at REV is checked out (a git worktree, removed at the end) and served from the same
virtual environment as this checkout; the two servers run one at a time, alternately, `--rounds`
times each, on the default model. Per server: turn-8 TTFT and the median TTFT of turns 2-8 of
bench/multiturn.py's session conversation, and aggregate tok/s of bench/concurrency.py at 8
conversations. Ratios are after / before (TTFT: lower is better; tok/s: higher is better).

    python bench/before_after.py --before 223f54f
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine_line, replace_section, spawn_server
from concurrency import level
from multiturn import conversation


def checkout(rev: str, where: Path) -> Path:
    tree = where / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True)
    (tree / "models" / "cache").symlink_to(ROOT / "models" / "cache", target_is_directory=True)
    return tree


def measure(root: Path, args) -> dict:
    proc, base = spawn_server(["--state-dir", ""], root=root)
    try:
        with httpx.Client(timeout=600) as client:
            rows, _ = conversation(client, base, args.model, "session", None, args)
        eight = asyncio.run(level(base, args.model, 8, argparse.Namespace(**{**vars(args), "turns": args.conc_turns})))
    finally:
        proc.terminate()
        proc.wait(60)
    later = [r["ttft_s"] for r in rows[1:]]
    return {
        "turn_last_ttft_ms": 1000 * rows[-1]["ttft_s"],
        "median_later_ttft_ms": 1000 * statistics.median(later),
        "aggregate_tok_s_8": eight["aggregate_tok_s"],
    }


def render(runs: dict[str, list[dict]], args) -> str:
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    labels = {
        "turn_last_ttft_ms": f"turn-{args.turns} TTFT, ms",
        "median_later_ttft_ms": f"median TTFT of turns 2-{args.turns}, ms",
        "aggregate_tok_s_8": "aggregate tok/s, 8 conversations",
    }
    lines = [
        "## Before and after a change",
        "",
        f"`python bench/before_after.py --before {args.before}` on {machine_line()}, model `{args.model}`: "
        f"{args.rounds} rounds, the two servers alternating; medians. Multi-turn: bench/multiturn.py's session "
        f"conversation ({args.turns} turns, max_tokens {args.max_tokens}); 8 conversations: bench/concurrency.py "
        f"({args.conc_turns} turns each, max_tokens {args.max_tokens}). {time.strftime('%Y-%m-%d')}.",
        "",
        f"| measure | before ({args.before}) | after (this checkout) | after / before |",
        "|---|---:|---:|---:|",
    ]
    for key, label in labels.items():
        before, after = med["before"][key], med["after"][key]
        lines.append(f"| {label} | {before:.1f} | {after:.1f} | {after / before:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the git revision to compare this checkout against")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--conc-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    args.ignore_eos = True
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as scratch:
        tree = checkout(args.before, Path(scratch))
        try:
            for _ in range(args.rounds):
                for name, root in (("before", tree), ("after", ROOT)):
                    runs[name].append(measure(root, args))
                    print(name, json.dumps(runs[name][-1]), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    report = render(runs, args)
    print(report)
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "before_after.json").write_text(json.dumps(runs, indent=1))
    if not args.no_docs:
        replace_section(ROOT / "docs" / "benchmarks.md", "before-after", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

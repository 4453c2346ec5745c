"""Markdown and plot for bench/concurrency.py results."""

from __future__ import annotations

import statistics
import time
from pathlib import Path


def render(out: Path, results: dict, args, machine: str) -> str:
    levels = results["levels"]
    single = next(r for r in levels if r["conversations"] == 1)
    eight = next((r for r in levels if r["conversations"] == 8), None)
    shared, no_cache = results["shared"], results["shared_no_cache"]
    later = shared[1:]
    ratio_shared = statistics.median(r["ttft_s"] for r in later) / statistics.median(r["fresh_ttft_s"] for r in later)
    _plot(out / "concurrency.png", levels)
    lines = [
        "## Concurrency: continuous batching on the paged pool",
        "",
        f"`python bench/concurrency.py` on {machine}, model `{args.model}`, {args.turns} turns per "
        f"conversation, max_tokens {args.max_tokens}, ignore_eos, greedy. {time.strftime('%Y-%m-%d')}.",
        "",
        "| conversations | aggregate tok/s | x single | TTFT p50 ms | TTFT p95 ms | ITL p50 ms "
        "| decode tok/s per stream |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in levels:
        speedup = r["aggregate_tok_s"] / single["aggregate_tok_s"]
        lines.append(
            f"| {r['conversations']} | {r['aggregate_tok_s']:.1f} | {speedup:.2f} | {r['ttft_p50_ms']:.0f} "
            f"| {r['ttft_p95_ms']:.0f} | {r['itl_p50_ms']:.1f} | {r['decode_tok_s_per_stream']:.1f} |"
        )
    lines += [
        "",
        f"- Aggregate tokens/s at 8 conversations / 1: **{eight['aggregate_tok_s'] / single['aggregate_tok_s']:.2f}x**"
        " (target >= 4x)."
        if eight
        else "",
        "",
        f"### {len(shared)} new conversations sharing a {shared[0]['prompt_tokens']}-token system prompt, "
        "one after another",
        "",
        "| # | prompt tok | cached | TTFT ms | TTFT fresh, same new tokens ms | no cache: cached | no cache: TTFT ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, (r, b) in enumerate(zip(shared, no_cache, strict=True)):
        lines.append(
            f"| {i + 1} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_s'] * 1000:.0f} "
            f"| {r['fresh_ttft_s'] * 1000:.0f} | {b['cached_tokens']} | {b['ttft_s'] * 1000:.0f} |"
        )
    lines += [
        "",
        f"- Median TTFT of conversations 2..{len(shared)} / median TTFT of a fresh prompt of only their own tokens: "
        f"**{ratio_shared:.2f}x** (target <= 2x). The no-cache rows bypass every cache (`cache_prompt: false`).",
        "",
        "![aggregate tokens/s and TTFT by concurrency](concurrency.png)",
    ]
    return "\n".join(line for line in lines if line is not None)


def _plot(path: Path, levels: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["conversations"] for r in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.plot(xs, [r["aggregate_tok_s"] for r in levels], "o-")
    left.set_xlabel("concurrent conversations")
    left.set_ylabel("aggregate decode tokens/s")
    left.grid(alpha=0.3)
    right.plot(xs, [r["ttft_p50_ms"] for r in levels], "o-", label="TTFT p50")
    right.plot(xs, [r["ttft_p95_ms"] for r in levels], "o--", label="TTFT p95")
    right.plot(xs, [r["itl_p50_ms"] for r in levels], "x-", label="inter-token p50")
    right.set_xlabel("concurrent conversations")
    right.set_ylabel("ms")
    right.legend()
    right.grid(alpha=0.3)
    fig.suptitle("kvserve: continuous batching (SmolLM2-135M, 2 CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

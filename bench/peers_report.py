"""bench/peers.py's report: the markdown section, the ratio lines and the plot."""

from __future__ import annotations

from pathlib import Path

from peer_servers import label

NOISY = 0.05  # a level during which other processes took more of the CPUs than this is flagged
RATIOS = [  # (what, result key, levels, lower is better)
    ("decode tok/s per stream", "decode_tok_s", (1,), False),
    ("aggregate tok/s", "aggregate_tok_s", (4, 8), False),
    ("cold TTFT (turn 1)", "turn1_ttft_ms", (1,), True),
    ("median TTFT of turns 2..N", "later_ttft_ms", (1, 4, 8), True),
]


def render(results: dict, args) -> str:
    done = {name: r for name, r in results["servers"].items() if "error" not in r}
    first = next(iter(done.values()), None)
    prompt = first["levels"][0]["rows"][0]["prompt_tokens"] if first else "?"
    versions = ", ".join(f"{label(n)} {r['version']}" for n, r in done.items() if r["version"]) or "no versions"
    dtypes = ", ".join(f"{label(n)} {r['dtype']}" for n, r in done.items())
    starts = ", ".join(f"{label(n)} {r['start_s']:.0f} s" for n, r in done.items())
    env = ", ".join(f"`{k}={v}`" for k, v in results["kvserve_env"].items()) or "none"
    lines = [
        "## Side by side: kvserve, vLLM and transformers serve",
        "",
        f"`python bench/peers.py` on {results['machine']}, {results['date']}; {versions}. Each server alone on the "
        f"machine, on the same SmolLM2-135M-Instruct safetensors directory, computing in: {dtypes}. Each "
        f"conversation: {args.turns} streamed chat turns on a {prompt}-token system prompt, {args.max_tokens} tokens "
        "per reply (greedy, EOS ignored); all conversations of a level run at once. kvserve continues each "
        "conversation on its session; vLLM (`--enable-prefix-caching`) and transformers (`--continuous-batching "
        f"--cb-num-blocks {args.hf_blocks}`: its paged cache keeps full blocks for reuse by prefix) are sent the "
        "whole history. A new nonce opens each level's system prompt: turn 1 finds nothing cached. Start to first "
        f"answer: {starts}. KVSERVE_* settings: {env}.",
        "",
        "| server | conversations | decode tok/s per stream | aggregate tok/s | TTFT turn 1 ms "
        f"| TTFT turns 2..{args.turns} ms | cached of prompt, turns 2..{args.turns} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in done.items():
        for level in r["levels"]:
            share = level["later_cached_share"]
            lines.append(
                f"| {label(name)} | {level['conversations']} | {level['decode_tok_s']:.1f} "
                f"| {level['aggregate_tok_s']:.1f} | {level['turn1_ttft_ms']:.0f} | {level['later_ttft_ms']:.0f} "
                f"| {'n/a' if share is None else f'{share:.0%}'} |"
            )
    inexact = {label(n): sum(lv["inexact_replies"] for lv in r["levels"]) for n, r in done.items()}
    noisy = [
        f"{label(n)} at {lv['conversations']} ({lv['others_cpu_share']:.0%})"
        for n, r in done.items()
        for lv in r["levels"]
        if lv["others_cpu_share"] > NOISY
    ]
    lines += [
        "",
        *ratio_lines(done),
        *[f"- {n}: {k} replies not {args.max_tokens} tokens long." for n, k in inexact.items() if k],
        *([f"- Other processes took a share of the CPUs during: {', '.join(noisy)}."] if noisy else []),
    ]
    failed = [
        f"- {label(n)} failed: {r['error'].splitlines()[0]}" for n, r in results["servers"].items() if n not in done
    ]
    return "\n".join(lines + failed).rstrip()


def ratio_lines(done: dict) -> list[str]:
    """Each kvserve run over each peer run, for the metrics and levels in RATIOS that both measured."""
    lines = []
    ours_runs = [n for n in done if n.partition("@")[0] in ("kvserve", "kvserve-compiled")]
    peer_runs = [n for n in done if n.partition("@")[0] in ("vllm", "hf")]
    for what, key, levels, lower in RATIOS:
        parts = []
        for mine in ours_runs:
            ours = {lv["conversations"]: lv for lv in done[mine]["levels"]}
            for peer in peer_runs:
                theirs = {lv["conversations"]: lv for lv in done[peer]["levels"]}
                shared = [n for n in levels if n in ours and n in theirs]
                if shared:
                    ratios = " / ".join(f"**{ours[n][key] / theirs[n][key]:.2f}x**" for n in shared)
                    parts.append(f"{label(mine)} / {label(peer)} {ratios} at {' / '.join(map(str, shared))}")
        if parts:
            lines.append(
                f"- {what} ({'lower' if lower else 'higher'} is better; by conversations): {'; '.join(parts)}."
            )
    return lines


def plot(path: Path, results: dict) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for name, r in results["servers"].items():
        if "error" in r:
            continue
        xs = [lv["conversations"] for lv in r["levels"]]
        left.plot(xs, [lv["aggregate_tok_s"] for lv in r["levels"]], "o-", label=label(name))
        right.plot(xs, [lv["later_ttft_ms"] for lv in r["levels"]], "o-", label=label(name))
    left.set_ylabel("aggregate tokens/s")
    left.set_ylim(bottom=0)
    right.set_ylabel("median TTFT, turns 2..N (ms, log scale)")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xlabel("concurrent conversations")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("kvserve, vLLM and transformers serve (SmolLM2-135M, 2 CPU cores)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

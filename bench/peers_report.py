"""bench/peers.py's report: the markdown section (a table and ratio lines per workload) and the plot."""

from __future__ import annotations

import os
from pathlib import Path

from peer_servers import label

NOISY = 0.05  # a level during which other processes took more of the CPUs than this is flagged
WORKLOADS = {  # name: (title, what its conversations' system prompts are)
    "distinct": (
        "Distinct conversations (each its own system prompt)",
        "every conversation has its own system prompt: a first line naming the conversation and the level's nonce, "
        "then the field guide, so no two conversations share a block of K/V (what users' conversations look like)",
    ),
    "shared": (
        "Conversations sharing one system prompt",
        "all conversations of a level share one system prompt (a line naming the level's nonce, then the field "
        "guide): the best case for prefix caching. kvserve computes it once (and, with deterministic mode off, "
        "reads its K/V once per step for all rows: cascade heads); vLLM's and transformers' caches share its full "
        "blocks",
    ),
}
LEVELS = (1, 4, 8)
RATIOS = [  # (what, result key, lower is better): the targets, each at LEVELS conversations
    ("decode tok/s per stream", "decode_tok_s", False),
    ("aggregate tok/s", "aggregate_tok_s", False),
    ("cold TTFT (turn 1)", "turn1_ttft_ms", True),
    ("median TTFT of turns 2..N", "later_ttft_ms", True),
]


def render(results: dict, args) -> str:
    done = {name: r for name, r in results["servers"].items() if "error" not in r}
    workloads = results["workloads"]
    versions = ", ".join(f"{label(n)} {r['version']}" for n, r in done.items() if r["version"]) or "no versions"
    dtypes = ", ".join(f"{label(n)} {r['dtype']}" for n, r in done.items())
    starts = ", ".join(f"{label(n)} {r['start_s']:.0f} s" for n, r in done.items())
    lines = [
        "## Side by side: kvserve, vLLM and transformers serve",
        "",
        f"`python bench/peers.py` on {results['machine']}, {results['date']}; {versions}. Each server alone on the "
        f"machine, on the same SmolLM2-135M-Instruct safetensors directory, computing in: {dtypes}. "
        f"{kvserve_settings(done, results['kvserve_env'])}Each conversation: {args.turns} streamed chat turns on "
        f"bench/multiturn.py's field guide as system prompt (turn 1's prompt: {prompt_tokens(done, workloads)} "
        f"tokens), {args.max_tokens} tokens per reply (greedy, EOS ignored); all conversations of a level run at "
        "once. kvserve "
        "continues each conversation on its session; vLLM (`--enable-prefix-caching`) and transformers "
        f"(`--continuous-batching --cb-num-blocks {args.hf_blocks}`: its paged cache keeps full blocks for reuse by "
        "prefix) are sent the whole history. Each server ran every workload in one start; a new nonce opens each "
        f"level's system prompts, so turn 1 finds nothing cached. Start to first answer: {starts}. Ratios: kvserve "
        "over vLLM in bf16 (the targets) and over vLLM in kvserve's own dtype where that is another.",
    ]
    for workload in workloads:
        lines += ["", *workload_lines(done, workload, args)]
    failed = [
        f"- {label(n)} failed: {r['error'].splitlines()[0]}" for n, r in results["servers"].items() if n not in done
    ]
    if failed:
        lines += ["", *failed]
    return "\n".join(lines).rstrip()


def kvserve_settings(done: dict, overrides: dict[str, str]) -> str:
    """The sentences naming the deterministic mode each kvserve run reported at load, and the KVSERVE_* settings
    it ran with ("" when no kvserve ran)."""
    modes = "; ".join(f"{label(n)}: {r['deterministic']}" for n, r in done.items() if r.get("deterministic"))
    if not modes:
        return ""
    env = ", ".join(f"`{k}={v}`" for k, v in overrides.items()) or "none (the shipped defaults)"
    return f"Deterministic mode as kvserve reported it at load: {modes}. KVSERVE_* settings: {env}. "


def prompt_tokens(done: dict, workloads: list[str]) -> str:
    """The first turn's prompt tokens (system prompt, template and question) as the first server counted them."""
    first = next(iter(done.values()), None)
    if first is None or not workloads:
        return "?"
    return str(first["workloads"][workloads[0]][0]["rows"][0]["prompt_tokens"])


def workload_lines(done: dict, workload: str, args) -> list[str]:
    title, what = WORKLOADS[workload]
    levels = {name: r["workloads"][workload] for name, r in done.items()}
    lines = [
        f"### {title}",
        "",
        f"`--workloads {workload}`: {what}.",
        "",
        "| server | conversations | decode tok/s per stream | aggregate tok/s | TTFT turn 1 ms "
        f"| TTFT turns 2..{args.turns} ms | cached of prompt, turns 2..{args.turns} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in levels.items():
        for level in runs:
            share = level["later_cached_share"]
            lines.append(
                f"| {label(name)} | {level['conversations']} | {level['decode_tok_s']:.1f} "
                f"| {level['aggregate_tok_s']:.1f} | {level['turn1_ttft_ms']:.0f} | {level['later_ttft_ms']:.0f} "
                f"| {'n/a' if share is None else f'{share:.0%}'} |"
            )
    inexact = {label(n): sum(lv["inexact_replies"] for lv in runs) for n, runs in levels.items()}
    noisy = [
        f"{label(n)} at {lv['conversations']} ({lv['others_cpu_share']:.0%})"
        for n, runs in levels.items()
        for lv in runs
        if lv["others_cpu_share"] > NOISY
    ]
    return [
        *lines,
        "",
        *ratio_lines(done, levels),
        *[f"- {n}: {k} replies not {args.max_tokens} tokens long." for n, k in inexact.items() if k],
        *([f"- Other processes took a share of the CPUs during: {', '.join(noisy)}."] if noisy else []),
    ]


def ratio_pairs(done: dict) -> list[tuple[str, str]]:
    """(kvserve run, vLLM run): each kvserve run over vLLM in bf16, and over vLLM in its own dtype if another."""
    ours = [n for n in done if n.partition("@")[0] in ("kvserve", "kvserve-compiled")]
    vllm = [n for n in done if n.partition("@")[0] == "vllm"]
    return [(m, p) for m in ours for p in vllm if done[p]["dtype"] in ("bfloat16", done[m]["dtype"])]


def ratio_lines(done: dict, levels: dict[str, list[dict]]) -> list[str]:
    """For each metric in RATIOS, each pair's ratios at the LEVELS both measured in this workload."""
    lines = []
    for what, key, lower in RATIOS:
        parts = []
        for mine, peer in ratio_pairs(done):
            ours = {lv["conversations"]: lv for lv in levels[mine]}
            theirs = {lv["conversations"]: lv for lv in levels[peer]}
            shared = [n for n in LEVELS if n in ours and n in theirs]
            if shared:
                ratios = " / ".join(f"**{ours[n][key] / theirs[n][key]:.2f}x**" for n in shared)
                parts.append(f"{label(mine)} / {label(peer)} {ratios} at {' / '.join(map(str, shared))}")
        if parts:
            lines.append(
                f"- {what} ({'lower' if lower else 'higher'} is better; by conversations): {'; '.join(parts)}."
            )
    return lines


def plot(path: Path, results: dict) -> bool:
    """Aggregate tok/s and median TTFT of turns 2..N by concurrency: a row of two panels per workload, the same
    y axes down each column."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = results["workloads"]
    fig, axes = plt.subplots(len(workloads), 2, figsize=(9, 0.6 + 3.2 * len(workloads)), sharey="col", squeeze=False)
    for (left, right), workload in zip(axes, workloads, strict=True):
        for name, r in results["servers"].items():
            if "error" in r:
                continue
            runs = r["workloads"][workload]
            xs = [lv["conversations"] for lv in runs]
            left.plot(xs, [lv["aggregate_tok_s"] for lv in runs], "o-", label=label(name))
            right.plot(xs, [lv["later_ttft_ms"] for lv in runs], "o-", label=label(name))
        left.set_title(WORKLOADS[workload][0], fontsize=10, loc="left")
        left.set_ylabel("aggregate tokens/s")
        left.set_ylim(bottom=0)
        right.set_ylabel("median TTFT, turns 2..N\n(ms, log scale)")
        right.set_yscale("log")
        for ax in (left, right):
            ax.set_xlabel("concurrent conversations")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"kvserve, vLLM and transformers serve (SmolLM2-135M, {os.cpu_count()} CPU cores)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

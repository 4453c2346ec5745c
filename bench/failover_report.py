"""bench/failover.py's report: the markdown section of docs/benchmarks.md and docs/failover.png."""

from __future__ import annotations

import time
from pathlib import Path

from common import machine_line

IN_FLIGHT = 6  # requests at once
MAX_TOKENS = 16  # per turn


def report(s: dict, args) -> str:
    ratio_recompute = s["shared_ttft_ms"] / s["recompute_ttft_ms"]
    ratio_device = s["shared_ttft_ms"] / s["device_ttft_ms"]
    bytes_ratio = s["redis_bytes"] / s["distinct_bytes"]
    rows = [
        ("completed turns lost", f"{s['lost']}", "0"),
        ("turns token-identical to the reference", f"{s['identical']} of {s['compared']}", "all"),
        ("TTFT restored from Redis / recomputing it", f"{ratio_recompute:.2f}", "<= 0.3"),
        ("TTFT restored from Redis / a local device hit", f"{ratio_device:.2f}", "<= 3"),
        ("turns 2+ from the home replica's device blocks (nothing dies)", f"{100 * s['affinity']:.1f}%", ">= 99%"),
        ("Redis bytes / bytes of the distinct tokens", f"{bytes_ratio:.2f}", "< 1.2"),
    ]
    lines = [
        "## Failover: a replica SIGKILLed, its sessions continue elsewhere from Redis",
        "",
        f"`python bench/failover.py` on {machine_line()}, {time.strftime('%Y-%m-%d')}: 3 replicas of the default "
        f"model ({args.dtype}, one thread each), nginx (docker/scale config), one redis-server, all on loopback; "
        f"{args.sessions} sessions opening with one shared system prompt plus their own case "
        f"({s['history_tokens']:.0f} tokens), "
        f"{args.turns} turns of {MAX_TOKENS} tokens each, greedy, {IN_FLIGHT} in flight. Replica {s['victim']} was "
        f"SIGKILLed after {s['kill_after']} turns of the failover run, {s['in_flight_at_kill']} turns in flight. "
        f"The client sent {s['turns_resent']} turns again ({s['resends']} resends: {s['resends_broken']} after a "
        f"stream or connection broke, {s['resends_busy']} after a 409 `session_busy` while the dead replica's lease "
        f"lasted), every one a turn in flight at the kill, {s['status_502']} answered 502; nginx passed "
        f"{s['nginx_passed_on']} requests the dead replica failed on to the next one.",
        "",
        "| what | measured | target |",
        "|---|---:|---:|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
        f"Medians: a device hit {s['device_ttft_ms']:.0f} ms, a turn restored from Redis {s['shared_ttft_ms']:.0f} ms "
        f"({s['num_restored']} turns, {s['shared_cached']:.0f} of {s['shared_prompt']:.0f} prompt tokens restored), "
        f"the same prompts recomputed {s['recompute_ttft_ms']:.0f} ms. Redis held {s['redis_bytes'] / 2**20:.1f} MiB "
        f"of K/V blocks for {s['distinct_bytes'] / 2**20:.1f} MiB of distinct tokens (only full blocks are stored). "
        "float32, not the bf16 this CPU would pick: in bf16 a prompt computed in other chunks (a cached system "
        "prompt, other batch neighbours) can flip a greedy token by itself, failover or not (seen: 3 of 18 turns "
        "of one session in a bf16 trial run). The quiet stretch after the kill: turns that were in flight on the "
        "dead replica answer 409 until its leases expire (`KVSERVE_SHARED_LEASE_S`, 15 s), and each round of turns "
        "waits for its last conversation.",
        "",
        "![failover](failover.png)",
    ]
    return "\n".join(lines)


def plot(path: Path, reference, failover, restored, recompute, killed_at: float, victim: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    device = [1000 * r["ttft_s"] for c in reference for r in c.rows[1:] if r["source"] == "device"]
    shared = [1000 * r["ttft_s"] for _, r in restored]
    groups = [("device hit", device), ("from Redis", shared), ("recomputed", [1000 * t for t in recompute])]
    left.boxplot([g for _, g in groups], tick_labels=[n for n, _ in groups])
    left.set_ylabel("time to first token (ms)")
    left.set_title("TTFT by where the K/V came from")
    colors = {"r1": "tab:blue", "r2": "tab:orange", "r3": "tab:green"}
    for conv in failover:
        for row in conv.rows:
            marker = "*" if row["source"] == "shared" else "o"
            right.scatter(row["at"], 1000 * row["ttft_s"], c=colors.get(row["replica"], "k"), marker=marker, s=18)
    right.axvline(killed_at, color="red", linestyle="--", label=f"{victim} SIGKILLed")
    right.set_xlabel("seconds into the failover run")
    right.set_ylabel("time to first token (ms)")
    right.set_title("failover run, by replica (* restored from Redis)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)

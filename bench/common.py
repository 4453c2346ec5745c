"""Helpers shared by the bench scripts: spawn a server, HF generate() baseline, markdown/plot output."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
HEADER = (
    "# Benchmarks\n\nEach section is written by its script in bench/, measured side by side in one run on a "
    "shared, noisy 2-core machine: read the ratios, not the absolute numbers.\n"
)


def sse_event(line: str) -> dict | None:
    """One streamed JSON event (None for [DONE], pings, blank lines); an error event raises."""
    if not line.startswith("data: {"):
        return None
    event = json.loads(line[6:])
    if "error" in event:
        raise RuntimeError(event["error"])
    return event


def event_text(event: dict) -> str:
    """The text an OpenAI chat or completion chunk carries."""
    return "".join(c.get("delta", {}).get("content") or c.get("text") or "" for c in event.get("choices", []))


class StreamTimer:
    """Reads one streamed chat or completion: its text, usage, first-token time and the time of each piece."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.stamps: list[float] = []
        self.text = ""
        self.usage: dict | None = None

    def feed(self, line: str) -> None:
        event = sse_event(line)
        if event is None:
            return
        self.usage = event.get("usage") or self.usage
        piece = event_text(event)
        if piece:
            self.stamps.append(time.perf_counter())
            self.text += piece

    def result(self) -> dict:
        usage, stamps = self.usage or {}, self.stamps
        completion = usage.get("completion_tokens", len(stamps))
        decode_s = stamps[-1] - stamps[0] if len(stamps) > 1 else float("nan")
        return {
            "text": self.text,
            "ttft_s": (stamps[0] if stamps else time.perf_counter()) - self.start,
            "gaps": [b - a for a, b in itertools.pairwise(stamps)],
            "decode_tok_s": (completion - 1) / decode_s if completion > 1 else float("nan"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "completion_tokens": completion,
        }


def spawn_server(
    extra_args: list[str] | None = None,
    env: dict | None = None,
    root: Path = ROOT,
    log: Path | None = None,
    own_group: bool = False,
) -> tuple[subprocess.Popen, str]:
    """`kvserve serve` from the source tree at `root` (another checkout for before/after runs) on a free port.

    Its output goes to `log` when given, else to this process's stdout and stderr. `own_group`: the leader of a
    new process group, which the caller ends whole (and which Ctrl-C in the terminal does not reach).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "server", "serve", "--port", str(port), "--log-level", "warning"]
    with open(log, "w") if log else contextlib.nullcontext() as out:
        proc = subprocess.Popen(
            cmd + (extra_args or []),
            cwd=root,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=own_group,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("server exited during start-up")
            try:
                if httpx.get(base + "/ready").status_code == 200:
                    return proc, base + "/v1"
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server not ready in time")
    except BaseException:  # not ready, or Ctrl-C meanwhile: the caller never gets it, so it goes here
        if own_group and proc.returncode is None:  # not reaped, so its id is still its group's
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait(30)
        raise


def hf_decode_rate(args, prompts: list[list[dict]], num_tokens: int, repeats: int = 3) -> float | None:
    """Median decode tokens/s of HF generate() in this process on the same prompts: (N-1) / (T(N) - T(1))."""
    import torch

    from server.models.loader import ModelSpec, load_model, read_specs

    if args.hf_model_dir:
        spec = ModelSpec(id="hf", source=args.hf_model_dir)
    else:
        specs = {s.id: s for s in read_specs(ROOT / "models" / "models.toml")}
        if args.model not in specs:
            return None
        spec = specs[args.model]
    loaded = load_model(spec, ROOT / "models" / "cache")

    def timed(ids, n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            loaded.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    rates = []
    for messages in prompts:
        text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([loaded.tokenizer(text, add_special_tokens=False)["input_ids"]])
        timed(ids, 2)  # warm-up
        rates += [(num_tokens - 1) / (timed(ids, num_tokens) - timed(ids, 1)) for _ in range(repeats)]
    return statistics.median(rates)


def drop_page_cache(path: Path) -> None:
    """Make the next read of `path` come from the disk, not the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def machine_line() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def new_results(args, **fields: object) -> dict:
    """A side-by-side run's record: when, where, its arguments and `fields`, its servers to come, and the load
    average at the start (said aloud when the machine is busy)."""
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine_line(),
        "args": vars(args),
        **fields,
        "servers": {},
        "load_before": os.getloadavg()[0],
    }
    if results["load_before"] > 0.5:
        print(f"load average {results['load_before']:.1f} at the start: the machine is busy, numbers may be noisy")
    return results


def run_servers(results: dict, names: list[str], bench_one: Callable[[str], dict]) -> bool:
    """Each server's results under results["servers"] (a server that fails: its error, and the others still
    run), the time it all took under results["total_s"]; True where every server ran."""
    start = time.perf_counter()
    for name in names:
        try:
            results["servers"][name] = bench_one(name)
        except (RuntimeError, httpx.HTTPError) as e:
            print(f"{name} failed: {e}", file=sys.stderr, flush=True)
            results["servers"][name] = {"error": str(e)}
    results["total_s"] = time.perf_counter() - start
    return not any("error" in r for r in results["servers"].values())


def save_results(results: dict, stem: str, section: str) -> Path:
    """The raw results as bench/results/STEM-<date>.json, and the rendered section printed with where they are."""
    out_json = ROOT / "bench" / "results" / f"{stem}-{time.strftime('%Y-%m-%d-%H%M')}.json"
    out_json.parent.mkdir(exist_ok=True)
    out_json.write_text(json.dumps(results, indent=1))
    print(f"\n{section}\n\nraw results: {out_json}; {results['total_s']:.0f} s in all")
    return out_json


def replace_section(path: Path, name: str, body: str) -> None:
    """Rewrite one marked section of a markdown file, keeping the rest."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else HEADER
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def render_report(out: Path, session_rows, baseline_rows, fresh_rows, summary, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    plot = out / "multiturn_ttft.png"
    _plot(plot, session_rows, baseline_rows, fresh_rows)
    lines = [
        "## Multi-turn conversation: session vs no session",
        "",
        f"`python bench/multiturn.py{' --spawn' if args.spawn else ''}` on {machine_line()}, "
        f"model `{args.model}`, {args.turns} turns, max_tokens {args.max_tokens}"
        f"{', ignore_eos' if args.ignore_eos else ''}, greedy. {time.strftime('%Y-%m-%d')}.",
        "",
        "| turn | prompt tok | cached (session) | TTFT session ms | TTFT no session ms | cached (no session) "
        "| TTFT fresh, same new tokens ms | decode tok/s session | decode tok/s no session |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s, b, f in zip(session_rows, baseline_rows, fresh_rows, strict=True):
        lines.append(
            f"| {s['turn']} | {s['prompt_tokens']} | {s['cached_tokens']} | {s['ttft_s'] * 1000:.1f} "
            f"| {b['ttft_s'] * 1000:.1f} | {b['cached_tokens']} | {f['ttft_s'] * 1000:.1f} "
            f"| {s['decode_tok_s']:.1f} | {b['decode_tok_s']:.1f} |"
        )
    hf = summary["hf_generate_decode_tok_s"]
    ratio = summary["server_over_hf_decode"]
    lines += [
        "",
        f"- Turn {args.turns} TTFT, no session / session: **{summary['turn_last_ttft_speedup']:.1f}x** (target >= 5x).",
        "- Median TTFT of turns 2..N with a session / median TTFT of a fresh stateless prompt of as many tokens as "
        f"the session computed: **{summary['median_later_ttft_over_fresh_new_tokens']:.2f}x** (target <= 2x).",
        f"- Decode, median over all turns of both runs: server {summary['server_decode_tok_s']:.1f} tok/s over "
        "HTTP/SSE; "
        + (
            f"HF `generate()` in-process on the first and last turns' prompts (median of 6) {hf:.1f} tok/s: "
            f"**{ratio:.2f}x** (target >= 0.9x)."
            if hf
            else "HF comparison skipped (model not local)."
        ),
        "",
        f"![TTFT per turn]({plot.name})",
    ]
    replace_section(out / "benchmarks.md", "multiturn", "\n".join(lines))


def _plot(path: Path, session_rows, baseline_rows, fresh_rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r["turn"] for r in session_rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(turns, [r["ttft_s"] * 1000 for r in baseline_rows], "o-", label="no session (full prompt)")
    ax.plot(turns, [r["ttft_s"] * 1000 for r in session_rows], "o-", label="session (cached K/V)")
    ax.plot(turns, [r["ttft_s"] * 1000 for r in fresh_rows], "x--", label="fresh prompt, same new tokens")
    ax.set_xlabel("turn")
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (ms, log scale)")
    ax.set_title("kvserve: TTFT per turn")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Decode speed by context length: kvserve and vLLM (bf16) at one stream, prompts of 32 to 8,192 tokens.

Each server is started alone on the default model with bench/peer_servers.py's starters (kvserve on its shipped
defaults; vLLM from its own venv, `--max-model-len` the model's 8,192 tokens), answers one short warm-up request,
then runs every length, and is stopped before the next one starts. Per length, `--repeats` streamed
/v1/completions requests, one after another: the prompt is bench/multiturn.py's field guide, repeated and cut to
exactly that many token ids (the model's own tokenizer, from the models/cache directory vLLM loads; both servers
are sent the same ids), opened by a line with a new nonce, so that no request finds any of its prompt cached;
`--max-tokens` tokens out (greedy, `ignore_eos`: every reply is exactly that long). Decode tok/s of a request is
(tokens - 1) / (time of its last token - time of its first); the table has the median over the repeats, each
server's rate over its own rate at the first (shortest) length, kvserve's rate over vLLM's, and the median time
to first token (the prefill of the whole prompt, no cache) as a secondary column.

The prompt and the reply must fit the context: a length is cut to the server's context (GET /v1/models,
`max_model_len`) minus `--max-tokens`, and the run says so. The default model's context is 8,192 tokens in
models/models.toml and in its config, and kvserve refuses a prompt of 8,192 plus 128 tokens out
(context_length_exceeded), so the last length measured is 8,064 by default.

Prints the table; writes it to docs/benchmarks.md between `<!-- decode-context:begin -->` and
`<!-- decode-context:end -->` unless --no-write, and the raw results to bench/results/decode-context-<date>.json.
Each server's output goes to /tmp/decode-context-<server>.log. vLLM's venv: see bench/peers.py.

    python bench/decode_context.py                                   # kvserve and vLLM bf16, writes the docs
    python bench/decode_context.py --servers kvserve --no-write
    python bench/decode_context.py --lengths 32,512 --max-tokens 16 --repeats 1 --no-write    # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, StreamTimer, new_results, replace_section, run_servers, save_results
from multiturn import system_prompt
from peer_servers import STARTERS, Server, greedy_stream, kvserve_overrides, label, model_dir, stop
from peers import cpu_ticks
from peers_report import NOISY, kvserve_settings

SERVERS = ("kvserve", "kvserve-compiled", "vllm")  # those with /v1/completions and ignore_eos


class Prompts:
    """Token ids of the field guide, repeated as far as needed, behind a line with a new nonce each time."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir()))
        self.text: list[int] = self.ids(system_prompt())

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def make(self, length: int) -> list[int]:
        ids = self.ids(f"Document {uuid.uuid4().hex}.\n")
        separator = self.ids("\n\n")
        while len(ids) < length:
            ids += self.text + separator
        return ids[:length]


def max_context(server: Server) -> int | None:
    """The server's context in tokens, as its GET /v1/models says (both kvserve and vLLM name it max_model_len)."""
    models = httpx.get(f"{server.base}/models", timeout=30).json()["data"]
    return next((m.get("max_model_len") for m in models if m["id"] == server.model), None)


def complete(client: httpx.Client, server: Server, ids: list[int], max_tokens: int) -> dict:
    body = greedy_stream(server, max_tokens, prompt=ids)  # with ignore_eos
    timer = StreamTimer()
    with client.stream("POST", "/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.name} answered {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            timer.feed(line)
    row = timer.result()
    row["pieces"] = len(row.pop("gaps")) + 1  # streamed events that carried text: one per token, if none batched
    return row


def fitted(lengths: list[int], context: int | None, max_tokens: int) -> dict[int, int]:
    """Each length, cut where the prompt and `max_tokens` more fill the context."""
    return {n: n if context is None else min(n, context - max_tokens) for n in lengths}


def bench_server(entry: str, lengths: list[int], prompts: Prompts, args) -> dict:
    name, _, dtype = entry.partition("@")
    log = Path(f"/tmp/decode-context-{entry}.log")
    print(f"{entry}: starting (output in {log})", flush=True)
    server = STARTERS[name](args, log, dtype or None)
    try:
        context = max_context(server)
        cuts = fitted(lengths, context, args.max_tokens)
        for n, cut in cuts.items():
            if cut != n:
                print(
                    f"{entry}: its context, {context} tokens, holds {n} + {args.max_tokens} tokens out only up to "
                    f"{cut} prompt tokens: measuring {cut} for {n}",
                    flush=True,
                )
        groups = {os.getpgrp(), os.getpgid(server.proc.pid)}
        busy, ours = cpu_ticks(groups)
        start = time.perf_counter()
        with httpx.Client(base_url=server.base, timeout=600) as client:
            complete(client, server, prompts.make(32), 4)  # warm-up
            results = {}
            for n, cut in cuts.items():
                rows = [complete(client, server, prompts.make(cut), args.max_tokens) for _ in range(args.repeats)]
                results[str(n)] = summarise(rows, cut, args.max_tokens)
                print(f"{entry}: {progress_line(results[str(n)])}", flush=True)
        wall = time.perf_counter() - start
        busy_after, ours_after = cpu_ticks(groups)
        others_s = (busy_after - busy - (ours_after - ours)) / os.sysconf("SC_CLK_TCK")
    finally:
        stop(server)
    return {
        "version": server.version,
        "dtype": server.dtype,
        "deterministic": server.deterministic,
        "max_model_len": context,
        "others_cpu_share": max(0.0, others_s / (wall * (os.cpu_count() or 1))),
        "lengths": results,
    }


def summarise(rows: list[dict], length: int, max_tokens: int) -> dict:
    return {
        "prompt_tokens": length,
        "reported_prompt_tokens": sorted({r["prompt_tokens"] for r in rows}, key=str),
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rows),
        "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in rows),
        "inexact_replies": sum(r["completion_tokens"] != max_tokens for r in rows),
        "fewer_pieces": sum(r["pieces"] < r["completion_tokens"] for r in rows),
        "rows": [{k: v for k, v in r.items() if k != "text"} for r in rows],
    }


def progress_line(level: dict) -> str:
    inexact = level["inexact_replies"]
    return (
        f"{level['prompt_tokens']} prompt tokens: decode {level['decode_tok_s']:.1f} tok/s, TTFT "
        f"{level['ttft_ms']:.0f} ms" + (f", {inexact} replies not as long as asked" if inexact else "")
    )


def render(results: dict, args) -> str:
    done = {name: r for name, r in results["servers"].items() if "error" not in r}
    lengths = [str(n) for n in results["lengths"]]
    versions = ", ".join(f"{label(n)} {r['version']}" for n, r in done.items() if r["version"]) or "no versions"
    dtypes = ", ".join(f"{label(n)} {r['dtype']}" for n, r in done.items())
    pairs = [(m, p) for m in done if m.partition("@")[0] != "vllm" for p in done if p.partition("@")[0] == "vllm"]
    first = lengths[0] if lengths else "?"
    lines = [
        "## Decode speed by context length: kvserve and vLLM",
        "",
        f"`python bench/decode_context.py` on {results['machine']}, {results['date']}; {versions}. Each server alone "
        f"on the machine, computing in: {dtypes}. {kvserve_settings(done, results['kvserve_env'])}One "
        f"stream: per length, {args.repeats} "
        "streamed /v1/completions requests one after another, each a new prompt (a nonce line, then bench/"
        "multiturn.py's field guide repeated, cut to the length in the model's tokens: nothing cached), "
        f"{args.max_tokens} tokens out (greedy, EOS ignored). Decode tok/s: (tokens - 1) / (last token's time - first "
        f"token's time), median over the requests; 'at N / at {first}': a server's rate over its own at {first} "
        "tokens. TTFT: the whole prompt's prefill, median.",
        "",
        "| prompt tokens | "
        + " | ".join(f"{label(n)} tok/s" for n in done)
        + "".join(f" | {label(m)} / {label(p)}" for m, p in pairs)
        + "".join(f" | {label(n)} at N / at {first}" for n in done)
        + "".join(f" | {label(n)} TTFT ms" for n in done)
        + " |",
        "|" + "---:|" * (1 + 3 * len(done) + len(pairs)),
    ]
    for n in lengths:
        runs = {name: r["lengths"][n] for name, r in done.items() if n in r["lengths"]}
        if len(runs) < len(done):
            continue
        tokens = " / ".join(sorted({str(lv["prompt_tokens"]) for lv in runs.values()}))
        cells = [tokens, *(f"{lv['decode_tok_s']:.1f}" for lv in runs.values())]
        cells += [f"**{runs[m]['decode_tok_s'] / runs[p]['decode_tok_s']:.2f}x**" for m, p in pairs]
        cells += [
            f"{lv['decode_tok_s'] / done[name]['lengths'][first]['decode_tok_s']:.2f}" for name, lv in runs.items()
        ]
        cells += [f"{lv['ttft_ms']:.0f}" for lv in runs.values()]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        f"- {label(name)}: asked for {n} prompt tokens, measured {lv['prompt_tokens']}: its context, "
        f"{r['max_model_len']} tokens, holds no more with {args.max_tokens} tokens out (context_length_exceeded)."
        for name, r in done.items()
        for n, lv in r["lengths"].items()
        if lv["prompt_tokens"] != int(n)
    ]
    notes += [
        f"- {label(name)}: the server counted {lv['reported_prompt_tokens']} prompt tokens for {lv['prompt_tokens']}."
        for name, r in done.items()
        for lv in r["lengths"].values()
        if lv["reported_prompt_tokens"] != [lv["prompt_tokens"]]
    ]
    notes += [
        f"- {label(name)}: {sum(lv['inexact_replies'] for lv in r['lengths'].values())} replies not "
        f"{args.max_tokens} tokens long."
        for name, r in done.items()
        if any(lv["inexact_replies"] for lv in r["lengths"].values())
    ]
    notes += [
        f"- {label(name)}: {sum(lv['fewer_pieces'] for lv in r['lengths'].values())} replies came in fewer text "
        "events than tokens (a token with no text of its own, or tokens sent together; the rate counts tokens)."
        for name, r in done.items()
        if any(lv["fewer_pieces"] for lv in r["lengths"].values())
    ]
    noisy = [f"{label(n)} ({r['others_cpu_share']:.0%})" for n, r in done.items() if r["others_cpu_share"] > NOISY]
    if noisy:
        notes.append(f"- Other processes took a share of the CPUs during: {', '.join(noisy)}.")
    notes += [
        f"- {label(n)} failed: {r['error'].splitlines()[0]}" for n, r in results["servers"].items() if n not in done
    ]
    return "\n".join(lines + (["", *notes] if notes else [])).rstrip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--servers",
        default="kvserve,vllm@bfloat16",
        help=f"any of {', '.join(SERVERS)}, comma-separated; NAME@DTYPE computes in that dtype",
    )
    parser.add_argument("--lengths", default="32,512,1024,2048,4096,8192", help="prompt tokens, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="requests per length (the median is reported)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="kvserve's model id, vLLM's served name")
    parser.add_argument("--no-write", action="store_true", help="print the table; leave docs/ as it is")
    parser.add_argument("--vllm-python", default="/work/peers/vllm-venv/bin/python")
    parser.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's dtype where --servers names none")
    parser.add_argument("--vllm-max-model-len", type=int, default=8192, help="the model's own context")
    parser.add_argument("--vllm-deadline", type=float, default=900, help="seconds; its first start compiles")
    parser.add_argument("--kvserve-args", default="", help='extra `kvserve serve` flags: --kvserve-args="--flag v"')
    parser.add_argument("--vllm-args", default="", help='extra `vllm serve` flags: --vllm-args="--flag v"')
    parser.add_argument("--out", default=str(ROOT / "docs"))
    args = parser.parse_args()
    names = args.servers.split(",")
    if unknown := {n.partition("@")[0] for n in names} - set(SERVERS):
        parser.error(f"unknown servers: {', '.join(sorted(unknown))}")
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.repeats < 1 or args.max_tokens < 2 or min(lengths) < 1:
        parser.error("--repeats at least 1, --max-tokens at least 2 (a rate needs two tokens), lengths at least 1")
    args.vllm_args = f"--max-model-len {args.vllm_max_model_len} {args.vllm_args}"
    results = new_results(args, lengths=lengths, kvserve_env=kvserve_overrides())
    prompts = Prompts()
    failed = not run_servers(results, names, lambda name: bench_server(name, lengths, prompts, args))
    section = render(results, args)
    save_results(results, "decode-context", section)
    if failed:
        print("a server failed: docs/ left as it is", file=sys.stderr)
    elif not args.no_write:
        replace_section(Path(args.out) / "benchmarks.md", "decode-context", section)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""What deterministic mode costs: prefill, decode and aggregate throughput with it off and on, side by side.

python bench/deterministic.py [--dtype bfloat16] [--rounds 3] [--no-docs]

In-process on the default model (in --dtype: default the one `dtype: auto` picks here), one engine per mode
over its own copy of the model, the same prompts for both, rounds alternating off and on (medians):

- prefill: three prompts of --prefill tokens (distinct), one after another, one output token each: prompt
  tokens per second from submit to the end (the round's median).
- decode: one conversation (a --history-token prompt), 128 new tokens: tokens per second after the first.
- aggregate: --conversations conversations at once (distinct --history-token prompts), 64 new tokens each:
  tokens decoded after the last one's first token, per second.
- a long context: one conversation with a --long-token prompt decoding 64 tokens (the mode sends every row
  to the kernel, where cascade heads or SDPA would take long rows).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import GenerationRequest, SamplingParams
from server.kv.tiers import TierStore
from server.models.loader import load_model, read_specs
from server.sessions.store import SessionStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine_line, replace_section
from kv_dtype import distinct_ids, generate

MODES = ("off", "on")


def new_engine(loaded, deterministic: bool, budget: int) -> Engine:
    tiers = TierStore(0, 0, None, block_size=16)
    store = SessionStore(ttl_s=3600, forgetters=(tiers,))
    config = EngineConfig(budget_bytes=budget, block_size=16, max_batch_tokens=256, deterministic=deterministic)
    engine = Engine(loaded, store, tiers, config)
    engine.start()
    return engine


async def prefill(engine: Engine, prompt: list[int], rid: str) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    handle = engine.submit(GenerationRequest(request_id=rid, prompt_ids=prompt, params=params, use_cache=False))
    async for _ in handle:
        pass
    return len(prompt) / (time.perf_counter() - started)


async def one_round(engines: dict[str, Engine], loaded, args, r: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {m: {} for m in MODES}
    order = MODES if r % 2 == 0 else MODES[::-1]
    long_prompt = distinct_ids(loaded, args.long, 900 + r)
    for mode in order:
        e = engines[mode]
        rates = [await prefill(e, distinct_ids(loaded, args.prefill, 300 + 10 * r + i), f"p{r}-{i}") for i in range(3)]
        out[mode]["prefill_tok_s"] = statistics.median(rates)
        first, last = await generate(e, distinct_ids(loaded, args.history, 400 + r), 128, f"d{r}")
        out[mode]["decode_tok_s"] = 127 / (last - first)
        prompts = [distinct_ids(loaded, args.history, 500 + 10 * r + i) for i in range(args.conversations)]
        runs = await asyncio.gather(*(generate(e, p, 64, f"a{r}-{i}") for i, p in enumerate(prompts)))
        all_started, end = max(x[0] for x in runs), max(x[1] for x in runs)
        tokens = sum(63 * max(0.0, min(1.0, (x[1] - all_started) / (x[1] - x[0]))) for x in runs if x[1] > x[0])
        out[mode]["aggregate_tok_s"] = tokens / (end - all_started)
        first, last = await generate(e, long_prompt, 64, f"l{r}")
        out[mode]["long_decode_tok_s"] = 63 / (last - first)
    return out


async def measure(models: dict[str, object], args) -> dict:
    token_bytes = 2 * 30 * 3 * 64 * 4  # the default model's K/V a token, at most (fp32)
    budget = (args.conversations * (args.history + 80) + args.long + args.prefill + 512) * token_bytes
    engines = {m: new_engine(models[m], m == "on", budget) for m in MODES}
    try:
        for m in MODES:
            await generate(engines[m], distinct_ids(models[m], 64, 1), 4, "warm")
        rounds = [await one_round(engines, models["off"], args, r) for r in range(args.rounds)]
        detail = engines["on"].runner.deterministic_detail
    finally:
        for e in engines.values():
            e.stop()
    medians = {m: {k: statistics.median(x[m][k] for x in rounds) for k in rounds[0][m]} for m in MODES}
    return {"rounds": rounds, "median": medians, "detail": detail}


def report(results: dict, args, dtype: torch.dtype) -> str:
    off, on = results["median"]["off"], results["median"]["on"]
    rows = [
        ("prefill", f"{args.prefill}-token prompt, tok/s", "prefill_tok_s"),
        ("decode, 1 conversation", f"{args.history}-token prompt, tok/s", "decode_tok_s"),
        (f"aggregate, {args.conversations} conversations", f"{args.history}-token prompts, tok/s", "aggregate_tok_s"),
        ("decode, long context", f"{args.long}-token prompt, tok/s", "long_decode_tok_s"),
    ]
    lines = [
        "## Deterministic mode: its price",
        "",
        f"`python bench/deterministic.py --rounds {args.rounds}` ({machine_line()}), the default model in "
        f"{str(dtype).removeprefix('torch.')}, in process, the mode off and on side by side (medians of "
        f"{args.rounds} rounds, alternating). The mode here: {results['detail']}.",
        "",
        "| measure | workload | off | on | on / off |",
        "|---|---|---:|---:|---:|",
    ]
    for name, workload, key in rows:
        lines.append(f"| {name} | {workload} | {off[key]:.1f} | {on[key]:.1f} | {on[key] / off[key]:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default=None, help="the compute dtype (default: what dtype: auto picks)")
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--history", type=int, default=256)
    parser.add_argument("--long", type=int, default=2000)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    spec = read_specs(ROOT / "models" / "models.toml")[0]
    if args.dtype:
        spec = dataclasses.replace(spec, dtype=args.dtype)
    models = {m: load_model(spec, ROOT / "models" / "cache") for m in MODES}  # the mode sets the model's layers
    results = asyncio.run(measure(models, args))
    out = ROOT / "bench" / "results" / "deterministic.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    text = report(results, args, models["on"].dtype)
    print(text)
    if not args.no_docs:
        replace_section(ROOT / "docs" / "benchmarks.md", "deterministic", text)


if __name__ == "__main__":
    main()

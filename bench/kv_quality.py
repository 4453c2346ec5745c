"""What a quantized K/V costs in quality, per K/V dtype: greedy agreement and perplexity, on real models and text.

python bench/kv_quality.py --corpus FILE [--models ID_OR_SOURCE,...] [--turns 240] [--no-docs]

For each model (the default one, and any other given as a models.toml id or a `package:` / path source):

- greedy agreement: --turns passages of the corpus (--prompt tokens each, from evenly spread offsets)
  are continued greedily for --new tokens by the engine with each K/V dtype (the real pool, kernel and
  prefill paths, 8 turns at a time); per quantized dtype, the share of turns whose tokens equal the
  compute-dtype K/V's, and the share of all tokens generated before a turn's first difference.
- perplexity: the corpus (its first --ppl-tokens tokens, in windows of --window) scored teacher-forced,
  every key and value rounded through the K/V dtype (server/kv/pool.py's quantize, then dequantize)
  before attention, as the pool stores and the attention reads them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import Finished, GenerationRequest, SamplingParams, TextDelta
from server.kv.pool import KV_DTYPES, KVLayout, dequantize, quantize
from server.kv.tiers import TierStore
from server.models.loader import LoadedModel, ModelSpec, load_model, read_specs
from server.sessions.store import SessionStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine_line, replace_section

FAKE = "kvserve_rounded_kv"
ROUNDING: dict[str, torch.dtype | None] = {"kv": None}  # the K/V dtype the rounded attention uses now


def rounded_attention(module: torch.nn.Module, query, key, value, attention_mask, **kwargs: Any):
    """SDPA over keys and values rounded through the K/V dtype (per token and head, as the pool stores them)."""
    kv = ROUNDING["kv"]
    if kv is not None:
        key, value = dequantize(quantize(key, kv), key.dtype), dequantize(quantize(value, kv), value.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def spec_of(name: str) -> ModelSpec:
    specs = {s.id: s for s in read_specs(ROOT / "models" / "models.toml")}
    if name in specs:
        return specs[name]
    ident = Path(name.removeprefix("package:")).name.removesuffix(".gguf")
    return ModelSpec(id=ident, source=name, base_dir=str(ROOT / "models"))


async def continue_all(engine: Engine, prompts: list[list[int]], num_new: int, at_once: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
        handle = engine.submit(GenerationRequest(request_id=f"q{i}", prompt_ids=prompts[i], params=params))
        async for event in handle:
            if isinstance(event, TextDelta):
                out[i] += event.token_ids
            elif isinstance(event, Finished):
                return
            elif hasattr(event, "code"):
                raise RuntimeError(f"turn {i} failed: {event}")

    for start in range(0, len(prompts), at_once):
        await asyncio.gather(*(one(i) for i in range(start, min(start + at_once, len(prompts)))))
    return out


def greedy(loaded: LoadedModel, kv: str, prompts: list[list[int]], num_new: int, at_once: int = 8) -> list[list[int]]:
    tiers = TierStore(0, 0, None, block_size=16)
    store = SessionStore(ttl_s=3600, forgetters=(tiers,))
    token_bytes = KVLayout.of(loaded.model.config, loaded.dtype).bytes_per_token  # the compute dtype's: the most
    budget = 8 * (max(map(len, prompts)) + num_new + 32) * token_bytes  # 8 turns at a time
    engine = Engine(loaded, store, tiers, EngineConfig(budget_bytes=budget, block_size=16, kv_dtype=kv))
    engine.start()
    try:
        return asyncio.run(continue_all(engine, prompts, num_new, at_once))
    finally:
        engine.stop()


def perplexity(model: torch.nn.Module, ids: list[int], window: int, kv: torch.dtype | None) -> float:
    ROUNDING["kv"] = kv
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start : start + window + 1]])
        if chunk.shape[1] < 2:
            break
        with torch.inference_mode():
            logits = model(input_ids=chunk[:, :-1], use_cache=False).logits[0].float()
        nll = torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum")
        total, count = total + float(nll), count + chunk.shape[1] - 1
    return math.exp(total / count)


def measure(name: str, text: str, args) -> dict:
    loaded = load_model(spec_of(name), ROOT / "models" / "cache")
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    span = len(ids) - args.prompt - 1
    prompts = [ids[i * span // args.turns : i * span // args.turns + args.prompt] for i in range(args.turns)]
    kinds = ["compute", *args.kv.split(",")]
    turns = {kv: greedy(loaded, kv, prompts, args.new) for kv in kinds}
    # The floor: the compute dtype's own K/V, each turn alone instead of 8 at a time. Where the model computes in
    # bf16, rounding alone (which rows share a step) changes greedy tokens this often (issue: deterministic mode)
    turns["compute, 1 at a time"] = greedy(loaded, "compute", prompts, args.new, at_once=1)
    kinds.append("compute, 1 at a time")
    base = turns["compute"]
    result: dict[str, Any] = {"model": loaded.spec.id, "dtype": str(loaded.dtype).removeprefix("torch."), "kv": {}}
    # A fresh copy with the rounded attention: the served one has kvserve's paged attention installed
    fresh = load_model(dataclasses.replace(loaded.spec), ROOT / "models" / "cache").model
    fresh.set_attn_implementation(FAKE)
    ppl_ids = ids[: args.ppl_tokens]
    for kv in kinds:
        same = sum(a == b for a, b in zip(turns[kv], base, strict=True))
        before_first = 0
        for a, b in zip(turns[kv], base, strict=True):
            before_first += next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(b))
        stored = KV_DTYPES.get(kv)
        result["kv"][kv] = {
            "turns_equal": same / len(base),
            "tokens_before_first_difference": before_first / sum(map(len, base)),
            "perplexity": perplexity(fresh, ppl_ids, args.window, stored) if kv != kinds[-1] else None,
        }
        print(name, kv, json.dumps(result["kv"][kv]), flush=True)
    result["ppl_tokens"] = len(ppl_ids)
    return result


def report(results: list[dict], args, corpus: str) -> str:
    lines = [
        "## Quantized K/V: what it costs",
        "",
        f"`python bench/kv_quality.py --corpus {corpus}` ({machine_line()}). Greedy agreement: {args.turns} "
        f"passages of {args.prompt} tokens continued for {args.new} tokens by the engine with each K/V dtype, "
        "compared with the compute dtype's K/V (8 turns at a time); the row `compute, 1 at a time` is the compute "
        "dtype's K/V with each turn alone, how often rounding alone (which rows share a step) changes greedy tokens. "
        f"Perplexity: the corpus's first {args.ppl_tokens} tokens teacher-forced in windows of {args.window}, every "
        "key and value rounded through the K/V dtype before attention.",
        "",
        "| model (compute dtype) | K/V dtype | turns equal | tokens before the first difference | perplexity "
        "| vs compute |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        base = r["kv"]["compute"]["perplexity"]
        for kv, m in r["kv"].items():
            ppl = m["perplexity"]
            lines.append(
                f"| {r['model']} ({r['dtype']}) | {kv} | {m['turns_equal']:.1%} | "
                f"{m['tokens_before_first_difference']:.1%} | "
                + (f"{ppl:.3f} | {(ppl / base - 1):+.2%} |" if ppl is not None else "(as compute) | |")
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True, help="a UTF-8 text file (e.g. one shipped in a package)")
    parser.add_argument("--models", default="smollm2-135m-instruct")
    parser.add_argument("--kv", default="int8,fp8")
    parser.add_argument("--turns", type=int, default=240)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--ppl-tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    AttentionInterface.register(FAKE, rounded_attention)
    AttentionMaskInterface.register(FAKE, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    text = Path(args.corpus).read_text(encoding="utf-8", errors="replace")
    results = [measure(name, text, args) for name in args.models.split(",")]
    out = ROOT / "bench" / "results" / "kv_quality.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    body = report(results, args, Path(args.corpus).name)
    print(body)
    if not args.no_docs:
        replace_section(ROOT / "docs" / "benchmarks.md", "kv-quality", body)


if __name__ == "__main__":
    main()

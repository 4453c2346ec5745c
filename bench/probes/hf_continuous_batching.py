"""transformers' own continuous batching (generate_batch) vs kvserve's engine, in-process, same prompts.

Used to decide whether to build on transformers' generation/continuous_batching (docs/architecture.md).

    python bench/probes/hf_continuous_batching.py [--num 8] [--new 32]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the source tree
from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import Finished, GenerationRequest, SamplingParams
from server.kv.tiers import TierStore
from server.models.loader import load_model, read_specs
from server.sessions.store import SessionStore

ROOT = Path(__file__).resolve().parents[2]


def prompts(tokenizer, num: int) -> list[list[int]]:
    return [tokenizer(f"Tell me fact {i} about the number {i * 7}. Answer briefly.")["input_ids"] for i in range(num)]


def time_hf(model, inputs, new: int) -> float:
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None)
    start = time.perf_counter()
    out = model.generate_batch(inputs=inputs, generation_config=config, progress_bar=False)
    elapsed = time.perf_counter() - start
    assert sum(len(o.generated_tokens) for o in out.values()) == new * len(inputs)
    return elapsed


async def time_kvserve(engine, inputs, new: int) -> float:
    async def one(i, ids):
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        handle = engine.submit(GenerationRequest(request_id=f"r{i}", prompt_ids=ids, params=params, use_cache=False))
        return next(e async for e in handle if isinstance(e, Finished))

    start = time.perf_counter()
    done = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(inputs)))
    elapsed = time.perf_counter() - start
    assert sum(d.usage.completion_tokens for d in done) == new * len(inputs)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num", type=int, default=8)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    loaded = load_model(read_specs(ROOT / "models" / "models.toml")[0], ROOT / "models" / "cache")
    inputs = prompts(loaded.tokenizer, args.num)
    with torch.inference_mode():
        hf = min(time_hf(loaded.model, inputs, args.new) for _ in range(2))
    engine = Engine(loaded, SessionStore(3600), TierStore(0, 0, None), EngineConfig(budget_bytes=1 << 30))
    engine.start()
    ours = min(asyncio.run(time_kvserve(engine, inputs, args.new)) for _ in range(2))
    engine.stop()
    total = args.num * args.new
    print(f"{args.num} prompts x {args.new} new tokens on {torch.get_num_threads()} threads")
    print(f"transformers generate_batch: {hf:.2f} s, {total / hf:.1f} tok/s")
    print(f"kvserve Engine:             {ours:.2f} s, {total / ours:.1f} tok/s  ({hf / ours:.2f}x)")


if __name__ == "__main__":
    main()

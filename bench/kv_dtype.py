"""What a quantized K/V buys, per K/V dtype, side by side in one run: capacity, long decode, restores.

python bench/kv_dtype.py [--kv compute,int8,fp8] [--history 2000] [--no-docs]

In-process on the default model, each K/V dtype in turn (the same prompts, the same engine settings):

- capacity: a fixed pool (--pool-mib) takes sessions of --history tokens one after another (each a
  turn with one output token); afterwards, how many of them the pool still holds whole (the others'
  blocks were evicted for the later ones). Counted from the pool's books, not computed from sizes.
- decode: --conversations long conversations at once (distinct prompts of --history tokens, 64 new
  tokens each), aggregate decode tok/s from the moment every one has its first token to the end.
- restores: turn 2 of a --history-token session on an empty pool, its K/V read from disk (the block
  files evicted from the page cache first; read + checksum counted) and from Redis (a real
  redis-server on loopback), time to first token, median of --repeats, and the bytes each tier
  holds for the session.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import Failed, Finished, GenerationRequest, SamplingParams, TextDelta
from server.kv.block_store import BlockStore, addresses
from server.kv.pool import KVLayout, stored_dtype
from server.kv.redis_blocks import RedisBlocks
from server.kv.tiers import TierStore
from server.models.loader import load_model, read_specs
from server.sessions.record import SessionKey, Turn
from server.sessions.store import SessionStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, drop_page_cache, machine_line, replace_section
from restore import TEXT

sys.path.insert(0, str(ROOT))
from tests.e2e.cluster import Redis

KEY = SessionKey("default", "bench")


def distinct_ids(loaded, num_tokens: int, seed: int) -> list[int]:
    """`num_tokens` of prose that no other seed's prompt shares a block with (its first words differ)."""
    ids = loaded.tokenizer(f"Chronicle {seed}: ", add_special_tokens=False)["input_ids"]
    while len(ids) < num_tokens:
        ids += loaded.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    return ids[:num_tokens]


def new_engine(loaded, kv: str, budget: int, tiers: TierStore | None = None, store=None) -> Engine:
    tiers = tiers or TierStore(0, 0, None, block_size=16)
    store = store or SessionStore(ttl_s=3600, forgetters=(tiers,))
    config = EngineConfig(budget_bytes=budget, block_size=16, max_batch_tokens=256, kv_dtype=kv)
    engine = Engine(loaded, store, tiers, config)
    engine.start()
    return engine


async def generate(engine: Engine, prompt: list[int], max_tokens: int, rid: str, kv_source=None) -> list[float]:
    """Submit to the end; the times (perf_counter) of the first token and of the last."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    handle = engine.submit(GenerationRequest(request_id=rid, prompt_ids=prompt, params=params, kv_source=kv_source))
    first = last = None
    async for event in handle:
        if isinstance(event, TextDelta):
            last = time.perf_counter()
            first = first or last
        elif isinstance(event, Finished):
            break
        elif isinstance(event, Failed):
            raise RuntimeError(f"request failed: {event}")
    assert first is not None
    assert last is not None
    return [first, last]


async def capacity(loaded, kv: str, args) -> dict:
    engine = new_engine(loaded, kv, args.pool_mib << 20)
    prompts = [distinct_ids(loaded, args.history, 100 + i) for i in range(args.sessions)]
    for i, prompt in enumerate(prompts):
        await generate(engine, prompt, 1, f"c{i}")
    held = await engine.query(
        lambda: [engine.blocks.chain("default", p)[1] >= len(p) - 1 for p in prompts]  # all but the last token
    )
    engine.stop()
    return {"sessions_held": sum(held), "pool_tokens": engine.runner.pool.num_blocks * 16}


async def decode(loaded, kv: str, args) -> dict:
    budget = (args.conversations * (args.history + 80)) * engine_token_bytes(loaded, kv) + (8 << 20)
    engine = new_engine(loaded, kv, budget)
    await generate(engine, distinct_ids(loaded, 64, 1), 4, "warm")
    prompts = [distinct_ids(loaded, args.history, 200 + i) for i in range(args.conversations)]
    runs = await asyncio.gather(*(generate(engine, p, 64, f"d{i}") for i, p in enumerate(prompts)))
    engine.stop()
    all_started, end = max(r[0] for r in runs), max(r[1] for r in runs)
    # Tokens decoded after the last conversation's first token: each conversation's share of that window
    tokens = sum(63 * max(0.0, min(1.0, (r[1] - all_started) / (r[1] - r[0]))) for r in runs if r[1] > r[0])
    return {"decode_tok_s": tokens / (end - all_started)}


def engine_token_bytes(loaded, kv: str) -> int:
    stored = stored_dtype(kv, loaded.dtype, loaded.device)
    return KVLayout.of(loaded.model.config, loaded.dtype, stored).bytes_per_token


async def restores(loaded, kv: str, args, state: Path, redis_url: str) -> dict:
    history = distinct_ids(loaded, args.history, 7)
    turn2 = history + loaded.tokenizer(" And then the river rose again.", add_special_tokens=False)["input_ids"]
    budget = (len(turn2) + 256) * engine_token_bytes(loaded, kv)
    disk_dir = state / f"disk-{kv}"
    # Turn 1 as a session: its K/V to disk (this process's tier) and to Redis (the replicas' tier)
    tiers = TierStore(0, 1 << 34, disk_dir, block_size=16)
    shared = BlockStore(RedisBlocks(redis_url), "shared")
    tiers.shared = shared
    store = SessionStore(ttl_s=3600, forgetters=(tiers,))
    fields = {"transcript_ids": list(history), "messages": [], "turns": [Turn(0, 0), Turn(len(history), 0)]}
    warm = new_engine(loaded, kv, budget, tiers, store)
    store.create(KEY, warm.model_id, 3600, **fields)
    await generate(warm, history, 1, "t1")
    await warm.query(lambda: warm.offloader.save(KEY, history))
    await warm.query(lambda: warm.offloader.share(KEY, history))
    tiers.flush()
    shared.flush()
    warm.stop()
    tiers.close()
    files = sorted(disk_dir.rglob("*.safetensors"))
    disk_bytes = sum(path.stat().st_size for path in files)
    redis_bytes = sum(len(v or b"") for v in shared.backend.read(list(shared_names(warm, history))))
    times: dict[str, list[float]] = {"disk": [], "redis": [], "recompute": []}
    for _ in range(args.repeats):
        for tier in ("disk", "redis"):
            local = TierStore(0, 1 << 34, disk_dir if tier == "disk" else None, block_size=16)
            if tier == "disk":
                local.scan()
                for path in files:
                    drop_page_cache(path)
            else:
                local.shared = BlockStore(RedisBlocks(redis_url), "shared")
            store = SessionStore(ttl_s=3600, forgetters=(local,))
            engine = new_engine(loaded, kv, budget, local, store)
            store.create(KEY, engine.model_id, 3600, **fields)
            start = time.perf_counter()
            first, _ = await generate(engine, turn2, 1, f"r-{tier}", kv_source=KEY)
            times[tier].append(first - start)
            engine.stop()
            local.close()
        engine = new_engine(loaded, kv, budget)
        start = time.perf_counter()
        first, _ = await generate(engine, turn2, 1, "recompute")
        times["recompute"].append(first - start)
        engine.stop()
    shared.close()
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"restore_s": medians, "disk_bytes": disk_bytes, "redis_bytes": redis_bytes}


def shared_names(engine: Engine, ids: list[int]) -> list[str]:
    return addresses(engine.fingerprint, 16, "default", ids[: len(ids) // 16 * 16])


async def measure(loaded, args, state: Path, redis_url: str) -> dict:
    results = {}
    for kv in args.kv.split(","):
        print(f"K/V {kv} ...", flush=True)
        results[kv] = {
            "bytes_per_token": engine_token_bytes(loaded, kv),
            **(await capacity(loaded, kv, args)),
            **(await decode(loaded, kv, args)),
            **(await restores(loaded, kv, args, state, redis_url)),
        }
        print(json.dumps(results[kv]), flush=True)
    return results


def report(results: dict, args, dtype: torch.dtype) -> str:
    base = results.get("compute") or next(iter(results.values()))
    lines = [
        "## Quantized K/V: what it buys",
        "",
        f"`python bench/kv_dtype.py` ({machine_line()}), the default model computing in "
        f"{str(dtype).removeprefix('torch.')}, every K/V dtype in one run. Capacity: sessions of {args.history} "
        f"tokens taken one after another by a {args.pool_mib} MiB pool, how many it still holds whole. Decode: "
        f"{args.conversations} conversations of {args.history} tokens at once, aggregate tok/s once all have "
        f"started. Restores: turn 2 of a {args.history}-token session on an empty pool, time to first token "
        f"(median of {args.repeats}), from disk (page cache dropped) and from Redis on loopback.",
        "",
        "| K/V dtype | bytes/token | sessions held | decode tok/s | disk restore | Redis restore | recompute "
        "| disk bytes | Redis bytes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kv, r in results.items():
        t = r["restore_s"]
        lines.append(
            f"| {kv} | {r['bytes_per_token']} | {r['sessions_held']} | {r['decode_tok_s']:.1f} "
            f"({r['decode_tok_s'] / base['decode_tok_s']:.2f}x) | {t['disk'] * 1000:.0f} ms | "
            f"{t['redis'] * 1000:.0f} ms | {t['recompute'] * 1000:.0f} ms | {r['disk_bytes'] / 2**20:.1f} MiB | "
            f"{r['redis_bytes'] / 2**20:.1f} MiB |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv", default="compute,int8,fp8")
    parser.add_argument("--history", type=int, default=2000)
    parser.add_argument("--sessions", type=int, default=14)
    parser.add_argument("--pool-mib", type=int, default=256)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_model(read_specs(ROOT / "models" / "models.toml")[0], ROOT / "models" / "cache")
    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as state:
        redis = Redis(Path(state))
        try:
            results = asyncio.run(measure(loaded, args, Path(state), redis.url))
        finally:
            redis.stop()
    out = ROOT / "bench" / "results" / "kv_dtype.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    text = report(results, args, loaded.dtype)
    print(text)
    if not args.no_docs:
        replace_section(ROOT / "docs" / "benchmarks.md", "kv-dtype", text)


if __name__ == "__main__":
    main()

"""Restoring a session's K/V from host RAM or disk vs recomputing it, at a 2,000-token history.

python bench/restore.py [--history 2000] [--new 20] [--repeats 3]

In-process on the default model. Turn 1 computes a history of --history tokens; its K/V is
gathered from the pool into a snapshot (host RAM) and written to disk (the block store's disk
backend: a checksummed safetensors file per 16-token block, and a manifest). Then
turn 2 (the history + --new tokens, one output token) runs on a fresh, empty pool, four ways:
K/V still in the pool (device), restored from host RAM, restored from disk (the block files
evicted from the page cache first, and the reads + checksums counted), and recomputed from scratch.
Time = from the turn's start (snapshot read included) to its first token.
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
from server.engine.request import Finished, GenerationRequest, SamplingParams, TextDelta
from server.kv.pool import KVLayout
from server.kv.tiers import TierStore
from server.models.loader import load_model, read_specs
from server.sessions.record import SessionKey
from server.sessions.store import SessionStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, drop_page_cache, machine_line, replace_section

KEY = SessionKey("default", "bench")
TEXT = (
    "The history of the river valley is long. Farmers settled its banks, traders followed the water, and towns "
    "grew where the roads met the fords. Each generation kept records of floods, harvests and markets. "
)


def history_ids(loaded, num_tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += loaded.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    return ids[:num_tokens]


def new_engine(loaded, tiers: TierStore, num_tokens: int) -> Engine:
    store = SessionStore(ttl_s=3600, forgetters=(tiers,))
    budget = (num_tokens + 256) * KVLayout.of(loaded.model.config, loaded.dtype).bytes_per_token
    engine = Engine(loaded, store, tiers, EngineConfig(budget_bytes=budget, block_size=16, max_batch_tokens=256))
    engine.start()
    return engine


async def first_token_s(engine: Engine, prompt: list[int], kv_source=None, use_cache=True) -> tuple[float, int]:
    """From submit to the first token; the engine reads `kv_source`'s snapshot itself when it holds more."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    request = GenerationRequest(
        request_id="r", prompt_ids=prompt, params=params, kv_source=kv_source, use_cache=use_cache
    )
    start = time.perf_counter()
    handle = engine.submit(request)
    async for event in handle:
        if isinstance(event, TextDelta | Finished):
            elapsed = time.perf_counter() - start
            async for _rest in handle:
                pass
            return elapsed, engine.counter.num_prefill_tokens
    raise RuntimeError("no token")


async def measure(loaded, args, state: Path) -> dict:
    history = history_ids(loaded, args.history)
    turn2 = history + history_ids(loaded, args.history + args.new)[args.history :]
    host = TierStore(1 << 34, 1 << 34, state, block_size=16)
    warm = new_engine(loaded, host, len(turn2))
    await first_token_s(warm, history)  # turn 1: the history's K/V in the pool
    snapshot = await warm.query(lambda: warm.offloader.gather(KEY, history))
    host.put(snapshot)
    host.flush()  # a copy on disk
    files = sorted((state / "blocks").rglob("*.safetensors"))
    times: dict[str, list[float]] = {"device": [], "host": [], "disk": [], "recompute": []}
    for _ in range(args.repeats):
        times["device"].append((await first_token_s(warm, turn2))[0])
        host.put(snapshot)  # in host RAM
        fresh = new_engine(loaded, host, len(turn2))
        times["host"].append((await first_token_s(fresh, turn2, KEY))[0])
        fresh.stop()
        disk_only = TierStore(0, 1 << 34, state, block_size=16)
        disk_only.scan()
        for path in files:
            drop_page_cache(path)
        fresh = new_engine(loaded, disk_only, len(turn2))
        times["disk"].append((await first_token_s(fresh, turn2, KEY))[0])  # read + checksum included
        fresh.stop()
        disk_only.close()
        fresh = new_engine(loaded, host, len(turn2))
        times["recompute"].append((await first_token_s(fresh, turn2, use_cache=False))[0])
        fresh.stop()
    warm.stop()
    host.close()
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "history_tokens": len(history),
        "new_tokens": args.new,
        "snapshot_bytes": snapshot.nbytes,
        "file_bytes": sum(path.stat().st_size for path in files),
        "num_files": len(files),
        "seconds": times,
        "median_s": medians,
        "ratio_to_recompute": {k: medians[k] / medians["recompute"] for k in medians},
    }


def report(result: dict) -> str:
    med, ratio = result["median_s"], result["ratio_to_recompute"]
    rows = [
        ("K/V still in the device pool", "device"),
        ("restored from host RAM", "host"),
        ("restored from disk (page cache dropped; read + checksum counted)", "disk"),
        ("recomputed (no cache)", "recompute"),
    ]
    lines = [
        "## Restoring a session: host RAM and disk vs recompute",
        "",
        f"`python bench/restore.py` ({machine_line()}): turn 2 of a session with a {result['history_tokens']}-token "
        f"history plus {result['new_tokens']} new tokens, time to first token on an empty pool, median of "
        f"{len(result['seconds']['disk'])} runs. Snapshot {result['snapshot_bytes'] / 2**20:.1f} MiB in RAM, "
        f"{result['file_bytes'] / 2**20:.1f} MiB on disk in {result['num_files']} block files.",
        "",
        "| K/V source | time to first token | vs recompute |",
        "|---|---|---|",
    ]
    lines += [f"| {label} | {med[key] * 1000:.0f} ms | {ratio[key]:.3f}x |" for label, key in rows]
    lines += ["", f"Target: disk restore at most 0.3x of the recompute time; measured **{ratio['disk']:.3f}x**."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=int, default=2000)
    parser.add_argument("--new", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_model(read_specs(ROOT / "models" / "models.toml")[0], ROOT / "models" / "cache")
    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as state:
        result = asyncio.run(measure(loaded, args, Path(state)))
    out = ROOT / "bench" / "results" / "restore.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(report(result))
    if not args.no_docs:
        replace_section(ROOT / "docs" / "benchmarks.md", "restore", report(result))


if __name__ == "__main__":
    main()

"""Reading a session's K/V back from the disk tier's block store, alone: where a disk restore's time goes.

python bench/probes/block_read.py [--tokens 2000] [--dtype bfloat16] [--repeats 3]

A synthetic snapshot with SmolLM2-135M's K/V layout (30 layers, 3 kv heads, head_dim 64) is written
through `TierStore` (one safetensors file per 16-token block and a manifest), then read back with
`TierStore.read` (the loader thread's call), warm and with the block files dropped from the page cache
first; then the parts one by one: the file reads, the checks and decoding, the join into one run.
Prints milliseconds; writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the source tree
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py and the benchmarks
from common import drop_page_cache

from server.kv.block_store import addresses, join_blocks
from server.kv.pool import KVLayout
from server.kv.snapshot import Snapshot, decode_block
from server.kv.tiers import TierStore
from server.sessions.record import SessionKey

KEY = SessionKey("bench", "a")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    layout = KVLayout(30, 3, 64, getattr(torch, args.dtype))
    ids = list(range(args.tokens))
    k = [torch.randn(3, args.tokens, 64).to(layout.dtype) for _ in range(30)]  # [kv_heads, tokens, head_dim]
    v = [torch.randn(3, args.tokens, 64).to(layout.dtype) for _ in range(30)]
    with tempfile.TemporaryDirectory() as directory:
        state = Path(directory)
        tiers = TierStore(0, 1 << 40, state, block_size=16)
        tiers.put(Snapshot(KEY, "m", layout, "", ids, k, v))
        tiers.flush_pending()
        files = sorted((state / "blocks").rglob("*.safetensors"))
        size = sum(p.stat().st_size for p in files) / 2**20
        print(f"{args.tokens} tokens, {args.dtype}: {size:.1f} MiB in {len(files)} block files")
        times: dict[str, list[float]] = {"warm": [], "cold": []}
        for _ in range(args.repeats):
            times["warm"].append(timed(lambda: tiers.read(KEY, [*ids, 0], "m", "", layout)))
            for path in files:
                drop_page_cache(path)
            times["cold"].append(timed(lambda: tiers.read(KEY, [*ids, 0], "m", "", layout)))
        names = addresses(layout.fingerprint(), 16, KEY.tenant, ids, tail=True)
        values = tiers.disk.blocks.read(names)
        blocks = [decode_block(n, value, layout) for n, value in zip(names, values, strict=True)]
        parts = {
            "file reads (warm, one after another)": timed(lambda: tiers.disk.blocks.read(names)),
            "checks and decoding (one after another)": timed(
                lambda: [decode_block(n, value, layout) for n, value in zip(names, values, strict=True)]
            ),
            "join into one run": timed(lambda: join_blocks(blocks)),
        }
        tiers.close()
    for name, values_ms in times.items():
        print(f"TierStore.read, {name}: median {statistics.median(values_ms):.0f} ms of {values_ms}")
    for name, ms in parts.items():
        print(f"  {name}: {ms:.0f} ms")


if __name__ == "__main__":
    main()

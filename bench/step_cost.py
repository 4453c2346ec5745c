"""Cost of one packed decode step on the paged path, by number of sequences (default model, in-process).

python bench/step_cost.py [--context 100]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from server.kv.attention import STEP_KWARG, SeqSpan, StepMeta, install
from server.kv.pool import KVLayout, KVPool
from server.models.loader import load_model, read_specs

ROOT = Path(__file__).resolve().parents[1]


def median_ms(fn, repeats: int = 15) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[repeats // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=100)
    args = parser.parse_args()
    loaded = load_model(read_specs(ROOT / "models" / "models.toml")[0], ROOT / "models" / "cache")
    model = loaded.model
    install(model)
    stride = args.context + 16
    pool = KVPool(KVLayout.of(model.config, loaded.dtype), 17 * stride // 16 + 1, 16, loaded.device)
    torch.set_grad_enabled(False)
    for num in (1, 4, 8, 16):
        spans = [SeqSpan(i, 1, args.context + 1, None, i * stride, loaded.device) for i in range(num)]
        meta = StepMeta(pool, torch.tensor([i * stride + args.context for i in range(num)]), spans)
        ids, pos = torch.full((1, num), 5), torch.full((1, num), args.context)
        keep = torch.arange(num)
        kwargs = {"input_ids": ids, "position_ids": pos, "use_cache": False, "logits_to_keep": keep, STEP_KWARG: meta}
        ms = median_ms(lambda kw=kwargs: model(**kw))
        print(f"{num:2d} sequences, context {args.context}: {ms:6.1f} ms per step, {1000 * num / ms:6.1f} tok/s")


if __name__ == "__main__":
    main()

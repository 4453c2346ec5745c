"""What passing transformers a 4D attention mask on every step costs or saves on this CPU, in one process.

The model runner hands every step a [1, 1, 1, 1] mask, which transformers passes through as it is: no mask
is built and the positions are not checked for packed sequences (a device sync, which a CUDA graph's
capture refuses: docs/architecture.md). Here the same engine runs with that mask and without one (None:
transformers builds its own, as before), alternating: a continued turn's time to first token after 1,400
cached tokens, 8 conversations decoding 48 tokens at once, and the forward pass alone of a 40-token chunk
after 1,400 keys (5 passes a round). Medians of --rounds.

    python bench/probes/step_mask.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the source tree
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py and the benchmarks
from server.engine.threads import confine_to_one_team

confine_to_one_team()

import torch  # noqa: E402
from common import ROOT, machine_line  # noqa: E402
from deterministic import new_engine  # noqa: E402
from kv_dtype import distinct_ids, generate  # noqa: E402

from server.kv.attention import stepping  # noqa: E402
from server.kv.backends import StepRow  # noqa: E402
from server.models.loader import load_model, read_specs  # noqa: E402

MODES = ("4d", "none")


async def measure(rounds: int) -> dict[str, dict[str, list[float]]]:
    spec = read_specs(ROOT / "models" / "models.toml")[0]
    loaded = load_model(spec, ROOT / "models" / "cache")
    engine = new_engine(loaded, False, 1 << 30)
    runner, mask = engine.runner, engine.runner.no_mask
    out: dict[str, dict[str, list[float]]] = {m: {"ttft_ms": [], "decode_tok_s": [], "forward_ms": []} for m in MODES}
    try:
        await generate(engine, distinct_ids(loaded, 64, 1), 4, "warm")
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                runner.no_mask = mask if mode == "4d" else None
                salt = 2 * r + (mode == "4d")
                history = distinct_ids(loaded, 1400, 7000 + salt)
                await generate(engine, history, 2, f"h{mode}{r}")  # its blocks stay cached by prefix
                started = time.perf_counter()
                first, _ = await generate(engine, history + distinct_ids(loaded, 40, 9000 + salt), 1, f"f{mode}{r}")
                out[mode]["ttft_ms"].append((first - started) * 1000)
                prompts = [distinct_ids(loaded, 300, 100 * salt + i) for i in range(8)]
                runs = await asyncio.gather(*(generate(engine, p, 48, f"{mode}{r}-{i}") for i, p in enumerate(prompts)))
                out[mode]["decode_tok_s"].append(8 * 47 / (max(x[1] for x in runs) - min(x[0] for x in runs)))
                out[mode]["forward_ms"] += await engine.query(lambda: chunk_forwards(runner, 5))
    finally:
        runner.no_mask = mask
        engine.stop()
    return out


def chunk_forwards(runner, passes: int) -> list[float]:
    """On the engine thread: the forward pass of a 40-token chunk after 1,400 keys (blocks 0-91 of the pool, as
    the engine left them), with the runner's mask as it is now; milliseconds each."""
    table = list(range(92))
    ids, positions = torch.randint(0, 1000, (1, 40)), torch.arange(1400, 1440)[None]
    times = []
    for _ in range(passes):
        meta = runner.backend.plan([StepRow(0, 40, 1440, table, [])], runner.pool.slots(table, 1440)[1400:])
        started = time.perf_counter()
        with torch.inference_mode(), stepping(meta):
            runner.model(input_ids=ids, position_ids=positions, attention_mask=runner.no_mask, use_cache=False,
                         logits_to_keep=torch.tensor([39]))  # fmt: skip
        times.append((time.perf_counter() - started) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    results = asyncio.run(measure(args.rounds))
    print(f"{machine_line()}, the default model, {args.rounds} rounds alternating; medians")
    print(f"{'':28}{'4D mask':>10}{'none':>10}{'4d / none':>11}")
    rows = (("ttft_ms", "continued turn TTFT, ms"), ("decode_tok_s", "8 conversations, tok/s"))
    for key, label in (*rows, ("forward_ms", "40-token chunk's forward, ms")):
        a, b = (statistics.median(results[m][key]) for m in MODES)
        print(f"{label:28}{a:10.1f}{b:10.1f}{a / b:10.2f}x")


if __name__ == "__main__":
    main()

"""Does torch.compile pay on this CPU? The default model's dense part, eager as served against inductor's.

Both run the whole model's forward over one row of T tokens, in bf16, with attention made opaque: a
`torch.library` custom op (causal SDPA over the row's own keys) that inductor calls and never looks
into, so what is compared is the dense part (norms, rotary, projections, MLP, residual adds and the
element-wise ops between them) and the Python around it:

- eager: the model as the server runs it, its linear weights packed once for oneDNN
  (server/models/packed_linear.py);
- compiled: `torch.compile` (inductor, static shapes, `freezing` on, so inductor packs the weights
  itself; it cannot lower weights we have packed already), one compile per T, timed.

Medians of repeated forwards, side by side in one run; the ratio is eager time / compiled time
(above 1: compiling pays).

    python bench/probes/compile_cost.py [--rows 1,8,64,256,1024] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the source tree
from server.models.loader import read_specs, resolve_source
from server.models.packed_linear import pack_linears

ROOT = Path(__file__).resolve().parents[2]


@torch.library.custom_op("kvserve_bench::causal_attention", mutates_args=())
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [1, H, T, D], k/v [1, kvH, T, D] -> [1, T, H, D]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)


@causal_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], q.shape[3]))


def opaque_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return causal_attention(query, key, value, scale).contiguous(), None


def load(packed: bool) -> torch.nn.Module:
    spec = read_specs(ROOT / "models" / "models.toml")[0]
    model = AutoModelForCausalLM.from_pretrained(resolve_source(spec, ROOT / "models" / "cache"), dtype=torch.bfloat16)
    model.eval()
    model.set_attn_implementation("kvserve_bench_opaque")
    if packed:
        pack_linears(model, torch.bfloat16)
    return model


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64,256,1024", help="tokens per forward, comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    AttentionInterface.register("kvserve_bench_opaque", opaque_attention)
    torch._inductor.config.freezing = True
    eager, plain = load(packed=True), load(packed=False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16, the default model")
    print("| tokens | eager packed ms | compiled ms | eager / compiled | compile s |")
    print("|---:|---:|---:|---:|---:|")
    for rows in (int(n) for n in args.rows.split(",")):
        ids = torch.randint(0, eager.config.vocab_size, (1, rows))
        torch._dynamo.reset()
        compiled = torch.compile(plain, dynamic=False)
        with torch.inference_mode():
            start = time.perf_counter()
            compiled(input_ids=ids, logits_to_keep=1)
            compile_s = time.perf_counter() - start
            eager(input_ids=ids, logits_to_keep=1)  # warm-up: oneDNN builds its kernels on first use
            repeats = max(3, args.repeats * 64 // max(rows, 64))
            eager_ms = median_ms(lambda x=ids: eager(input_ids=x, logits_to_keep=1), repeats)
            compiled_ms = median_ms(lambda c=compiled, x=ids: c(input_ids=x, logits_to_keep=1), repeats)
        print(f"| {rows} | {eager_ms:.1f} | {compiled_ms:.1f} | {eager_ms / compiled_ms:.2f}x | {compile_s:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The engine on whatever device is here (CUDA when present), on a random-weight Llama-shaped model (no download).

Prints the attention backend and the CUDA graphs captured, decode tokens/s at batch 1, 8 and 32 (aggregate
and per stream), the batch-1 decode against the memory roofline (the bytes a step must read, weights + K/V,
over --peak-gbps: the most tokens/s the memory allows), and turn-2 time to first token of a session with and
without its cached K/V. Run by bench/gpu_check.sh.

    python bench/gpu_check.py --shape 1b        # Llama-3.2-1B shape (on a GPU)
    python bench/gpu_check.py --shape small     # a few-MB model: proves the script on a CPU (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server.engine.config import EngineConfig  # noqa: E402
from server.engine.engine import Engine  # noqa: E402
from server.engine.request import Admitted, Failed, GenerationRequest, SamplingParams  # noqa: E402
from server.kv.tiers import TierStore  # noqa: E402
from server.models.loader import LoadedModel, ModelSpec  # noqa: E402
from server.sessions.record import SessionKey  # noqa: E402
from server.sessions.store import SessionStore  # noqa: E402
from tests.tiny import build_tokenizer  # noqa: E402  (a tokenizer built in code: nothing is downloaded)

SHAPES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32},
    "small": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
}
KV_HEADS = {"1b": 8, "small": 2}
VOCAB = {"1b": 128256, "small": 512}


def build(shape: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        **SHAPES[shape],
        num_key_value_heads=KV_HEADS[shape],
        vocab_size=max(VOCAB[shape], len(tokenizer)),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    spec = ModelSpec(id=f"random-{shape}", source="(built in memory)", dtype=str(dtype).removeprefix("torch."))
    return LoadedModel(
        spec=spec,
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        vocab_size=config.vocab_size,
        max_context=8192,
        eos_ids=frozenset(),
    )


async def generate(
    engine: Engine, prompts: list[list[int]], max_tokens: int, session: str | None = None, use_cache: bool = True
) -> tuple[float, int]:
    """Run these prompts at once to the end: (seconds, cached tokens of the first). Timing whole requests, not
    text events: a random model's tokens may decode to no text until the end."""

    async def one(i: int, prompt: list[int]) -> int:
        key = SessionKey("default", session) if session else None
        request = GenerationRequest(
            request_id=f"r{i}-{time.monotonic_ns()}",
            prompt_ids=prompt,
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            session=key,
            kv_source=key,
            use_cache=use_cache,
        )
        cached = 0
        async for event in engine.submit(request):
            if isinstance(event, Admitted):
                cached = event.num_cached
            elif isinstance(event, Failed):
                raise RuntimeError(f"request failed: {event}")
        return cached

    start = time.perf_counter()
    cached = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - start, cached[0]


def bytes_per_decode_step(loaded: LoadedModel, engine: Engine, context: int) -> int:
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    return weights + context * engine.token_bytes


async def main_async(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    loaded = build(args.shape, device, dtype)
    params = sum(p.numel() for p in loaded.model.parameters())
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), {dtype}")
    print(f"model: random Llama, {args.shape} shape, {params / 1e9:.2f} B parameters")
    tiers = TierStore(0, 0, None)
    store = SessionStore(ttl_s=3600, forgetters=(tiers,))
    budget = args.kv_gib << 30
    engine = Engine(
        loaded, store, tiers, EngineConfig(budget_bytes=budget, max_batch_tokens=args.batch_tokens, max_queue=1024)
    )
    engine.start()
    runner = engine.runner
    print(f"attention: {runner.backend.name} ({runner.backend.detail})")
    print(f"cuda graphs: {runner.graphs_detail}")
    gen = torch.Generator().manual_seed(1)
    vocab = len(loaded.tokenizer)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    try:
        await generate(engine, [prompt(32)], 4)  # warm-up: allocator, kernels
        print(f"{'batch':>6} {'decode tok/s':>13} {'per stream':>11}")
        for batch in args.batches:
            prompts = [prompt(args.prompt_tokens) for _ in range(batch)]
            prefill_s, _ = await generate(engine, prompts, 1, use_cache=False)  # the same prefill, one token
            total_s, _ = await generate(engine, prompts, args.max_tokens, use_cache=False)
            rate = batch * (args.max_tokens - 1) / max(total_s - prefill_s, 1e-9)
            print(f"{batch:6d} {rate:13.1f} {rate / batch:11.1f}")
            if batch == 1:
                step_bytes = bytes_per_decode_step(loaded, engine, args.prompt_tokens + args.max_tokens // 2)
                achieved = rate * step_bytes / 1e9
                print(f"batch-1 decode reads {step_bytes / 1e9:.3f} GB per step: {achieved:.1f} GB/s", end="")
                if args.peak_gbps:
                    roofline = args.peak_gbps * 1e9 / step_bytes
                    print(f" = {achieved / args.peak_gbps:.1%} of {args.peak_gbps:.0f} GB/s", end="")
                    print(f" (roofline {roofline:.0f} tok/s: {rate / roofline:.1%} of it)")
                else:
                    print()
        history = prompt(args.history_tokens)
        turn1_s, _ = await generate(engine, [history], 1, session="check")
        follow = history + prompt(32)  # the next turn: the history and a new user message
        with_s, cached = await generate(engine, [follow], 1, session="check")
        without_s, _ = await generate(engine, [follow], 1, use_cache=False)
        print(f"turn 1 TTFT ({len(history)} tokens): {turn1_s * 1000:.1f} ms")
        print(
            f"turn 2 TTFT ({len(follow)} tokens): with the session {with_s * 1000:.1f} ms ({cached} cached), "
            f"without {without_s * 1000:.1f} ms: {without_s / with_s:.1f}x"
        )
    finally:
        engine.close()
        engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b" if torch.cuda.is_available() else "small")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--history-tokens", type=int, default=2000)
    parser.add_argument("--batch-tokens", type=int, default=2048, help="tokens per engine step")
    parser.add_argument("--kv-gib", type=int, default=16)
    parser.add_argument(
        "--peak-gbps",
        type=float,
        default=4800.0 if torch.cuda.is_available() else 0.0,
        help="the device's memory bandwidth, for the fraction used (H200 HBM3e: 4800; 0: not printed)",
    )
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()

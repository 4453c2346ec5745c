"""The engine on a CUDA device: the same answers as HF generate there, and sessions through pinned host memory.

Skipped without CUDA; bench/gpu_check.sh runs them on a lent GPU (plain `def` tests: the GPU
machine's image has pytest but not pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from server.kv.tiers import TierStore
from server.models.dtype import choose_dtype
from server.models.loader import load_model
from server.sessions.record import SessionKey
from tests.helpers import make_engine, reference_greedy, run

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def tiny_cuda(tiny_spec):
    return load_model(dataclasses.replace(tiny_spec, device="cuda", dtype="float32"), Path("unused-cache"))


def test_auto_dtype_on_cuda_is_a_half_type():
    choice = choose_dtype("auto", CUDA)
    assert choice.dtype in (torch.bfloat16, torch.float16)


def test_batched_engine_matches_generate_on_cuda(tiny_cuda):
    async def body() -> None:
        engine = make_engine(tiny_cuda, budget_bytes=64 << 20)
        try:
            prompts = [tiny_cuda.tokenizer(t)["input_ids"] for t in ("The quick brown fox", "Paris is the capital")]
            results = await asyncio.gather(
                *(run(engine, p, rid=f"r{i}", max_tokens=8, ignore_eos=True) for i, p in enumerate(prompts))
            )
            for prompt, result in zip(prompts, results, strict=True):
                assert result.token_ids == reference_greedy(tiny_cuda.model, prompt, 8)
        finally:
            engine.stop()

    asyncio.run(body())


def test_the_engine_attends_by_triton_and_replays_captured_decode_steps(tiny_cuda):
    async def body() -> None:
        engine = make_engine(tiny_cuda, budget_bytes=64 << 20)
        runner = engine.runner
        try:
            assert runner.backend.name == "triton", runner.backend.detail  # the self-test's failure, if any
            assert runner.graphs is not None, runner.graphs_detail
            assert runner.graphs_detail.startswith("decode steps of 1, 2, 4, 8, 16, 32, 64 rows, captured at start")
            prompts = [tiny_cuda.tokenizer(t)["input_ids"] for t in ("The quick", "Paris is the", "Hello world")]
            results = await asyncio.gather(
                *(run(engine, p, rid=f"r{i}", max_tokens=8, ignore_eos=True) for i, p in enumerate(prompts))
            )
            for prompt, result in zip(prompts, results, strict=True):
                assert result.token_ids == reference_greedy(tiny_cuda.model, prompt, 8)
            assert runner.graphs.stats.num_replays >= 7  # the decode steps after the prompts' prefill
        finally:
            engine.stop()

    asyncio.run(body())


def test_deterministic_mode_on_cuda_is_on_through_the_triton_split_or_says_why(tiny_cuda):
    engine = make_engine(tiny_cuda, budget_bytes=64 << 20, deterministic=True)
    engine.stop()
    runner = engine.runner
    print("deterministic mode on CUDA:", runner.deterministic_detail)  # the GPU check's log reports it
    if runner.deterministic:
        assert runner.backend.every_token
        assert runner.deterministic_detail.startswith("on: attention by the triton backend, linear products")
    else:
        assert runner.deterministic_detail == (
            "unavailable: its linear layers are not batch-invariant on cuda in torch.float32"
        )


def test_a_session_comes_back_from_pinned_host_memory(tiny_cuda, tmp_path):
    async def body() -> None:
        tiers = TierStore(1 << 30, 0, None, block_size=4)
        engine = make_engine(tiny_cuda, tiers=tiers, budget_bytes=64 << 20, block_size=4)
        try:
            prompt = tiny_cuda.tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
            first = await run(engine, prompt, session="a", max_tokens=4, ignore_eos=True)
            transcript = prompt + first.token_ids
            key = SessionKey("default", "a")
            snapshot = await engine.query(lambda: engine.offloader.gather(key, transcript))
            assert snapshot.k[0].is_pinned()  # the device-to-host copy is asynchronous into pinned pages
            tiers.put(snapshot)
            await engine.query(lambda: engine.blocks.discard(engine.blocks.chain(key.tenant, transcript)[0]))
            turn2 = transcript + tiny_cuda.tokenizer(" Hello")["input_ids"]
            second = await run(engine, turn2, session="a", max_tokens=4, ignore_eos=True)
            assert second.admitted.source == "host"
            assert second.token_ids == reference_greedy(tiny_cuda.model, turn2, 4)
        finally:
            engine.stop()
            tiers.close()

    asyncio.run(body())

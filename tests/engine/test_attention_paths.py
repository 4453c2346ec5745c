"""Which attention path a decode row takes: the paged kernel (one call for the short rows) or SDPA (each longer one)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from server.engine import model_runner
from server.models.loader import load_model
from tests.helpers import make_engine, reference_greedy, run


@pytest.fixture(scope="module")
def tiny32(tiny_spec):
    return load_model(dataclasses.replace(tiny_spec, dtype="float32"), Path("unused"))


def words(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


async def test_short_and_long_rows_of_one_step_take_both_attention_paths(tiny32, monkeypatch):
    monkeypatch.setattr(model_runner, "KERNEL_MAX_CONTEXT", 24)  # the short prompts' rows: kernel; the long: SDPA
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=256)
    if not engine.runner.uses_kernel:
        engine.stop()
        pytest.skip("no C++ compiler: every row is an SDPA call")
    seen: list[tuple[int, int]] = []
    prepare = engine.runner._prepare

    def spy(rows):
        meta, *rest = prepare(rows)
        seen.append((0 if meta.decode is None else len(meta.decode.rows), len(meta.spans)))
        return (meta, *rest)

    monkeypatch.setattr(engine.runner, "_prepare", spy)
    prompts = [words(tiny32, "Paris is"), words(tiny32, "The quick brown fox jumps over the lazy dog. " * 4)]
    try:
        got = await asyncio.gather(
            *(run(engine, p, rid=f"r{i}", max_tokens=10, ignore_eos=True) for i, p in enumerate(prompts))
        )
    finally:
        engine.stop()
    assert any(kernel_rows and sdpa_rows for kernel_rows, sdpa_rows in seen)  # one step used both
    for prompt, result in zip(prompts, got, strict=True):
        assert result.token_ids == reference_greedy(tiny32.model, prompt, 10)

"""The fused decode step (server/engine/fused_step.py, server/kv/csrc/decode_step.cpp): which steps and models take
it, that its logits are the modules' on the same rows, and that the kernel refuses what it cannot read."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from server.engine.fused_step import FusedDecode, fused_weights
from server.kv import kernels
from server.kv.attention import DecodeRows
from server.models.loader import ModelSpec, load_model, read_specs
from tests.helpers import make_engine, run

ROOT = Path(__file__).resolve().parents[2]
GEMV = kernels.paged_decode_available() and bool(torch.ops.kvserve.bf16_gemv_available())
needs_gemv = pytest.mark.skipif(not GEMV, reason="bf16_gemv needs a build with AVX512-BF16")


def paired(runner, record):
    """Each fused step also run through the modules on the same rows, after it (the K/V the next step reads is
    the modules'): record(fused logits, modules' logits)."""
    fused, whole = runner.fused, runner.run
    rows_now: list = []
    fused_run = fused.run

    def run_step(rows, is_abandoned=None):
        rows_now[:] = [rows]
        return whole(rows, is_abandoned)

    def both(*args):
        mine = fused_run(*args)
        runner.fused = None
        try:
            theirs = whole(rows_now[0])
        finally:
            runner.fused = fused
        record(mine, theirs)
        return theirs

    runner.run = run_step
    fused.run = both


def as_ids(text: str, loaded) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


async def greedy_all(engine, prompts, n) -> list[list[int]]:
    results = await asyncio.gather(
        *(run(engine, ids, rid=f"r{i}", max_tokens=n, ignore_eos=True) for i, ids in enumerate(prompts))
    )
    return [r.token_ids for r in results]


@needs_gemv
def test_decode_steps_take_the_fused_step_with_the_modules_logits(wide_heads_bf16):
    loaded = wide_heads_bf16[0]
    engine = make_engine(loaded, budget_bytes=16 << 20)
    try:
        runner = engine.runner
        assert runner.fused is not None, runner.fused_detail
        assert runner.fused.tiled == (runner.backend.name == "tiled")
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        paired(runner, lambda a, b: pairs.append((a.float(), b.float())))
        prompts = [as_ids(t, loaded) for t in ("hello there", "the sea " * 40, "one two three four")]
        asyncio.run(greedy_all(engine, prompts, 12))
    finally:
        engine.stop()
    assert len(pairs) >= 11  # every decode step (three rows, then fewer as they end) took it
    for mine, theirs in pairs:
        assert mine.shape == theirs.shape
        assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
        scale = float(theirs.abs().max())
        assert float((mine - theirs).abs().max()) <= 0.02 * scale  # a bf16 bit or two where a sum's order differs


@needs_gemv
def test_greedy_ids_are_the_same_with_and_without_it(wide_heads_bf16):
    loaded = wide_heads_bf16[0]
    prompts = [as_ids(t, loaded) for t in ("a b c", "the quick brown fox " * 20, "x")]
    outputs = []
    for fused in (True, False):
        engine = make_engine(loaded, budget_bytes=16 << 20)
        try:
            if not fused:
                engine.runner.fused = None
            outputs.append(asyncio.run(greedy_all(engine, prompts, 20)))
            steps = engine.runner.counter.num_forwards
        finally:
            engine.stop()
        assert steps > 0
    assert outputs[0] == outputs[1]


@needs_gemv
def test_prefill_chunks_and_shared_heads_run_through_the_modules(wide_heads_bf16):
    loaded = wide_heads_bf16[0]
    engine = make_engine(loaded, budget_bytes=16 << 20)
    try:
        fused = engine.runner.fused
        assert fused is not None
        asyncio.run(run(engine, as_ids("a prompt of some words", loaded), max_tokens=1, ignore_eos=True))
        assert fused.num_steps == 0  # one step: the prefill, which samples the only token
        asyncio.run(run(engine, as_ids("another prompt entirely", loaded), rid="b", max_tokens=4, ignore_eos=True))
        assert fused.num_steps == 3  # the prefill by the modules, then three decode steps fused
        asyncio.run(run(engine, as_ids("another prompt entirely", loaded), rid="c", max_tokens=2, ignore_eos=True))
        assert fused.num_steps == 5  # cached but its last token: a one-token row, which it takes too
    finally:
        engine.stop()
    one = torch.zeros(1, dtype=torch.int32)
    rows = DecodeRows(one, one[None], one + 5)
    assert FusedDecode.serves(rows, 1, has_spans=False, has_prefill=False)
    assert not FusedDecode.serves(rows, 1, has_spans=True, has_prefill=False)
    assert not FusedDecode.serves(rows, 1, has_spans=False, has_prefill=True)
    assert not FusedDecode.serves(rows, 2, has_spans=False, has_prefill=False)  # a row that is no decode row
    assert not FusedDecode.serves(None, 1, has_spans=False, has_prefill=False)
    headed = dataclasses.replace(rows, first_keys=one)
    assert not FusedDecode.serves(headed, 1, has_spans=False, has_prefill=False)  # a cascade head: the modules'
    nine = torch.zeros(9, dtype=torch.int32)
    assert not FusedDecode.serves(DecodeRows(nine, nine[:, None], nine + 1), 9, has_spans=False, has_prefill=False)


def test_off_where_it_does_not_apply_with_the_reason(wide_heads_bf16, tiny):
    loaded = wide_heads_bf16[0]
    engine = make_engine(loaded, budget_bytes=16 << 20, deterministic=True)
    engine.stop()
    assert engine.runner.fused is None
    assert engine.runner.fused_detail == "off: deterministic mode"
    engine = make_engine(tiny, budget_bytes=4 << 20)  # float64: linear layers not packed, no bf16_gemv copies
    engine.stop()
    assert engine.runner.fused is None
    assert engine.runner.fused_detail == "off: its projections are not packed as one q/k/v and one gate/up product"
    if GEMV:
        engine = make_engine(loaded, budget_bytes=16 << 20, kv_dtype="int8")
        engine.stop()
        assert engine.runner.fused is None
        assert engine.runner.fused_detail == "off: needs a bf16 K/V pool (not quantized)"


def test_other_families_are_not_taken_for_llama(wide_heads_bf16):
    model = wide_heads_bf16[0].model

    class GemmaForCausalLM(torch.nn.Module):
        config = model.config

    weights, why = fused_weights(GemmaForCausalLM())
    assert weights is None
    assert "not a Llama-family model" in why
    silu = model.config.hidden_act
    model.config.hidden_act = "gelu"
    try:
        weights, why = fused_weights(model)
    finally:
        model.config.hidden_act = silu
    assert weights is None
    assert "gelu" in why


@needs_gemv
def test_the_kernel_refuses_what_it_cannot_read(wide_heads_bf16):
    loaded = wide_heads_bf16[0]
    engine = make_engine(loaded, budget_bytes=16 << 20)
    engine.stop()
    fused = engine.runner.fused
    assert fused is not None
    w, pool = fused.weights, fused.pool
    e, d = loaded.model.config.hidden_size, pool.k[0].shape[-1]

    def call(rows=1, slot=0, qkv=None):
        idx = torch.zeros(rows, dtype=torch.int32)
        return torch.ops.kvserve.decode_step(
            torch.zeros(rows, e, dtype=torch.bfloat16),
            torch.ones(rows, d, dtype=torch.bfloat16),
            torch.zeros(rows, d, dtype=torch.bfloat16),
            torch.full((rows,), slot, dtype=torch.long),
            torch.arange(rows, dtype=torch.int32),
            idx[:, None],
            idx + 1,
            w.input_norms,
            qkv or w.qkv,
            w.qkv_bias,
            w.o,
            w.post_norms,
            w.gate_up,
            w.down,
            pool.k,
            pool.v,
            w.final_norm,
            w.num_heads,
            w.num_kv_heads,
            pool.block_size,
            w.eps,
            w.scale,
            fused.tiled,
        )

    assert call().shape == (1, e)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        call(rows=9)
    with pytest.raises(RuntimeError, match="is not in the pool"):
        call(slot=pool.k[0].shape[1])
    with pytest.raises(RuntimeError, match="packed by bf16_gemv_pack"):
        call(qkv=[w.o[0]] * len(w.qkv))


def bf16_family(config, directory, tokenizer) -> object:
    """A tiny model of another family in bf16, head size 64."""
    from transformers import AutoModelForCausalLM

    config.vocab_size, config.initializer_range, config.max_position_embeddings = len(tokenizer), 0.2, 512
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return load_model(ModelSpec(id=directory.name, source=str(directory), dtype="bfloat16", device="cpu"), directory)


SHAPE = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@needs_gemv
def test_qwen2_with_its_qkv_bias_is_fused_and_qwen3_and_windows_are_not(tmp_path):
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    from tests.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    qwen2 = bf16_family(Qwen2Config(**SHAPE), tmp_path / "qwen2", tokenizer)
    assert qwen2.model.model.layers[0].self_attn.packed_q_k_v.bias is not None
    engine = make_engine(qwen2, budget_bytes=16 << 20)
    try:
        assert engine.runner.fused is not None, engine.runner.fused_detail
        assert len(engine.runner.fused.weights.qkv_bias) == 2
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        paired(engine.runner, lambda a, b: pairs.append((a.float(), b.float())))
        asyncio.run(greedy_all(engine, [as_ids("a b c d", qwen2), as_ids("e f", qwen2)], 8))
    finally:
        engine.stop()
    assert len(pairs) >= 7
    for mine, theirs in pairs:
        assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
        assert float((mine - theirs).abs().max()) <= 0.02 * float(theirs.abs().max())
    qwen3 = bf16_family(Qwen3Config(**SHAPE, head_dim=64), tmp_path / "qwen3", tokenizer)  # q and k normed per head
    engine = make_engine(qwen3, budget_bytes=16 << 20)
    engine.stop()
    assert engine.runner.fused is None
    assert engine.runner.fused_detail == "off: Qwen3ForCausalLM is not a Llama-family model"
    mistral = bf16_family(MistralConfig(**SHAPE, sliding_window=6), tmp_path / "mistral", tokenizer)
    engine = make_engine(mistral, budget_bytes=16 << 20)
    engine.stop()
    assert engine.runner.fused is None
    assert engine.runner.fused_detail == "off: its layers have a sliding window or a softcap"


@pytest.fixture(scope="module")
def default_loaded():
    spec = read_specs(ROOT / "models" / "models.toml")[0]
    return load_model(dataclasses.replace(spec, dtype="bfloat16"), ROOT / "models" / "cache")


@needs_gemv
def test_on_the_default_model_its_greedy_ids_are_the_modules(default_loaded):
    """SmolLM2-135M in bf16: a real model's logits (30 layers, GQA 9/3) fused and through the modules agree."""
    engine = make_engine(default_loaded, budget_bytes=64 << 20)
    try:
        assert engine.runner.fused is not None, engine.runner.fused_detail
        agree: list[bool] = []
        paired(engine.runner, lambda a, b: agree.append(bool(torch.equal(a.argmax(-1), b.argmax(-1)))))
        tok = default_loaded.tokenizer
        prompts = [tok(t)["input_ids"] for t in ("The capital of France is", "def fibonacci(n):")]
        asyncio.run(greedy_all(engine, prompts, 16))
    finally:
        engine.stop()
    assert len(agree) >= 15
    assert all(agree)

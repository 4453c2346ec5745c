"""The paged engine on several full-attention decoder families: greedy ids equal HF generate."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from server.engine.batch_engine import BatchEngine, PoolConfig
from server.engine.kv_store import KVStore
from server.engine.paged_attention import unpageable_reason
from server.engine.registry import ModelSpec, load_model
from tests.helpers import reference_greedy, run
from tests.tiny import build_tokenizer

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "llama": LlamaConfig(**SHAPE),
    "qwen2": Qwen2Config(**SHAPE),
    "qwen3": Qwen3Config(**SHAPE, head_dim=16),
    "mistral": MistralConfig(**SHAPE, sliding_window=None),
    "gemma": GemmaConfig(**SHAPE, head_dim=16),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_paged_engine_matches_generate(family, tmp_path):
    tokenizer = build_tokenizer()
    config = FAMILIES[family]
    config.vocab_size, config.initializer_range = len(tokenizer), 0.2
    config.max_position_embeddings = 512
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(ModelSpec(id=family, source=str(tmp_path), dtype="float64", device="cpu"), tmp_path)
    assert unpageable_reason(loaded.model, loaded.max_context) is None
    engine = BatchEngine(loaded, KVStore(1 << 30, 3600), PoolConfig(budget_bytes=1 << 22, block_size=4))
    engine.start()
    try:
        prompt = tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
        first = await run(engine, prompt, session="s", max_tokens=10, ignore_eos=True)
        assert first.token_ids == reference_greedy(loaded.model, prompt, 10)
        follow = prompt + first.token_ids + tokenizer(" Paris is")["input_ids"]
        second = await run(engine, follow, session="s", max_tokens=6, ignore_eos=True)
        assert second.usage.cached_tokens >= len(prompt)
        assert second.token_ids == reference_greedy(loaded.model, follow, 6)
    finally:
        engine.stop()

"""The one engine on several decoder families: greedy ids equal HF generate, across a continued session turn
and in a batch. Sliding windows smaller than the prompt (Mistral, Qwen2's upper layers, Gemma-2's alternate
layers) and Gemma-2's logit soft-capping are honoured by the paged attention itself."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    Gemma2Config,
    GemmaConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from server.kv import backends, kernels
from server.kv.attention import unsupported_reason
from server.kv.routing import HEAD, SDPA
from server.models.loader import ModelLoadError, ModelSpec, load_model
from tests.helpers import make_engine, reference_greedy, run
from tests.tiny import build_tokenizer

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
SOFTCAP = 1.0  # small, so the cap really bites (Gemma-2 itself uses 50)
WINDOW = 6  # far shorter than the prompts below (~20 tokens, ~40 on the second turn)
FAMILIES = {
    "llama": lambda: LlamaConfig(**SHAPE),
    "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=16),
    "gemma": lambda: GemmaConfig(**SHAPE, head_dim=16),
    "mistral-window": lambda: MistralConfig(**SHAPE, sliding_window=WINDOW),
    # layer 0 full attention, layer 1 a sliding window
    "qwen2-window": lambda: Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    # alternating sliding/global layers, attention logits soft-capped
    "gemma2-softcap": lambda: Gemma2Config(
        **SHAPE | {"num_hidden_layers": 4},
        head_dim=16,
        sliding_window=WINDOW,
        attn_logit_softcapping=SOFTCAP,
        final_logit_softcapping=None,
        query_pre_attn_scalar=16,
    ),
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def save_family(family: str, tokenizer, directory) -> ModelSpec:
    config = FAMILIES[family]()
    config.vocab_size, config.initializer_range = len(tokenizer), 0.2
    config.max_position_embeddings = 512
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return ModelSpec(id=family, source=str(directory), dtype="float64", device="cpu")


def hf_reference(directory):
    """An independent reference: the same weights through transformers' own eager attention, no kvserve code."""
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager").eval()


# The Triton backend (in triton's interpreter here: slower) on the families that differ in its kernels' terms:
# plain GQA, a window on every layer, on some layers, and windows with softcaps.
TRITON_FAMILIES = ("llama", "mistral-window", "qwen2-window", "gemma2-softcap")
PATHS = [(f, p) for f in sorted(FAMILIES) for p in ("kernel", "cascade", "sdpa")] + [
    (f, "triton") for f in TRITON_FAMILIES
]


@pytest.mark.parametrize(("family", "path"), PATHS)
async def test_paged_engine_matches_generate(family, path, tokenizer, tmp_path, monkeypatch):
    spec = save_family(family, tokenizer, tmp_path)
    loaded = load_model(spec, tmp_path)
    reference = hf_reference(tmp_path)
    if path == "sdpa":  # the portable path: a machine without a compiler
        monkeypatch.setattr(kernels, "paged_decode_available", lambda: False)
    if path == "cascade":  # every decode row counts as long: heads where the layers allow, else whole rows
        monkeypatch.setattr(backends, "KERNEL_MAX_CONTEXT", 4)
    # triton: the GPU's kernels, here in triton's interpreter (windows and softcaps in the kernels)
    engine = make_engine(loaded, budget_bytes=1 << 22, block_size=4, attention="triton" if path == "triton" else "auto")
    backend = engine.runner.backend
    assert backend.name == (path if path in ("sdpa", "triton") else "kernel")  # float64: the decode kernel's pools
    if path in ("kernel", "cascade"):
        assert backend.uses_heads == (family in ("gemma", "llama", "qwen3"))
    if path == "cascade":  # lone long rows: a head of their leading run where the layers allow, else SDPA on a view
        backend.lone_rows = HEAD if backend.uses_heads else SDPA
    try:
        prompt = tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
        assert len(prompt) > 2 * WINDOW
        first = await run(engine, prompt, session="s", max_tokens=10, ignore_eos=True)
        assert first.token_ids == reference_greedy(reference, prompt, 10)
        follow = prompt + first.token_ids + tokenizer(" Paris is")["input_ids"]
        second = await run(engine, follow, session="s", max_tokens=6, ignore_eos=True)
        assert second.usage.cached_tokens == len(prompt) + 10 - 1  # continued from the session's K/V
        assert second.token_ids == reference_greedy(reference, follow, 6)
        others = [tokenizer(text)["input_ids"] for text in ("Paris is the capital", "Hello world, hello kvserve.")]
        engine.loop.max_batch_seen = 0
        batched = await asyncio.gather(
            *(run(engine, ids, rid=f"b{i}", max_tokens=8, ignore_eos=True) for i, ids in enumerate([follow, *others]))
        )
        assert engine.loop.max_batch_seen >= 2
        for ids, result in zip([follow, *others], batched, strict=True):
            assert result.token_ids == reference_greedy(reference, ids, 8)
    finally:
        engine.stop()


def test_a_model_whose_attention_needs_more_is_refused():
    config = GptOssConfig(**SHAPE, vocab_size=64, head_dim=16, num_local_experts=2, num_experts_per_tok=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    reason = unsupported_reason(model)
    assert reason is not None
    assert "s_aux" in reason  # attention sinks: served without them, every answer would change
    assert model.config._attn_implementation != "kvserve_probe"  # the probe leaves the model as it was


def test_a_model_without_the_attention_interface_is_refused_at_load(tokenizer, tmp_path):
    config = BloomConfig(vocab_size=len(tokenizer), hidden_size=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelSpec(id="old-bloom", source=str(tmp_path), dtype="float32", device="cpu"), tmp_path)
    message = str(info.value)
    assert "old-bloom" in message
    assert "does not route attention through transformers' attention interface" in message

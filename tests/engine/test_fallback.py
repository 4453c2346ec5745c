"""A model the paged pool cannot serve (sliding window) runs on the per-session path, and says so."""

from __future__ import annotations

import logging

import torch
from transformers import MistralConfig, MistralForCausalLM

from server.engine import sequence as sequence_module
from server.engine.kv_store import KVStore
from server.engine.registry import ModelSpec
from server.engine.types import SessionKey
from server.engine.worker import Engine
from server.hosting import ModelHost
from server.settings import Settings
from tests.helpers import run
from tests.tiny import build_tokenizer


async def test_sliding_window_model_falls_back_with_one_log_line(tmp_path, caplog):
    tokenizer = build_tokenizer()
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    spec = ModelSpec(id="slide", source=str(tmp_path), dtype="float32", device="cpu")
    host = ModelHost(Settings(), [spec])
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        host.start()
        host.wait_loaded(60)
    engine = host.engines["slide"]
    assert isinstance(engine, Engine)
    lines = [r.getMessage() for r in caplog.records if "cannot use the paged K/V pool" in r.getMessage()]
    assert len(lines) == 1 and "sliding window of 8" in lines[0]
    prompt = tokenizer("Hello world, hello kvserve.")["input_ids"]
    first = await run(engine, prompt, session="s", max_tokens=4, ignore_eos=True)
    second = await run(engine, prompt + first.token_ids + prompt, session="s", max_tokens=4, ignore_eos=True)
    assert second.usage.cached_tokens == len(prompt) + 3  # a pure extension reuses the session's cache
    host.close()


async def test_out_of_memory_on_the_per_session_engine_drops_idle_caches(tiny, monkeypatch):
    store = KVStore(budget_bytes=1 << 30, ttl_s=3600)
    engine = Engine(tiny, store)
    engine.start()
    try:
        prompt = tiny.tokenizer("Hello world")["input_ids"]
        await run(engine, prompt, session="idle", max_tokens=3, ignore_eos=True)
        assert store.info(SessionKey("default", "idle")).nbytes > 0
        real = sequence_module.Sequence.prefill

        def out_of_memory(self, *args):
            raise torch.OutOfMemoryError("out of memory (injected)")

        monkeypatch.setattr(sequence_module.Sequence, "prefill", out_of_memory)
        failed = await run(engine, prompt, session="other", max_tokens=3)
        assert failed.error.code == "out_of_memory"
        assert store.info(SessionKey("default", "idle")).nbytes == 0  # device memory given back
        assert store.info(SessionKey("default", "idle")).num_transcript_tokens > 0  # the transcript stays
        monkeypatch.setattr(sequence_module.Sequence, "prefill", real)
        assert (await run(engine, prompt, session="idle", max_tokens=3)).error is None
    finally:
        engine.stop()

"""GGUF -> safetensors, once: dequantizing takes tens of seconds, reloading the result about one."""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm

log = logging.getLogger("kvserve.convert")
FINGERPRINT_BYTES = 4 << 20


def gguf_cache_dir(gguf: Path, cache_dir: Path, model_id: str) -> Path:
    """One directory per GGUF content: size plus a hash of its first bytes (hashing 100 MB+ each start is waste)."""
    digest = hashlib.sha256(str(gguf.stat().st_size).encode())
    with open(gguf, "rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
    safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)
    return cache_dir / f"{safe_id}-{digest.hexdigest()[:16]}"


def convert_gguf(gguf: Path, target: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf.name, target)
    steps = tqdm(total=4, desc=f"kvserve: converting {gguf.name}", unit="step")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    steps.update()
    # A GGUF-loaded model refuses save_pretrained: rebuild it from a config without the quantization entry.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    steps.update()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)  # atomic: a crash mid-way never leaves a half-written cache
    steps.update()
    steps.close()

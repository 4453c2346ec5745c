from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests may reach a hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ["KVSERVE_STATE_DIR"] = ""  # memory only, unless a test gives its app a directory of its own

import torch

if not torch.cuda.is_available():  # the Triton kernels run on CPU tensors in triton's interpreter (read at definition)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from server.models.loader import LoadedModel, ModelSpec, load_model
from tests.tiny import save_tiny


@pytest.fixture(scope="session")
def tiny_spec(tmp_path_factory) -> ModelSpec:
    return save_tiny(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny(tiny_spec) -> LoadedModel:
    return load_model(tiny_spec, Path("unused-cache"))


@pytest.fixture(scope="session")
def wide_heads_bf16(tmp_path_factory) -> tuple[LoadedModel, Path]:
    """A tiny Llama with head size 64 in bf16 (the shapes the paged prefill kernel serves), and its directory."""
    from tests.tiny import build_model, build_tokenizer

    directory = tmp_path_factory.mktemp("wide-heads")
    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    build_model(len(tokenizer), eos, hidden_size=256, intermediate_size=256).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    spec = ModelSpec(id="wide", source=str(directory), dtype="bfloat16", device="cpu", max_context=4096)
    return load_model(spec, Path("unused")), directory

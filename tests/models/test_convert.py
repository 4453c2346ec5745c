"""GGUF conversion into the cache directory: once between processes (or threads) that start at once, into a
directory of their own renamed into place, with what a failed or dead conversion left removed."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from server.models import convert as convert_mod
from server.models.convert import converted, gguf_cache_dir
from server.startup import Startup
from tests.helpers import DEADLINE_S, wait_until
from tests.tiny import build_tokenizer
from tests.tiny_gguf import save_tiny_gguf

WAITING = "waiting for another process converting"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return save_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_the_tiny_gguf_reads_back_as_the_tiny_model(gguf_file):
    """transformers' GGUF loader reads what tests/tiny_gguf.py writes: the same tokenizer, a Llama of its shapes."""
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    text = "Hello world, <|im_start|>user\nCaf\u00e9 \U0001f600<|im_end|>"
    assert tokenizer(text)["input_ids"] == build_tokenizer()(text)["input_ids"]
    assert tokenizer.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    assert (model.config.model_type, model.config.num_hidden_layers, model.config.vocab_size) == ("llama", 2, 400)


def test_threads_converting_at_once_convert_once_and_both_get_the_target(gguf_file, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    started, release = threading.Event(), threading.Event()
    calls: list[Path] = []

    def slow_convert(gguf: Path, directory: Path, startup: Startup) -> None:
        calls.append(directory)
        started.set()
        assert release.wait(DEADLINE_S), "the test never let the conversion finish"
        (directory / "model.safetensors").write_bytes(b"converted")

    monkeypatch.setattr(convert_mod, "convert_gguf", slow_convert)
    results: dict[str, Path] = {}

    def replica(name: str) -> None:
        results[name] = converted(gguf_file, cache, "tiny")

    first = threading.Thread(target=replica, args=("first",))
    second = threading.Thread(target=replica, args=("second",))
    with caplog.at_level(logging.INFO, logger="kvserve.convert"):
        first.start()
        assert started.wait(DEADLINE_S), "the first conversion never started"
        second.start()  # while the first converts
        wait_until(lambda: WAITING in caplog.text or len(calls) > 1, what="the second to wait for the first")
        release.set()
        first.join(DEADLINE_S)
        second.join(DEADLINE_S)
    target = gguf_cache_dir(gguf_file, cache, "tiny")
    assert len(calls) == 1, f"converted {len(calls)} times"
    assert results == {"first": target, "second": target}
    assert (target / "model.safetensors").read_bytes() == b"converted"
    assert calls[0].name.startswith(f"{target.name}.")  # written elsewhere, then renamed
    assert calls[0].name.endswith(".partial")
    assert sorted(p.name for p in cache.iterdir()) == [target.name, f"{target.name}.lock"]
    assert "was converted by another process meanwhile" in caplog.text


def test_a_failed_conversion_leaves_nothing_and_a_dead_ones_directory_goes(gguf_file, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    target = gguf_cache_dir(gguf_file, cache, "tiny")

    def failing(gguf: Path, directory: Path, startup: Startup) -> None:
        (directory / "half.safetensors").write_bytes(b"half")
        raise RuntimeError("out of disk")

    monkeypatch.setattr(convert_mod, "convert_gguf", failing)
    with pytest.raises(RuntimeError, match="out of disk"):
        converted(gguf_file, cache, "tiny")
    assert sorted(p.name for p in cache.iterdir()) == [f"{target.name}.lock"]

    dead = cache / f"{target.name}.4242-deadbeef.partial"  # a process killed mid-conversion left this
    dead.mkdir()
    (dead / "half.safetensors").write_bytes(b"half")
    monkeypatch.setattr(
        convert_mod, "convert_gguf", lambda gguf, directory, startup: (directory / "config.json").write_text("{}")
    )
    assert converted(gguf_file, cache, "tiny") == target
    assert sorted(p.name for p in cache.iterdir()) == [target.name, f"{target.name}.lock"]


def test_a_real_conversion_is_loadable(gguf_file, tmp_path):
    target = converted(gguf_file, tmp_path / "cache", "tiny")
    assert (target / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.config.num_hidden_layers == 2

"""The K/V fingerprint covers what decides a token's K/V: every stored weight (a change anywhere, a k_proj deep in
the model included), the config, the tokenizer and the dtype; the weights' digest is kept beside them, so a
second load reads it instead of the weights."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from server.engine.model_runner import ModelRunner
from server.models import digest
from server.models.digest import DIGEST_FILE, state_dict_digest, weights_digest
from server.models.loader import LoadedModel, ModelSpec, load_model
from tests.tiny import build_model


def tensor_ends(path: Path) -> dict[str, int]:
    """Where each tensor's bytes end in a safetensors file."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    base = 8 + header_len
    return {name: base + info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"}


def copy_model(tiny_spec: ModelSpec, directory: Path) -> ModelSpec:
    shutil.copytree(tiny_spec.source, directory)
    (directory / DIGEST_FILE).unlink(missing_ok=True)  # the session's copy may hold one already
    return dataclasses.replace(tiny_spec, source=str(directory))


def fingerprint(loaded: LoadedModel) -> str:
    return ModelRunner(loaded, budget_bytes=1 << 20, block_size=4).fingerprint


@pytest.fixture
def counted(monkeypatch) -> list[int]:
    """How many times the weights were read and digested (not read from the cache)."""
    calls: list[int] = []
    original = digest._digest_tensors

    def counting(files: list[Path]) -> str:
        calls.append(len(files))
        return original(files)

    monkeypatch.setattr(digest, "_digest_tensors", counting)
    return calls


def test_every_byte_of_every_tensor_changes_the_weights_digest(tiny_spec, tmp_path):
    weights = Path(tiny_spec.source) / "model.safetensors"
    tensors = tensor_ends(weights)
    names = set(tensors)
    assert {"model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight"} <= names
    original = weights.read_bytes()
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "model.safetensors").write_bytes(original)
    seen = {"base": weights_digest(tmp_path / "base")}
    for i, (name, end) in enumerate(sorted(tensors.items())):
        # The tensor's last byte: past the first 4096 values of any tensor of a real model.
        changed = bytearray(original)
        changed[end - 1] ^= 0x01
        directory = tmp_path / f"t{i}"
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(changed)
        seen[name] = weights_digest(directory)
    # And the same bytes under another name: another model (the name says which computation a tensor is in).
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    tensors_by_name = load_file(weights)
    tensors_by_name["model.norm.weight_"] = tensors_by_name.pop("model.norm.weight")
    save_file(tensors_by_name, renamed / "model.safetensors", metadata={"format": "pt"})
    seen["renamed"] = weights_digest(renamed)
    assert len(set(seen.values())) == len(seen), seen  # each change gives a digest of its own


def test_a_changed_k_proj_gives_another_fingerprint_and_a_changed_dtype_too(tiny_spec, tmp_path):
    base = load_model(tiny_spec, Path("unused"))
    spec = copy_model(tiny_spec, tmp_path / "tuned")
    weights = Path(spec.source) / "model.safetensors"
    end = tensor_ends(weights)["model.layers.1.self_attn.k_proj.weight"]
    data = bytearray(weights.read_bytes())
    data[end - 8 : end] = struct.pack("<d", 0.125)  # a fine-tune that moved the last value of one k_proj
    weights.write_bytes(data)
    tuned = load_model(spec, Path("unused"))
    assert base.digests is not None
    assert tuned.digests is not None
    assert tuned.digests.weights != base.digests.weights
    assert (tuned.digests.config, tuned.digests.tokenizer) == (base.digests.config, base.digests.tokenizer)
    assert fingerprint(tuned) != fingerprint(base)

    as_float32 = load_model(dataclasses.replace(tiny_spec, dtype="float32"), Path("unused"))
    assert as_float32.digests == base.digests  # the same files
    assert fingerprint(as_float32) != fingerprint(base)  # another dtype: other K/V
    assert fingerprint(load_model(tiny_spec, Path("unused"))) == fingerprint(base)  # and a reload: the same


def test_the_tokenizer_and_the_config_are_part_of_the_fingerprint(tiny_spec, tmp_path):
    base = load_model(tiny_spec, Path("unused"))
    spec = copy_model(tiny_spec, tmp_path / "other-tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(spec.source)
    tokenizer.add_tokens(["<|tool|>"])  # one added token: other ids for a text that holds it
    tokenizer.save_pretrained(spec.source)
    other_tokenizer = load_model(spec, Path("unused"))
    assert base.digests is not None
    assert other_tokenizer.digests is not None
    assert other_tokenizer.digests.tokenizer != base.digests.tokenizer
    assert other_tokenizer.digests.weights == base.digests.weights
    assert fingerprint(other_tokenizer) != fingerprint(base)

    spec = copy_model(tiny_spec, tmp_path / "other-config")
    config = json.loads((Path(spec.source) / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10  # the same tensors, computed with otherwise
    (Path(spec.source) / "config.json").write_text(json.dumps(config))
    other_config = load_model(spec, Path("unused"))
    assert other_config.digests is not None
    assert other_config.digests.config != base.digests.config
    assert fingerprint(other_config) != fingerprint(base)


def test_the_digest_is_read_from_beside_the_weights_on_the_next_load(tiny_spec, tmp_path, counted):
    spec = copy_model(tiny_spec, tmp_path / "model")
    first = load_model(spec, Path("unused"))
    assert counted == [1]
    assert (Path(spec.source) / DIGEST_FILE).exists()
    second = load_model(spec, Path("unused"))
    assert counted == [1]  # read from the cache
    assert second.digests == first.digests

    # New weights in the same place, the same size: the cache no longer holds and they are read again.
    weights = Path(spec.source) / "model.safetensors"
    end = tensor_ends(weights)["model.layers.0.self_attn.v_proj.weight"]
    data = bytearray(weights.read_bytes())
    data[end - 1] ^= 0x01
    weights.write_bytes(data)
    third = load_model(spec, Path("unused"))
    assert counted == [1, 1]
    assert third.digests is not None
    assert first.digests is not None
    assert third.digests.weights != first.digests.weights


def test_a_digest_it_cannot_keep_is_computed_at_each_load_and_said(tiny_spec, tmp_path, counted, caplog):
    spec = copy_model(tiny_spec, tmp_path / "model")
    (Path(spec.source) / DIGEST_FILE).mkdir()  # what stands there cannot be read as, nor replaced by, a file
    with caplog.at_level(logging.INFO, logger="kvserve.registry"):
        digests = [weights_digest(Path(spec.source)) for _ in range(2)]
    assert counted == [1, 1]
    assert digests[0] == digests[1] == load_model(tiny_spec, Path("unused")).digests.weights  # type: ignore[union-attr]
    assert "is not cached in" in caplog.text
    assert [path.name for path in Path(spec.source).iterdir() if path.name.endswith(".partial")] == []


def test_the_weights_digest_does_not_depend_on_how_they_are_sharded(tiny_spec, tmp_path, counted):
    tensors = load_file(Path(tiny_spec.source) / "model.safetensors")
    names = sorted(tensors)
    # Two shards, the second half of the names in the first file: read in file order, they would come out of order.
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[half:], "model-00002-of-00002.safetensors": names[:half]}
    directory = tmp_path / "sharded"
    directory.mkdir()
    for file, held in shards.items():
        save_file({name: tensors[name] for name in held}, directory / file, metadata={"format": "pt"})
    weight_map = {name: file for file, held in shards.items() for name in held}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert weights_digest(directory) == weights_digest(Path(tiny_spec.source))
    assert counted[0] == 2  # both shards were read


def test_a_model_without_weight_files_is_digested_from_its_parameters():
    model = build_model(vocab_size=300, eos_id=1)
    before = state_dict_digest(model)
    assert state_dict_digest(build_model(vocab_size=300, eos_id=1)) == before  # the same seed, the same weights
    with torch.no_grad():
        model.model.layers[-1].self_attn.v_proj.weight.view(-1)[-1] += 1e-6  # the last value of the last v_proj
    assert state_dict_digest(model) != before


def test_a_hub_models_weights_are_digested_from_its_snapshot(tiny_spec, tmp_path):
    """`hf:ORG/NAME` from the local hub cache (offline): the snapshot's files are digested, as a directory's are.
    In a fresh interpreter: the hub's cache location is read when huggingface_hub is imported."""
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_spec.source, snapshot)
    (snapshot / DIGEST_FILE).unlink(missing_ok=True)
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    script = (
        "from pathlib import Path\n"
        "from server.models.loader import ModelSpec, load_model\n"
        "spec = ModelSpec(id='t', source='hf:org/tiny', dtype='float64', device='cpu')\n"
        "print(load_model(spec, Path('unused')).digests.weights)\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == weights_digest(Path(tiny_spec.source))
    assert (snapshot / DIGEST_FILE).exists()  # kept beside the snapshot's files

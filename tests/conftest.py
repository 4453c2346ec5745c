from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests may reach a hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ["KVSERVE_STATE_DIR"] = ""  # memory only, unless a test gives its app a directory of its own

from server.models.loader import LoadedModel, ModelSpec, load_model
from tests.tiny import save_tiny


@pytest.fixture(scope="session")
def tiny_spec(tmp_path_factory) -> ModelSpec:
    return save_tiny(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny(tiny_spec) -> LoadedModel:
    return load_model(tiny_spec, Path("unused-cache"))

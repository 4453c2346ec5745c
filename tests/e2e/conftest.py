"""Fixtures every end-to-end test shares."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture
def model_dir(tiny_spec, tmp_path) -> Path:
    """The tiny model in a directory named "model": `--model DIR` serves it under that id."""
    return Path(shutil.copytree(tiny_spec.source, tmp_path / "model"))

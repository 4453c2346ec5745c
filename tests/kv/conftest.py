"""Fixtures the K/V tests share."""

from __future__ import annotations

import pytest

from server.kv.disk_blocks import DiskBlocks


@pytest.fixture(params=["disk", "redis"])
def backend(request, tmp_path):
    """Each backend of the block store: a disk directory, and a real redis-server on loopback."""
    if request.param == "disk":
        yield DiskBlocks(tmp_path / "blocks")
        return
    from server.kv.redis_blocks import RedisBlocks
    from tests.e2e.redis_server import Redis

    server = Redis(tmp_path)
    blocks = RedisBlocks(server.url)
    yield blocks
    blocks.close()
    server.stop()

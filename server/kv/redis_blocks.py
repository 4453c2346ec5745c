"""The block store's Redis backend: the K/V tier replicas share (KVSERVE_SHARED_URL).

Blocks live at `kvserve:blk:<address>` and are only ever added with SET NX: the address names
the content, so a block is written once by whichever replica computed it first. Nothing here
deletes a block a session still reaches on another replica; Redis' own `maxmemory` and
eviction policy bound the tier. Imported only when a shared store is configured.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvserve.shared")
PREFIX = "kvserve:blk:"


class RedisBlocks:
    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        import redis  # only with a shared store configured

        self.errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self.client: Any = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def held(self, names: list[str]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.exists(PREFIX + name)
        return [bool(found) for found in pipe.execute()]

    def write(self, items: list[tuple[str, bytes]]) -> int:
        pipe = self.client.pipeline(transaction=False)
        for name, value in items:
            pipe.set(PREFIX + name, value, nx=True)
        return sum(1 for ok in pipe.execute() if ok)

    def read(self, names: list[str]) -> list[bytes | None]:
        return list(self.client.mget([PREFIX + name for name in names]))

    def delete(self, names: list[str]) -> None:
        self.client.delete(*[PREFIX + name for name in names])

    def close(self) -> None:
        self.client.close()

    def announce(self, model_id: str, fingerprint: str) -> None:
        """Say which K/V layout this replica serves `model_id` with; warn when another replica said another.
        Replicas whose layouts differ (a dtype `auto` settled differently, other weights under one id) share
        no block: each is correct alone, but every failover recomputes."""
        name = f"kvserve:layout:{model_id}"
        try:
            held = None if self.client.set(name, fingerprint, nx=True) else self.client.get(name)
        except self.errors:
            log.warning("the shared store did not answer: model %s's K/V layout was not compared", model_id)
            return
        if held is not None and held.decode() != fingerprint:
            log.warning(
                "model %s: this replica's K/V layout (%s) differs from another replica's (%s): they share no "
                "K/V blocks; pin the dtype in models.toml on every replica",
                model_id,
                fingerprint,
                held.decode(),
            )

"""The block store's Redis backend: the K/V tier replicas share (KVSERVE_SHARED_URL).

Blocks live at `kvserve:blk:<address>` and are only ever added with SET NX: the address names
the content, so a block is written once by whichever replica computed it first. Nothing here
deletes a block a session still reaches on another replica; Redis' own `maxmemory` and
eviction policy bound the tier (KVSERVE_SHARED_BLOCKS_URL: a Redis of their own, which may
evict). Imported only when a shared store is configured.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvserve.shared")
PREFIX = "kvserve:blk:"
EPOCH = "kvserve:blocks-epoch"  # a random id: lost with the blocks when their Redis restarts empty or is flushed


class RedisBlocks:
    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        import redis  # only with a shared store configured

        self.errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self.client: Any = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._stop = threading.Event()
        self._epoch: str | None = None

    def watch(self, on_loss: Callable[[], None], every_s: float = 2.0) -> None:
        """Call `on_loss()` when this Redis is found to have lost its blocks (its epoch key gone or changed; checked
        every `every_s` on a thread of its own): blocks taken as held are then stored again."""
        threading.Thread(target=self._watch, args=(on_loss, every_s), name="kvserve-blocks-epoch", daemon=True).start()

    def _watch(self, on_loss: Callable[[], None], every_s: float) -> None:
        while True:
            try:
                self.client.set(EPOCH, secrets.token_hex(16), nx=True)
                found = self.client.get(EPOCH)
                epoch = found.decode() if isinstance(found, bytes) else str(found)
                if self._epoch is not None and epoch != self._epoch:
                    log.warning("the K/V blocks' Redis lost its data: blocks are stored again as they are used")
                    on_loss()
                self._epoch = epoch
            except self.errors:
                pass  # not answering: the writer's failures say so, and a write failure forgets the blocks held
            except Exception:  # never let the watcher die
                log.exception("watching the K/V blocks' Redis failed")
            if self._stop.wait(every_s):
                return

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
        self._stop.set()
        self.client.close()

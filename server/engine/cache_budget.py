"""The per-session engine's caches in the session store: take one for a turn, evict idle ones to a budget.

(The batching engine keeps K/V in its paged pool instead; for it these entries hold no cache.)
"""

from __future__ import annotations

from typing import Any

from server.engine.session import Entry, common_prefix_len


class CacheBudget:
    """Mixed into KVStore: `_lock`, `_entries`, `budget_bytes`, `num_evictions` and `_expire_locked` are its."""

    def take_cache(self, entry: Entry, prompt_ids: list[int]) -> tuple[Any, int]:
        """The entry's cache and how many prompt tokens it already holds (at least one left to compute)."""
        with self._lock:
            cache, cached_ids = entry.cache, entry.cached_ids
            entry.cache, entry.cached_ids, entry.nbytes = None, [], 0
        if cache is None:
            return None, 0
        return cache, min(common_prefix_len(cached_ids, prompt_ids), len(prompt_ids) - 1)

    def make_room(self, num_bytes: int) -> None:
        """Evict idle entries so that `num_bytes` more fit in the budget (as far as idle entries allow)."""
        with self._lock:
            self._expire_locked()
            self._evict_locked(num_bytes)

    def _evict_locked(self, extra_bytes: int) -> None:
        total = sum(e.nbytes for e in self._entries.values())
        if total + extra_bytes <= self.budget_bytes:
            return
        idle = sorted(
            (e for e in self._entries.values() if not e.is_in_use and e.cache is not None),
            key=lambda e: e.last_use,
        )
        for entry in idle:
            if total + extra_bytes <= self.budget_bytes:
                break
            total -= entry.nbytes
            entry.cache, entry.cached_ids, entry.nbytes = None, [], 0
            self.num_evictions += 1
            if entry.key.is_bucket:
                del self._entries[entry.key]  # a bucket without K/V holds nothing worth keeping

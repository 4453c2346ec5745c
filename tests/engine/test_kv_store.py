"""KV store and cache unit tests on CPU with small tensors."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from server.engine.journal import Journal
from server.engine.kv_cache import cache_nbytes, crop_cache, new_cache
from server.engine.kv_store import KVStore
from server.engine.session import CompletedTurn
from server.engine.tiers import TierStore
from server.engine.types import SessionBusy, SessionKey, SessionModelMismatch, Usage

CONFIG = LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=8, vocab_size=50)
HEAD_DIM = 4
TOKEN_BYTES = 2 * 2 * 1 * HEAD_DIM * 4  # K+V x layers x kv_heads x head_dim x fp32


def filled_cache(num_tokens: int):
    cache = new_cache(CONFIG)
    for layer in range(2):
        kv = torch.randn(1, 1, num_tokens, HEAD_DIM)
        cache.update(kv, kv.clone(), layer)
    return cache


ENTRY_BYTES = (10 + 10 // 8) * TOKEN_BYTES  # an idle 10-token entry with its headroom


def held_bytes(cache) -> int:
    """Independent count: every distinct storage behind the layers' tensors."""
    storages = {}
    for layer in cache.layers:
        for t in (layer._k_buf, layer._v_buf):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def key(name: str) -> SessionKey:
    return SessionKey("default", name)


def turn(ids: list[int]) -> CompletedTurn:
    return CompletedTurn(ids, "", "stop", Usage(len(ids), 0, 0), None)


def put(store: KVStore, name: str, ids: list[int], clock: Clock | None = None):
    entry = store.acquire(key(name), "m")
    cache, _ = store.take_cache(entry, ids)
    store.release(entry, filled_cache(len(ids)), ids, turn(ids))
    if clock:
        clock.now += 1
    return entry


def test_hit_partial_hit_and_miss(store):
    put(store, "a", [1, 2, 3, 4, 5])
    entry = store.acquire(key("a"), "m")
    cache, hit = store.take_cache(entry, [1, 2, 3, 4, 5, 6, 7])
    assert hit == 5  # full hit: all cached tokens reused
    store.release(entry, cache, [1, 2, 3, 4, 5], None)
    entry = store.acquire(key("a"), "m")
    assert store.take_cache(entry, [1, 2, 3, 4, 5])[1] == 4  # identical prompt: one token recomputed
    store.release(entry, filled_cache(5), [1, 2, 3, 4, 5], None)
    entry = store.acquire(key("a"), "m")
    assert store.take_cache(entry, [1, 2, 9, 9])[1] == 2  # partial hit (edited history)
    store.release(entry, filled_cache(5), [1, 2, 3, 4, 5], None)
    entry = store.acquire(key("a"), "m")
    assert store.take_cache(entry, [7, 8])[1] == 0  # miss


def test_crop_keeps_prefix_and_growth_appends_in_place():
    cache = filled_cache(10)
    keys_before = cache.layers[0].keys.clone()
    assert crop_cache(cache, 6)
    assert cache.get_seq_length() == 6
    assert torch.equal(cache.layers[0].keys, keys_before[..., :6, :])
    new = torch.ones(1, 1, 1, HEAD_DIM)
    cache.update(new, new, 0)
    assert torch.equal(cache.layers[0].keys[..., 6, :], new[..., 0, :])


def test_byte_accounting_counts_the_storage_really_held():
    cache = filled_cache(300)  # grown past its first capacity
    assert cache_nbytes(cache) == held_bytes(cache)
    assert cache_nbytes(cache) >= 300 * TOKEN_BYTES
    before = cache_nbytes(cache)
    crop_cache(cache, 10)  # a crop is a view: the storage is still held and still counted
    assert cache_nbytes(cache) == before == held_bytes(cache)


def test_store_bytes_after_release_equal_the_storage_held(store):
    entry = store.acquire(key("b"), "m")
    cache = filled_cache(2000)
    crop_cache(cache, 120)
    store.release(entry, cache, list(range(120)), turn(list(range(121))))
    held = held_bytes(cache)
    assert store.info(key("b")).nbytes == held == store.stats().nbytes
    assert held == (120 + 120 // 8) * TOKEN_BYTES  # idle: spare capacity given back, an eighth kept as headroom


def test_lru_eviction_order_keeps_transcripts():
    clock = Clock()
    store = KVStore(budget_bytes=int(2.5 * ENTRY_BYTES), ttl_s=1e9, clock=clock)
    for name in ("a", "b"):
        put(store, name, list(range(10)), clock)
    store.release(store.acquire(key("a"), "m"), *_keep(store, "a"))  # touch a: b is now least recent
    clock.now += 1
    put(store, "c", list(range(10)), clock)  # 3 entries > budget of 2.5: evict one, the LRU
    assert store.info(key("b")).num_cached_tokens == 0
    assert store.info(key("b")).num_transcript_tokens == 10  # the transcript survives eviction
    assert store.info(key("a")).num_cached_tokens == 10
    assert store.info(key("c")).num_cached_tokens == 10
    assert store.num_evictions == 1


def _keep(store, name):
    entry = store._entries[key(name)]
    return entry.cache, entry.cached_ids, None


def test_in_use_entry_is_never_evicted():
    store = KVStore(budget_bytes=int(2.5 * ENTRY_BYTES), ttl_s=1e9)
    put(store, "busy", list(range(10)))
    put(store, "idle", list(range(10)))
    entry = store.acquire(key("busy"), "m")  # the least recently used, but in use
    store.make_room(2 * ENTRY_BYTES)  # over budget: only the idle one may go
    assert entry.cache is not None and entry.cached_ids == list(range(10))
    assert store.info(key("idle")).num_cached_tokens == 0


def test_busy_session_and_model_mismatch(store):
    store.acquire(key("x"), "m")
    with pytest.raises(SessionBusy):
        store.acquire(key("x"), "m")
    put(store, "y", [1, 2])
    with pytest.raises(SessionModelMismatch):
        store.acquire(key("y"), "other")


def test_bucket_never_locks(store):
    bucket = SessionKey("default", "shared", kind="bucket")
    first = store.acquire(bucket, "m")
    assert first is not None
    assert store.acquire(bucket, "m") is None  # busy bucket: the request just runs without it


def test_ttl_forgets_idle_sessions():
    clock = Clock()
    store = KVStore(budget_bytes=1 << 30, ttl_s=10, clock=clock)
    put(store, "old", [1, 2, 3])
    clock.now = 11
    assert store.info(key("old")) is None
    assert store.num_expired == 1


def test_tenants_are_separate_namespaces(store):
    put(store, "same", [1, 2, 3])
    assert store.info(SessionKey("other-tenant", "same")) is None


def test_delete_while_running_drops_the_state(store):
    entry = store.acquire(key("d"), "m")
    assert store.delete(key("d"))
    store.release(entry, filled_cache(4), [1, 2, 3, 4], turn([1, 2, 3, 4]))
    assert store.info(key("d")) is None and store.stats().nbytes == 0


def test_a_turn_the_journal_cannot_write_is_not_applied(tmp_path):
    class FullDisk(Journal):
        def save(self, key, record):
            raise OSError(28, "No space left on device")

    store = KVStore(budget_bytes=1 << 30, ttl_s=3600, journal=FullDisk(tmp_path))
    entry = store.acquire(key("j"), "m")
    with pytest.raises(OSError):
        store.release(entry, turn=turn([1, 2, 3]))
    info = store.info(key("j"))
    assert info.num_turns == 0 and info.num_transcript_tokens == 0 and not info.is_in_use  # as before the turn


def test_a_journal_write_after_delete_does_not_bring_the_session_back(tmp_path):
    journal = Journal(tmp_path)
    journal.delete(key("gone"))
    journal.save(key("gone"), {"x": 1})
    assert journal.load_all() == []
    journal.revive(key("gone"))
    journal.save(key("gone"), {"x": 1})
    assert journal.load_all() == [{"x": 1}]


def test_expiring_buckets_with_any_name_touch_no_files(tmp_path):
    clock = Clock()
    store = KVStore(1 << 30, ttl_s=1, clock=clock, journal=Journal(tmp_path), tiers=TierStore(0, 1 << 30, tmp_path))
    for name in ("\x00", "x" * 300, "../../etc/passwd"):
        store.release(store.acquire(SessionKey("default", name, kind="bucket"), "m"))
    clock.now += 5
    store.expire()  # never raises (it runs on the engine's idle tick)
    assert store.stats().num_entries == 0 and list(tmp_path.iterdir()) == []
    store.tiers.close()

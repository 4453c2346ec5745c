"""One block store, two backends: the same addresses, bytes, checks, writer and leading-run reads over a disk
directory and a real redis-server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from server.kv.block_store import KNOWN_LIMIT, BlockStore, WriteJob, addresses
from server.kv.pool import KVLayout
from server.kv.snapshot import Snapshot, decode_block, encode_block
from server.kv.tiers import TierStore
from server.sessions.record import SessionKey
from tests.e2e.server import _kill_leftovers  # noqa: F401 - the fixture is autouse

LAYOUT = KVLayout(2, 1, 4, torch.float32)
FP = LAYOUT.fingerprint()
BS = 4


def kv(num_tokens: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randn(1, num_tokens, 4, generator=gen).to(dtype) for _ in range(2)]  # [kv_heads, tokens, head_dim]
    v = [torch.randn(1, num_tokens, 4, generator=gen).to(dtype) for _ in range(2)]
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_round_trips_bit_exact(dtype):
    k, v = kv(3, dtype=dtype)
    back = decode_block("a" * 40, encode_block("a" * 40, k, v), KVLayout(2, 1, 4, dtype))
    assert back.shape == (2, 2, 1, 3, 4)  # [K and V, layers, kv_heads, tokens, head_dim]
    assert all(torch.equal(back[0][i], k[i]) and torch.equal(back[1][i], v[i]) for i in range(2))


@pytest.mark.parametrize("damage", ["flip", "truncate", "version", "address", "layout", "not_ours"])
def test_a_damaged_or_foreign_block_is_refused(damage, caplog):
    value = bytearray(encode_block("a" * 40, *kv(4)))
    address, layout = "a" * 40, LAYOUT
    if damage == "flip":
        value[-3] ^= 0xFF  # inside the tensor: only the checksum can tell
    elif damage == "truncate":
        value = value[: len(value) // 2]
    elif damage == "version":
        changed = bytes(value).replace(b'\\"version\\": \\"1\\"', b'\\"version\\": \\"9\\"')
        assert changed != bytes(value)
        value = bytearray(changed)
    elif damage == "address":
        address = "b" * 40  # a value stored under another block's address
    elif damage == "layout":
        layout = KVLayout(2, 2, 2, torch.float32)
    elif damage == "not_ours":
        value = bytearray(b"\x00" * 64)
    assert decode_block(address, bytes(value), layout) is None
    assert "failed its check" in caplog.text


def test_addresses_name_layout_block_size_tenant_and_every_token():
    ids = list(range(10))
    base = addresses(FP, BS, "t", ids)
    assert len(base) == 2  # full blocks only
    assert len(addresses(FP, BS, "t", ids, tail=True)) == 3
    assert addresses(FP, BS, "t", ids[:8]) == base  # a block's address depends on the tokens up to its end only
    assert addresses(FP, BS, "t", [*ids[:5], 99, *ids[6:]])[0] == base[0] != addresses(FP, BS, "t", [99, *ids])[0]
    # Chained: a block's address names every token before it too, not only its own (its K/V depends on them).
    other_start = addresses(FP, BS, "t", [99, *ids[1:]])
    assert other_start[0] != base[0]
    assert other_start[1] != base[1]  # its own tokens are the same: the prefix makes it another block
    assert addresses(FP, BS, "t", [*ids[:4], *ids[:4]])[1] != base[0]  # the same tokens, another position
    for other in (addresses("x", BS, "t", ids), addresses(FP, 2, "t", ids)[1::2], addresses(FP, BS, "u", ids)):
        assert not set(other) & set(base)
    # Process-independent: another interpreter with another hash seed computes the same addresses.
    code = f"from server.kv.block_store import addresses; print(addresses({FP!r}, {BS}, 't', {ids!r}))"
    env = os.environ | {"PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == repr(base)


def test_both_backends_store_new_blocks_once_and_read_the_leading_sound_run(backend, caplog):
    store = BlockStore(backend, "test", known_limit=KNOWN_LIMIT)
    ids = list(range(16))
    names = addresses(FP, BS, "t", ids)
    k, v = kv(16)
    done = []
    store.put(WriteJob(names[:2], [t[:, :8] for t in k], [t[:, :8] for t in v], BS, done.append))
    store.put(WriteJob(names, k, v, BS, done.append))  # the first two again: skipped, not rewritten
    store.flush()
    assert done == [True, True]
    assert (store.stats.num_written, store.stats.num_skipped) == (4, 2)
    blocks = store.read_run(names, LAYOUT)
    assert len(blocks) == 4
    assert all(
        torch.equal(b[0][layer], k[layer][:, i * BS : (i + 1) * BS]) for i, b in enumerate(blocks) for layer in (0, 1)
    )
    # A damaged block ends the run there, is deleted, and the next writer stores it again.
    value = bytearray(backend.read([names[2]])[0])
    value[-1] ^= 0xFF
    backend.delete([names[2]])
    backend.write([(names[2], bytes(value))])
    assert len(store.read_run(names, LAYOUT)) == 2
    assert store.stats.num_refused == 1
    assert backend.held(names) == [True, True, False, True]
    assert store.unknown(names) == [2]  # forgotten: the engine copies it again
    store.put(WriteJob(names, k, v, BS))
    store.flush()
    assert len(store.read_run(names, LAYOUT)) == 4
    backend.delete([names[0]])  # evicted (Redis' maxmemory, say), behind this process's back
    assert store.read_run(names, LAYOUT) == []  # a missing first block: nothing, not the later ones
    assert store.unknown(names) == [0]  # and the engine copies it again at the next turn
    store.close()


def test_a_block_the_backend_did_not_take_is_not_remembered_as_held(backend, monkeypatch):
    """A failed write leaves its blocks unknown: the engine hands them over again at the next turn."""
    store = BlockStore(backend, "test", known_limit=KNOWN_LIMIT)
    names = addresses(FP, BS, "t", list(range(8)))
    k, v = kv(8)

    def refuse(items):
        raise backend.errors[0]("the medium failed")

    monkeypatch.setattr(backend, "write", refuse)
    done = []
    store.put(WriteJob(names, k, v, BS, done.append))
    store.flush()
    assert done == [False]
    assert store.stats.num_failed == 2
    assert store.unknown(names) == [0, 1]  # still to be sent
    monkeypatch.undo()
    store.put(WriteJob(names, k, v, BS, done.append))  # the next turn sends them again, and they are stored
    store.flush()
    assert done == [False, True]
    assert backend.held(names) == [True, True]
    assert store.unknown(names) == []
    store.close()


def test_a_read_takes_the_disk_run_and_goes_on_from_redis_where_the_disk_stops(tmp_path):
    from server.kv.redis_blocks import RedisBlocks
    from tests.e2e.redis_server import Redis

    server = Redis(tmp_path)
    tiers = TierStore(0, 1 << 30, tmp_path / "kv", block_size=BS)
    tiers.shared = BlockStore(RedisBlocks(server.url), "shared", known_limit=KNOWN_LIMIT)
    key, ids = SessionKey("t", "a"), list(range(16))
    k, v = kv(16)
    tiers.put(Snapshot(key, "m", LAYOUT, "", ids[:10], [t[:, :10] for t in k], [t[:, :10] for t in v]))  # turn 1, here
    tiers.flush_pending()
    names = addresses(FP, BS, "t", ids)
    tiers.shared.put(WriteJob(names, k, v, BS))  # all 4 blocks, as another replica computed them later
    tiers.shared.flush()
    disk = tiers.disk.store.backend
    assert disk.read(names[:2]) == tiers.shared.backend.read(names[:2])  # the same bytes under the same address
    got = tiers.read(key, [*ids, 99], "m", "", LAYOUT)
    assert (got.token_ids, got.origin) == (ids, "shared")  # 2 blocks from disk, then 2 from Redis
    assert all(torch.equal(x, y) for x, y in zip(got.k + got.v, k + v, strict=True))
    assert tiers.disk.store.stats.num_read == 3  # the disk's blocks and its tail (dropped for Redis' fuller block)
    assert tiers.shared.stats.num_read == 2
    server.stop()  # Redis gone: what the disk holds still restores, its tail included
    got = tiers.read(key, [*ids, 99], "m", "", LAYOUT)
    assert (got.token_ids, got.origin) == (ids[:10], "disk")
    tiers.shared.close()
    tiers.close()

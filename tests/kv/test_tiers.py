"""The host and disk tiers: budgets, LRU, moving down and up; the disk as the block store's backend (manifests
over content-addressed block files, shared by sessions with a common prefix)."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import replace

import pytest
import torch

from server.kv.block_store import addresses
from server.kv.disk_blocks import DiskBlocks
from server.kv.pool import KVLayout, quantize
from server.kv.snapshot import Snapshot
from server.kv.tiers import TierStore
from server.sessions.record import SessionKey
from tests.helpers import DEADLINE_S

LAYOUT = KVLayout(2, 1, 4, torch.float32)
FP = LAYOUT.fingerprint()
BS = 4


def make(name: str, num_tokens: int = 8, tenant: str = "t", seed: int = 0, first: int = 0) -> Snapshot:
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randn(1, num_tokens, 4, generator=gen) for _ in range(2)]  # [kv_heads, tokens, head_dim]
    v = [torch.randn(1, num_tokens, 4, generator=gen) for _ in range(2)]
    return Snapshot(SessionKey(tenant, name), "m", LAYOUT, "", list(range(first, first + num_tokens)), k, v)


def tiers_at(directory, host: int = 0, disk: int = 1 << 30) -> TierStore:
    return TierStore(host, disk, directory, block_size=BS)


def read(tiers: TierStore, name: str, prompt: list[int], tenant: str = "t") -> Snapshot | None:
    return tiers.read(SessionKey(tenant, name), prompt, "m", "", LAYOUT)


def block_files(directory) -> list:
    return sorted((directory / "blocks").rglob("*.safetensors"))


def same(a: Snapshot, b: Snapshot, num_tokens: int) -> bool:
    return all(torch.equal(x, y[:, :num_tokens]) for x, y in zip(a.k + a.v, b.k + b.v, strict=True))


def test_host_overflow_moves_the_least_recent_to_disk_and_use_brings_it_back(tmp_path):
    one = make("a").nbytes
    tiers = tiers_at(tmp_path, host=2 * one)
    for name in ("a", "b", "c"):
        tiers.put(make(name, seed=ord(name)))
    tiers.flush_pending()
    usage = {n: tiers.usage(SessionKey("t", n)) for n in "abc"}
    assert (usage["a"].host_bytes, usage["a"].disk_tokens) == (0, 8)  # the oldest went down
    assert usage["b"].host_bytes == usage["c"].host_bytes == one
    assert tiers.fetch(SessionKey("t", "a"), "m", "", LAYOUT) is None  # not in host RAM any more
    back = read(tiers, "a", [*range(8), 99])
    assert back is not None
    assert (back.origin, back.token_ids) == ("disk", list(range(8)))
    assert same(back, make("a", seed=ord("a")), 8)  # bit-exact through the block files
    tiers.flush_pending()
    assert tiers.usage(SessionKey("t", "a")).host_bytes == one  # used: back up in host RAM
    assert tiers.usage(SessionKey("t", "b")).host_bytes == 0  # and b, now the oldest, went down
    tiers.close()


def test_host_ram_gives_a_snapshot_back_only_for_the_model_and_the_k_v_computation_it_came_from():
    """One host tier serves every model: a snapshot of another model, other weights, or K/V computed in another
    dtype or shape would be restored as garbage. How it is stored does not matter (8 bits are converted back)."""
    tiers = TierStore(1 << 30, 0, None, block_size=BS)
    key, quantized = SessionKey("t", "a"), SessionKey("t", "q")
    plain = make("a")
    plain.digests = "weights"
    k, v = [quantize(t, torch.int8) for t in plain.k], [quantize(t, torch.int8) for t in plain.v]
    in_8_bits = Snapshot(quantized, "m", LAYOUT.stored_as("int8"), "weights", plain.token_ids, k, v)
    tiers.put(plain)
    tiers.put(in_8_bits)
    assert tiers.fetch(key, "m", "weights", LAYOUT) is plain
    assert tiers.fetch(key, "m", "weights", LAYOUT.stored_as("int8")) is plain  # an int8 pool computing in float32
    assert tiers.fetch(quantized, "m", "weights", LAYOUT) is in_8_bits
    assert tiers.fetch(key, "another model", "weights", LAYOUT) is None
    assert tiers.fetch(key, "m", "other weights", LAYOUT) is None
    assert tiers.fetch(key, "m", "weights", replace(LAYOUT, dtype=torch.float64)) is None
    assert tiers.fetch(quantized, "m", "weights", replace(LAYOUT, dtype=torch.float64, kv_dtype=torch.int8)) is None
    assert tiers.fetch(key, "m", "weights", replace(LAYOUT, head_dim=8)) is None
    tiers.close()


def test_sessions_sharing_a_prefix_share_its_blocks_on_disk(tmp_path):
    tiers = tiers_at(tmp_path)
    parent, fork = make("parent", 10), make("fork", 10)
    fork.k = [torch.cat([p[:, :8], f[:, 8:]], 1) for p, f in zip(parent.k, fork.k, strict=True)]  # as a fork's pool
    fork.v = [torch.cat([p[:, :8], f[:, 8:]], 1) for p, f in zip(parent.v, fork.v, strict=True)]
    fork.token_ids = [*range(8), 50, 51]
    tiers.put(parent)
    tiers.put(fork)
    tiers.flush_pending()
    files = block_files(tmp_path)
    assert len(files) == 4  # two full blocks once, and each session's own tail
    assert tiers.totals().disk_bytes == sum(p.stat().st_size for p in files)  # what is really held, once
    usage = tiers.usage(SessionKey("t", "fork"))
    assert usage.disk_tokens == 10
    full = {DiskBlocks(tmp_path / "blocks").path_for(n) for n in addresses(FP, BS, "t", list(range(8)))}
    assert usage.disk_shared_bytes == sum(p.stat().st_size for p in full) > 0  # the two full blocks
    assert usage.disk_bytes == sum(p.stat().st_size for p in set(files) - full) // 2 > 0  # its own tail
    tiers.drop(SessionKey("t", "parent"))
    assert len(block_files(tmp_path)) == 3  # the parent's tail went; the shared blocks are the fork's too
    assert tiers.usage(SessionKey("t", "fork")).disk_shared_bytes == 0
    back = read(tiers, "fork", [*range(8), 50, 51, 7])
    assert back.token_ids == [*range(8), 50, 51]
    assert same(back, fork, 10)
    tiers.drop(SessionKey("t", "fork"))
    assert block_files(tmp_path) == []
    assert list(tmp_path.rglob("*.kv.json")) == []
    tiers.close()


def test_a_prompt_reads_the_leading_blocks_it_shares_and_the_tail_only_where_it_matches(tmp_path):
    tiers = tiers_at(tmp_path)
    tiers.put(make("a", 10))  # blocks [0..3] [4..7] and the tail [8, 9]
    tiers.flush_pending()
    assert read(tiers, "a", [*range(10), 5]).token_ids == list(range(10))
    assert read(tiers, "a", [*range(9), 77, 5]).token_ids == list(range(8))  # the tail's tokens differ
    assert read(tiers, "a", [0, 1, 2, 3, 9, 9, 9, 9, 9]).token_ids == [0, 1, 2, 3]
    assert read(tiers, "a", [9, 1, 2, 3, 4]) is None
    assert read(tiers, "a", list(range(10)), tenant="other") is None  # another tenant's prompt finds nothing
    assert tiers.read(SessionKey("t", "a"), list(range(10)), "m", "another model", LAYOUT) is None
    tiers.close()


def test_disk_budget_drops_least_recent_sessions_and_drop_removes_everywhere(tmp_path):
    probe = tiers_at(tmp_path / "probe")
    probe.put(make("probe"))
    probe.flush_pending()
    one = probe.totals().disk_bytes
    probe.close()
    tiers = tiers_at(tmp_path / "kv", disk=2 * one)
    for name in ("a", "b", "c"):
        tiers.put(make(name, first=100 * ord(name)))  # no block in common
        tiers.flush_pending()
    assert tiers.peek_tokens(SessionKey("t", "a")) == 0
    assert tiers.peek_tokens(SessionKey("t", "c")) == 8
    assert tiers.totals().disk_bytes == 2 * one
    assert tiers.totals().num_demoted["dropped"] == 1
    tiers.drop(SessionKey("t", "c"))
    assert [p.name for p in (tmp_path / "kv").rglob("*.kv.json")] == ["session-b.kv.json"]
    assert len(block_files(tmp_path / "kv")) == 2
    tiers.close()


def test_a_restart_finds_manifests_skips_broken_ones_and_drops_unknown_sessions(tmp_path, caplog):
    tiers = tiers_at(tmp_path)
    for name, num_tokens, first in (("a", 12, 0), ("b", 5, 50), ("gone", 6, 80)):
        tiers.put(make(name, num_tokens, first=first))
    tiers.flush()
    tiers.close()
    (path_b := tiers.path_for(SessionKey("t", "b"))).write_text(path_b.read_text()[:40])
    again = tiers_at(tmp_path)
    with caplog.at_level(logging.WARNING):
        known = {SessionKey("t", n) for n in ("a", "b")}
        assert again.scan(known) == 1  # b's manifest is unreadable: skipped with a warning; "gone" has no record
    assert "skipping K/V manifest" in caplog.text
    assert again.peek_tokens(SessionKey("t", "a")) == 12
    assert read(again, "a", [*range(12), 1]).token_ids == list(range(12))
    assert len(block_files(tmp_path)) == 3  # only a's blocks: b's and gone's were named by no manifest
    again.close()


def test_a_block_lost_or_damaged_ends_what_is_restored_there(tmp_path, caplog):
    tiers = tiers_at(tmp_path)
    tiers.put(make("a", 12))
    tiers.flush()
    blocks = DiskBlocks(tmp_path / "blocks")
    names = addresses(FP, BS, "t", list(range(12)))
    damaged = blocks.path_for(names[1])
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF  # inside the tensor: only the checksum can tell
    damaged.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert read(tiers, "a", [*range(12), 1]).token_ids == list(range(4))  # the block before it only
    assert "checksum mismatch" in caplog.text
    assert not damaged.exists()  # deleted: nobody is served it again
    assert tiers.totals().disk_bytes == sum(p.stat().st_size for p in block_files(tmp_path))
    tiers.close()
    blocks.path_for(names[0]).unlink()  # lost while the server was down
    again = tiers_at(tmp_path)
    assert again.scan() == 1
    assert again.peek_tokens(SessionKey("t", "a")) == 0  # its leading run is empty now
    assert read(again, "a", [*range(12), 1]) is None
    again.close()


def test_paths_stay_inside_the_directory(tmp_path):
    tiers = tiers_at(tmp_path)
    path = tiers.path_for(SessionKey("../../etc", "x"))
    assert path.resolve().is_relative_to(tmp_path.resolve())
    for name in ("../x", "a/b", "\x00", "x" * 129):
        with pytest.raises(ValueError, match="no file for"):
            tiers.path_for(SessionKey("t", name))
    with pytest.raises(ValueError, match="not a block address"):
        DiskBlocks(tmp_path).path_for("../../etc/passwd")
    tiers.close()


def test_another_models_request_leaves_the_blocks_alone(tmp_path):
    tiers = tiers_at(tmp_path)
    tiers.put(make("a"))
    tiers.flush()
    assert tiers.read(SessionKey("t", "a"), [*range(8), 1], "m", "another model", LAYOUT) is None
    assert tiers.path_for(SessionKey("t", "a")).exists()  # not ours to delete
    assert len(block_files(tmp_path)) == 2
    assert read(tiers, "a", [*range(8), 1]) is not None
    tiers.close()


def test_a_copy_that_races_with_a_delete_is_not_kept(tmp_path):
    tiers = tiers_at(tmp_path, host=1 << 30)
    key = SessionKey("t", "a")
    tiers.drop(key)  # deleted while the engine was copying its K/V
    tiers.put(make("a"))
    assert tiers.peek_tokens(key) == 0
    tiers.revive(key)  # a new session under the same name
    tiers.put(make("a"))
    assert tiers.peek_tokens(key) == 8
    tiers.close()


def test_a_delete_while_the_blocks_are_written_leaves_no_file(tmp_path, monkeypatch):
    tiers = tiers_at(tmp_path)
    real_write = DiskBlocks.write

    def write_then_delete(self, items):
        tiers.drop(SessionKey("t", "a"))  # the session goes while its first blocks are on their way
        return real_write(self, items)

    monkeypatch.setattr(DiskBlocks, "write", write_then_delete)
    tiers.put(make("a", 8))
    tiers.flush_pending()
    assert tiers.peek_tokens(SessionKey("t", "a")) == 0
    assert block_files(tmp_path) == []
    assert list(tmp_path.rglob("*.kv.json")) == []
    tiers.close()


def test_a_write_the_disk_refuses_is_dropped_and_counted(tmp_path, monkeypatch):
    real_write = DiskBlocks.write
    calls = []

    def full_after_one(self, items):
        calls.append(items)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real_write(self, items[:1])

    monkeypatch.setattr("server.kv.block_store.CHUNK", 1)
    monkeypatch.setattr(DiskBlocks, "write", full_after_one)
    tiers = tiers_at(tmp_path)
    tiers.put(make("a", 12))
    tiers.flush_pending()
    assert tiers.usage(SessionKey("t", "a")) == tiers.usage(SessionKey("t", "never"))  # nothing held, not in RAM
    assert tiers.totals().num_failed_writes == 1
    assert block_files(tmp_path) == []  # the block written before the disk filled is named by nobody: gone
    tiers.close()


def test_start_up_removes_every_temporary_file_a_crash_left(tmp_path):
    tiers = tiers_at(tmp_path)
    tiers.put(make("a"))
    tiers.flush()
    tiers.close()
    tenant_dir = tiers.path_for(SessionKey("t", "a")).parent
    for name in (".tmpS1fPTd", "session-b.kv.json.partial", "session-c.kv.json~"):
        (tenant_dir / name).write_bytes(b"\0" * 1024)  # a temporary name, ours, an editor's
    block_dir = block_files(tmp_path)[0].parent
    (block_dir / "ab12.safetensors.partial").write_bytes(b"\0" * 64)
    again = tiers_at(tmp_path)
    assert again.scan() == 1
    assert sorted(p.name for p in tenant_dir.iterdir()) == ["session-a.kv.json"]
    assert again.totals().num_swept == 4
    assert json.loads(again.path_for(SessionKey("t", "a")).read_text())["token_ids"] == list(range(8))
    again.close()


def test_a_write_that_fails_for_any_reason_gives_back_what_it_held(tmp_path, monkeypatch):
    def broken(address, k, v):
        raise RuntimeError("not the disk: a bug while encoding")

    monkeypatch.setattr("server.kv.block_store.encode_block", broken)
    tiers = tiers_at(tmp_path)
    tiers.put(make("a", 12))
    tiers.flush_pending()
    assert tiers.pending_bytes() == 0  # not held in RAM for ever
    assert tiers.totals().num_failed_writes == 1
    assert tiers.disk.holds(make("a", 12)) is False  # so it may be written again
    monkeypatch.undo()
    tiers.put(make("a", 12))
    tiers.flush_pending()
    assert tiers.peek_tokens(SessionKey("t", "a")) == 12
    tiers.close()


def test_a_block_is_found_only_after_the_same_tokens(tmp_path):
    """Addresses are chained: equal tokens after another prefix are another block (their K/V differs)."""
    tiers = tiers_at(tmp_path)
    tiers.put(make("a", 8))  # [0..3] [4..7]
    tiers.put(make("b", 8, first=10))  # [10..13] [14..17]
    tiers.flush_pending()
    got = read(tiers, "c", [10, 11, 12, 13, 4, 5, 6, 7, 1])  # b's first block, then a's second block's tokens
    assert got.token_ids == [10, 11, 12, 13]  # b's block only: a's [4..7] was computed after [0..3]
    assert same(got, make("b", 8, first=10), 4)
    tiers.close()


def test_a_replaced_manifest_gives_back_the_blocks_only_it_named(tmp_path):
    tiers = tiers_at(tmp_path)
    key = SessionKey("t", "a")
    tiers.put(make("a", 10))  # [0..3] [4..7] and the tail [8, 9]
    tiers.flush_pending()
    assert len(block_files(tmp_path)) == 3
    tiers.put(make("a", 14))  # the next turn: [0..3] [4..7] [8..11] and the tail [12, 13]
    tiers.flush_pending()
    files = block_files(tmp_path)
    assert len(files) == 4  # not 5: the old manifest's tail [8, 9], named by nobody now, is gone
    names = addresses(FP, BS, "t", list(range(14)), tail=True)
    assert files == sorted(DiskBlocks(tmp_path / "blocks").path_for(n) for n in names)  # the old tail went
    assert tiers.totals().disk_bytes == sum(p.stat().st_size for p in files)
    assert tiers.usage(key).disk_shared_bytes == 0  # no other manifest names its blocks
    tiers.drop(key)
    assert block_files(tmp_path) == []
    assert tiers.totals().disk_bytes == 0
    tiers.close()


def test_the_partial_last_block_is_read_when_the_prompt_ends_with_it(tmp_path):
    tiers = tiers_at(tmp_path)
    tiers.put(make("a", 10))  # [0..3] [4..7] and the tail [8, 9]
    tiers.flush_pending()
    got = read(tiers, "a", list(range(10)))  # usable ids that end exactly where the manifest does
    assert got.token_ids == list(range(10))
    assert same(got, make("a", 10), 10)
    assert read(tiers, "a", list(range(9))).token_ids == list(range(8))  # ending inside the tail: not usable
    tiers.close()


def test_host_bytes_are_a_models_snapshots_held_in_host_ram_those_on_their_way_to_disk_too(tmp_path, monkeypatch):
    real_write = DiskBlocks.write
    writing, go_on = threading.Event(), threading.Event()

    def held_write(self, items):
        writing.set()
        assert go_on.wait(DEADLINE_S), "the test never let the write go on"
        return real_write(self, items)

    monkeypatch.setattr(DiskBlocks, "write", held_write)
    one = make("a").nbytes
    tiers = tiers_at(tmp_path, host=2 * one)
    tiers.put(make("a"))
    tiers.put(make("b"))
    other = replace(make("c"), model_id="other")
    tiers.put(other)  # over the budget: a, the oldest, goes on to disk
    assert writing.wait(DEADLINE_S), "a was never written"
    assert tiers.host_bytes("m") == 2 * one  # b, and a while it is written: still held
    assert tiers.host_bytes("other") == other.nbytes
    go_on.set()
    tiers.flush_pending()
    assert tiers.host_bytes("m") == one  # written: only b is held
    tiers.drop(SessionKey("t", "b"))
    assert tiers.host_bytes("m") == 0
    assert tiers.host_bytes("no-such-model") == 0
    tiers.close()

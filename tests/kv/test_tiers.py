"""Snapshots (safetensors, checksummed header) and the host/disk tiers: budgets, LRU, moving down and up."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import save_file

from server.kv import snapshot as snap_io
from server.kv.pool import KVLayout
from server.kv.snapshot import Snapshot, SnapshotError
from server.kv.tiers import TierStore
from server.sessions.record import SessionKey

FP = KVLayout(2, 1, 4, torch.float32).fingerprint()


def make(name: str, num_tokens: int = 8, tenant: str = "t", seed: int = 0) -> Snapshot:
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randn(1, num_tokens, 4, generator=gen) for _ in range(2)]  # [kv_heads, tokens, head_dim]
    v = [torch.randn(1, num_tokens, 4, generator=gen) for _ in range(2)]
    return Snapshot(SessionKey(tenant, name), "m", FP, list(range(num_tokens)), k, v)


def test_snapshot_round_trip_is_bit_exact(tmp_path):
    snap = make("a", 10)
    path = tmp_path / "a.safetensors"
    snap_io.save(snap, path)
    back = snap_io.load(path, "m", FP)
    assert back.token_ids == snap.token_ids
    assert back.key == snap.key
    assert back.origin == "disk"
    assert all(torch.equal(x, y) for x, y in zip(back.k + back.v, snap.k + snap.v, strict=True))
    assert snap_io.read_header(path)[3] == 10


@pytest.mark.parametrize("damage", ["flip", "truncate", "model", "version", "not_ours"])
def test_a_damaged_or_foreign_snapshot_is_refused(tmp_path, damage):
    path = tmp_path / "a.safetensors"
    snap_io.save(make("a", 10), path)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0xFF  # inside the last tensor: only the checksum can tell
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "version":
        path.write_bytes(bytes(data).replace(b'"version":"1"', b'"version":"9"'))
    elif damage == "not_ours":
        save_file({"x": torch.zeros(2)}, str(path))
    with pytest.raises(SnapshotError):
        snap_io.load(path, "other-model" if damage == "model" else "m", FP)


def test_host_overflow_moves_the_least_recent_to_disk_and_use_brings_it_back(tmp_path):
    one = make("a").nbytes
    tiers = TierStore(host_budget_bytes=2 * one, disk_budget_bytes=10 * one, directory=tmp_path)
    for name in ("a", "b", "c"):
        tiers.put(make(name))
    tiers.flush_pending()
    usage = {n: tiers.usage(SessionKey("t", n)) for n in "abc"}
    assert usage["a"].host_bytes == 0
    assert usage["a"].disk_bytes > 0  # the oldest went down
    assert usage["b"].host_bytes == one
    assert usage["c"].host_bytes == one
    back = tiers.fetch(SessionKey("t", "a"), "m", FP)
    assert back is not None
    assert back.origin == "disk"
    assert back.token_ids == list(range(8))
    tiers.flush_pending()
    assert tiers.usage(SessionKey("t", "a")).host_bytes == one  # used: back up in host RAM
    assert tiers.usage(SessionKey("t", "b")).host_bytes == 0  # and b, now the oldest, went down
    tiers.close()


def test_disk_budget_drops_oldest_files_and_drop_removes_everywhere(tmp_path):
    one_file = snap_io.save(make("probe"), tmp_path / "probe.safetensors")
    (tmp_path / "probe.safetensors").unlink()
    tiers = TierStore(host_budget_bytes=0, disk_budget_bytes=2 * one_file, directory=tmp_path / "kv")
    for name in ("a", "b", "c"):
        tiers.put(make(name))
        tiers.flush_pending()
    assert tiers.peek_tokens(SessionKey("t", "a")) == 0
    assert tiers.peek_tokens(SessionKey("t", "c")) == 8
    assert len(list((tmp_path / "kv").rglob("*.safetensors"))) == 2
    tiers.drop(SessionKey("t", "c"))
    assert [p.name for p in (tmp_path / "kv").rglob("*.safetensors")] == ["session-b.safetensors"]
    tiers.close()


def test_a_restart_finds_snapshots_by_header_and_skips_broken_ones(tmp_path, caplog):
    tiers = TierStore(0, 1 << 30, tmp_path)
    tiers.put(make("a", 12))
    tiers.put(make("b", 5))
    tiers.flush()
    tiers.close()
    (path_b := tiers.path_for(SessionKey("t", "b"))).write_bytes(path_b.read_bytes()[:100])
    again = TierStore(0, 1 << 30, tmp_path)
    with caplog.at_level(logging.WARNING):
        assert again.scan() == 1  # b's header is gone: skipped with a warning, not a crash
    assert "skipping K/V snapshot" in caplog.text
    assert again.peek_tokens(SessionKey("t", "a")) == 12
    assert again.fetch(SessionKey("t", "a"), "m", FP).token_ids == list(range(12))
    again.close()


def test_a_corrupt_file_found_at_use_is_deleted_and_reported_missing(tmp_path, caplog):
    tiers = TierStore(0, 1 << 30, tmp_path)
    tiers.put(make("a"))
    tiers.flush()
    path = tiers.path_for(SessionKey("t", "a"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert tiers.fetch(SessionKey("t", "a"), "m", FP) is None
    assert "checksum mismatch" in caplog.text
    assert not path.exists()
    assert tiers.fetch(SessionKey("t", "a"), "other", FP) is None  # gone: asking again is simply a miss
    tiers.close()


def test_paths_stay_inside_the_directory(tmp_path):
    tiers = TierStore(0, 1 << 30, tmp_path)
    path = tiers.path_for(SessionKey("../../etc", "x"))
    assert path.resolve().is_relative_to(tmp_path.resolve())
    tiers.close()


def test_another_models_request_leaves_the_snapshot_alone(tmp_path):
    tiers = TierStore(0, 1 << 30, tmp_path)
    tiers.put(make("a"))
    tiers.flush()
    assert tiers.fetch(SessionKey("t", "a"), "other-model", FP) is None
    assert tiers.path_for(SessionKey("t", "a")).exists()  # not ours to delete
    assert tiers.fetch(SessionKey("t", "a"), "m", FP) is not None
    tiers.close()


def test_a_copy_that_races_with_a_delete_is_not_kept(tmp_path):
    tiers = TierStore(1 << 30, 1 << 30, tmp_path)
    key = SessionKey("t", "a")
    tiers.drop(key)  # deleted while the engine was copying its K/V
    tiers.put(make("a"))
    assert tiers.peek_tokens(key) == 0
    tiers.revive(key)  # a new session under the same name
    tiers.put(make("a"))
    assert tiers.peek_tokens(key) == 8
    tiers.close()


def test_no_file_name_for_ids_outside_the_pattern(tmp_path):
    tiers = TierStore(0, 1 << 30, tmp_path)
    for name in ("../x", "a/b", "\x00", "x" * 129):
        with pytest.raises(ValueError, match="no file for"):
            tiers.path_for(SessionKey("t", name))
    tiers.close()


def test_a_write_the_disk_refuses_is_dropped_and_counted(tmp_path, monkeypatch):
    def full_disk(snapshot, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snap_io, "save", full_disk)
    tiers = TierStore(0, 1 << 30, tmp_path)
    tiers.put(make("a"))
    tiers.flush_pending()
    assert tiers.usage(SessionKey("t", "a")).host_bytes == 0  # not held in RAM for ever
    assert tiers.totals().num_failed_writes == 1
    tiers.close()


def test_start_up_removes_every_temporary_file_a_crash_left(tmp_path):
    tiers = TierStore(0, 1 << 30, tmp_path)
    tiers.put(make("a"))
    tiers.flush()
    tiers.close()
    tenant_dir = tiers.path_for(SessionKey("t", "a")).parent
    for name in (".tmpS1fPTd", "session-b.safetensors.partial", "session-c.safetensors~"):
        (tenant_dir / name).write_bytes(b"\0" * 1024)  # safetensors' own temporary name, ours, an editor's
    again = TierStore(0, 1 << 30, tmp_path)
    assert again.scan() == 1
    assert sorted(p.name for p in tenant_dir.iterdir()) == ["session-a.safetensors"]
    assert again.totals().num_swept == 3
    again.close()

"""The session store and its journal, without a model or a tensor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from server.kv.tiers import TierStore
from server.sessions.errors import SessionBusy, SessionModelMismatch, SessionModeMismatch, StateUnavailable
from server.sessions.index import Reach
from server.sessions.journal import Journal
from server.sessions.record import CompletedTurn, SessionKey, Usage
from server.sessions.store import SessionStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store() -> SessionStore:
    return SessionStore(ttl_s=3600)


def key(name: str, tenant: str = "default") -> SessionKey:
    return SessionKey(tenant, name)


def turn(ids: list[int], text: str = "") -> CompletedTurn:
    return CompletedTurn(ids, text, "stop", Usage(len(ids), 0, 0), None)


def complete(store: SessionStore, name: str, ids: list[int]) -> None:
    store.release(store.acquire(key(name), "m"), turn(ids))


def test_the_store_loads_without_torch():
    code = "import sys, server.sessions.store, server.sessions.journal; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_busy_session_and_model_mismatch(store):
    store.acquire(key("x"), "m")
    with pytest.raises(SessionBusy):
        store.acquire(key("x"), "m")
    complete(store, "y", [1, 2])
    with pytest.raises(SessionModelMismatch):
        store.acquire(key("y"), "other")


def test_bucket_never_locks(store):
    bucket = SessionKey("default", "shared", kind="bucket")
    assert store.acquire(bucket, "m") is not None
    assert store.acquire(bucket, "m") is None  # busy bucket: the request just runs without it


def test_a_completed_turn_is_applied_and_journaled(tmp_path):
    store = SessionStore(ttl_s=3600, journal=Journal(tmp_path))
    complete(store, "j", [1, 2, 3])
    info = store.info(key("j"))
    assert info.num_turns == 1
    assert info.num_transcript_tokens == 3
    assert not info.is_in_use  # as before the turn
    (record,) = Journal(tmp_path).load_all()
    assert record["transcript_ids"] == [1, 2, 3]
    assert record["turns"] == [[0, 0], [3, 0]]


def test_ttl_forgets_idle_sessions_and_their_files(tmp_path):
    clock = Clock()
    tiers = TierStore(0, 1 << 30, tmp_path / "kv")
    store = SessionStore(ttl_s=10, journal=Journal(tmp_path / "sessions"), forgetters=(tiers,), clock=clock)
    complete(store, "old", [1, 2, 3])
    assert len(list(tmp_path.rglob("*.json"))) == 1
    clock.now = 11
    assert store.info(key("old")) is None
    assert list(tmp_path.rglob("*.json")) == []
    assert store.take_forgotten("m") == [(key("old"), [1, 2, 3])]  # its device K/V may go too
    tiers.close()


def test_a_session_in_use_is_never_expired_by_its_ttl():
    clock = Clock()
    store = SessionStore(ttl_s=10, clock=clock)
    session = store.acquire(key("busy"), "m")
    clock.now = 1000  # far past its TTL, but a request is running on it
    store.expire()
    assert store.info(key("busy")) is not None
    store.release(session, turn([1, 2]))  # the turn completes: it is used again now
    clock.now = 1005
    assert store.info(key("busy")).num_turns == 1
    clock.now = 1011
    assert store.info(key("busy")) is None


def test_tenants_are_separate_namespaces(store):
    complete(store, "same", [1, 2, 3])
    assert store.info(key("same", "other-tenant")) is None
    assert store.acquire(key("same", "other-tenant"), "m").transcript_ids == []  # a new one of its own


def test_idle_transcripts_least_recently_used_first():
    clock = Clock()
    store = SessionStore(ttl_s=1e9, clock=clock)
    for i, name in enumerate(("a", "b", "c")):
        clock.now = i
        complete(store, name, [i])
    clock.now = 5
    complete(store, "a", [9])  # used again: now the most recent
    busy = store.acquire(key("b"), "m")  # in use: not a candidate to leave the device
    assert [k.name for k, _ in store.idle_transcripts("m")] == ["c", "a"]
    store.release(busy)


def test_delete_while_running_drops_the_state(store):
    session = store.acquire(key("d"), "m")
    assert store.delete(key("d"))
    store.release(session, turn([1, 2, 3, 4]))
    assert store.info(key("d")) is None
    assert store.session_keys() == set()


def test_a_turn_the_journal_cannot_write_is_not_applied(tmp_path):
    class FullDisk(Journal):
        def save(self, key, record):
            if record["transcript_ids"]:  # the disk fills up after the session was made
                raise OSError(28, "No space left on device")

    store = SessionStore(ttl_s=3600, journal=FullDisk(tmp_path))
    session = store.acquire(key("j"), "m")
    with pytest.raises(StateUnavailable, match="No space left"):
        store.release(session, turn([1, 2, 3]))
    info = store.info(key("j"))
    assert info.num_turns == 0
    assert info.num_transcript_tokens == 0
    assert not info.is_in_use


def test_a_journal_write_that_fails_part_way_leaves_the_previous_record_loadable(tmp_path, monkeypatch):
    journal = Journal(tmp_path)
    store = SessionStore(ttl_s=3600, journal=journal)
    complete(store, "p", [1, 2, 3])
    real_write = Path.write_text

    def torn(self, data, *args, **kwargs):  # half the bytes reach the file, then the disk fills up
        real_write(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", torn)
    with pytest.raises(StateUnavailable, match="No space left"):
        store.release(store.acquire(key("p"), "m"), turn([1, 2, 3, 4, 5]))
    monkeypatch.undo()
    again = SessionStore(ttl_s=3600, journal=Journal(tmp_path))
    assert again.restore() == 1  # the torn write is not the record: the previous turn loads
    assert again.transcript(key("p")) == [1, 2, 3]
    assert again.info(key("p")).num_turns == 1
    assert [p.suffix for p in tmp_path.rglob("*") if p.is_file()] == [".json"]  # the leftover is cleaned up


def test_a_journal_write_after_delete_does_not_bring_the_session_back(tmp_path):
    journal = Journal(tmp_path)
    journal.delete(key("gone"))
    journal.save(key("gone"), {"x": 1})
    assert journal.load_all() == []
    journal.revive(key("gone"))
    journal.save(key("gone"), {"x": 1})
    assert journal.load_all() == [{"x": 1}]


def test_a_broken_record_is_skipped_at_start(tmp_path, caplog):
    store = SessionStore(ttl_s=3600, journal=Journal(tmp_path))
    complete(store, "ok", [1, 2])
    complete(store, "bad", [3])
    bad = next(tmp_path.rglob("session-bad.json"))
    bad.write_text(json.dumps({"version": 1, "session": ["default", "bad", "session"]}))  # fields missing
    again = SessionStore(ttl_s=3600, journal=Journal(tmp_path))
    assert again.restore() == 1
    assert again.info(key("ok")) is not None
    assert "skipping a session record" in caplog.text


def test_expiring_buckets_with_any_name_touch_no_files(tmp_path):
    clock = Clock()
    tiers = TierStore(0, 1 << 30, tmp_path)
    store = SessionStore(ttl_s=1, journal=Journal(tmp_path), forgetters=(tiers,), clock=clock)
    for name in ("\x00", "x" * 300, "../../etc/passwd"):
        store.release(store.acquire(SessionKey("default", name, kind="bucket"), "m"))
    clock.now += 5
    store.expire()  # never raises (it runs on the engine's idle tick)
    assert store.session_keys() == set()
    assert list(tmp_path.iterdir()) == []
    tiers.close()


def test_start_up_removes_temporary_journal_files(tmp_path):
    store = SessionStore(ttl_s=3600, journal=Journal(tmp_path))
    complete(store, "kept", [1, 2])
    tenant_dir = next(tmp_path.rglob("session-kept.json")).parent
    (tenant_dir / "session-kept.json.partial").write_text("{")
    (tenant_dir / ".tmp123").write_text("x")
    again = SessionStore(ttl_s=3600, journal=Journal(tmp_path))
    assert again.restore() == 1
    assert sorted(p.name for p in tenant_dir.iterdir()) == ["session-kept.json"]


def test_a_session_made_on_first_use_is_journaled_before_it_exists(tmp_path):
    class FullDisk(Journal):
        def save(self, key, record):
            raise OSError(28, "No space left on device")

    store = SessionStore(ttl_s=3600, journal=FullDisk(tmp_path))
    with pytest.raises(StateUnavailable):
        store.acquire(key("new"), "m")
    assert store.info(key("new")) is None  # refused, so it does not exist either
    bucket = SessionKey("default", "b", kind="bucket")
    assert store.acquire(bucket, "m") is not None  # a bucket keeps no record: nothing to refuse


def test_a_session_never_switches_between_chat_and_completion(store):
    complete(store, "plain", [1, 2, 3])  # a completion transcript (no messages)
    with pytest.raises(SessionModeMismatch, match="completion"):
        store.acquire(key("plain"), "m", is_chat=True)
    assert not store.info(key("plain")).is_in_use


def test_shared_prefixes_are_found_among_the_neighbours():
    store = SessionStore(ttl_s=3600)
    for name, ids in (("a", [1, 2, 3, 4, 5, 6]), ("b", [1, 2, 3, 9]), ("c", [1, 2, 3, 4, 5, 6, 7, 8]), ("d", [7])):
        complete(store, name, ids)
    assert store.reach(key("a"), "m", [1, 2, 3, 4, 5, 6]) == (6, True, False)  # a prefix of c: all reached
    assert store.reach(key("c"), "m", [1, 2, 3, 4, 5, 6, 7, 8]) == (6, False, True)  # a ends inside it
    assert store.reach(key("b"), "m", [1, 2, 3, 9]) == (3, False, False)
    assert store.reach(key("d"), "m", [7]) == (0, False, False)
    assert store.reach(SessionKey("other", "a"), "m", [1, 2, 3]) == (0, False, False)  # tenants apart


def test_how_many_blocks_another_transcript_reaches():
    assert Reach(6, is_covered=True, other_ends=False).num_blocks(2, 4) == 2  # a prefix of another: all of it
    assert Reach(6, is_covered=False, other_ends=True).num_blocks(3, 4) == 2  # the other ends inside block 2
    assert Reach(6, is_covered=False, other_ends=False).num_blocks(3, 4) == 1  # only whole blocks in common
    assert Reach(8, is_covered=False, other_ends=True).num_blocks(3, 4) == 2

"""The session store and its journal, without a model or a tensor."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from server.kv.tiers import TierStore
from server.sessions.errors import (
    QuotaExceeded,
    SessionBusy,
    SessionModelMismatch,
    SessionModeMismatch,
    StateUnavailable,
)
from server.sessions.index import Reach
from server.sessions.journal import Journal
from server.sessions.record import CompletedTurn, SessionKey, Turn, Usage
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
    store.create(key("j"), "m")  # made before (a request made on first use goes: the test below)
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


def test_a_delete_the_journal_refuses_leaves_later_turns_journaled(tmp_path, monkeypatch):
    store = SessionStore(ttl_s=3600, journal=Journal(tmp_path))
    complete(store, "kept", [1, 2, 3])

    def read_only(self, missing_ok=False):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(StateUnavailable, match="could not be deleted"):
        store.delete(key("kept"))
    monkeypatch.undo()
    assert store.info(key("kept")).num_turns == 1  # refused: nothing forgotten
    complete(store, "kept", [1, 2, 3, 4, 5])  # so its next turn is journaled like any other
    again = SessionStore(ttl_s=3600, journal=Journal(tmp_path))
    assert again.restore() == 1
    assert again.transcript(key("kept")) == [1, 2, 3, 4, 5]


def test_a_sessions_own_transcript_is_left_out_of_its_tenants_usage(store):
    complete(store, "a", [1, 2, 3])
    complete(store, "b", [4, 5])
    assert store.tenant_usage("default", exclude=key("a")) == (1, 2)  # b only: a's tokens are not counted
    assert store.tenant_usage("default", exclude=key("b")) == (1, 3)
    assert store.tenant_usage("default", exclude=key("new")) == (2, 5)  # a new session: every other counts
    assert store.tenant_usage("other", exclude=SessionKey("other", "a")) == (0, 0)


def test_deleted_and_expired_sessions_leave_the_idle_list():
    clock = Clock()
    store = SessionStore(ttl_s=10, clock=clock)
    complete(store, "expires", [1])
    clock.now = 5
    complete(store, "deleted", [2])
    complete(store, "stays", [3])
    assert [k.name for k, _ in store.idle_transcripts("m")] == ["expires", "deleted", "stays"]
    assert store.delete(key("deleted"))
    clock.now = 12  # past the first one's TTL only
    store.expire()
    assert [k.name for k, _ in store.idle_transcripts("m")] == ["stays"]


def test_a_restart_keeps_each_sessions_ttl_running(tmp_path):
    """The TTL counts from the last use, across a restart: the new process's monotonic clock starts elsewhere,
    the record's wall-clock time of last use says how long ago it was."""
    mono, wall = Clock(), Clock()
    wall.now = 1_000_000.0
    store = SessionStore(ttl_s=100, journal=Journal(tmp_path), clock=mono, wall_clock=wall)
    complete(store, "old", [1])
    mono.now, wall.now = 60, wall.now + 60
    complete(store, "new", [2])
    mono, wall.now = Clock(), wall.now + 10  # a restart, 70 s after the first session's last use
    mono.now = 5
    again = SessionStore(ttl_s=100, journal=Journal(tmp_path), clock=mono, wall_clock=wall)
    assert again.restore() == 2
    assert again.info(key("old")) is not None
    mono.now, wall.now = 36, wall.now + 31  # 101 s after its last use, 41 s after the other's
    assert again.info(key("old")) is None
    assert again.info(key("new")) is not None
    assert [p.name for p in tmp_path.rglob("*.json")] == ["session-new.json"]
    mono, wall.now = Clock(), wall.now + 100  # down for longer than the TTL: gone at start
    third = SessionStore(ttl_s=100, journal=Journal(tmp_path), clock=mono, wall_clock=wall)
    third.restore()
    assert third.session_keys() == set()
    assert list(tmp_path.rglob("*.json")) == []


class Forgetting:
    """A K/V tier as the store sees it: what it was told to drop."""

    def __init__(self) -> None:
        self.dropped: list[SessionKey] = []

    def revive(self, key: SessionKey) -> None:
        return None

    def drop(self, key: SessionKey) -> None:
        self.dropped.append(key)


def test_an_expired_sessions_kv_is_dropped_from_the_tiers():
    clock, tiers = Clock(), Forgetting()
    store = SessionStore(ttl_s=10, forgetters=(tiers,), clock=clock)
    complete(store, "old", [1, 2, 3])
    clock.now = 5
    complete(store, "young", [4])
    clock.now = 11
    store.expire()
    assert tiers.dropped == [key("old")]
    clock.now = 16
    store.expire()
    assert tiers.dropped == [key("old"), key("young")]


def test_a_session_past_its_ttl_is_never_continued():
    clock = Clock()
    store = SessionStore(ttl_s=10, clock=clock)
    complete(store, "old", [1, 2, 3])
    clock.now = 11  # nothing asked the store since: the request itself finds it expired
    session = store.acquire(key("old"), "m")
    assert session.transcript_ids == []  # a new session under that name, not the old transcript
    assert session.num_turns == 0
    assert store.take_forgotten("m") == [(key("old"), [1, 2, 3])]  # and the old one's device K/V goes
    store.release(session)


def chat_turn(prompt_ids: list[int], reply_ids: list[int], messages: list[dict], reply: str) -> CompletedTurn:
    usage = Usage(len(prompt_ids), len(reply_ids), 0)
    return CompletedTurn(
        prompt_ids + reply_ids, reply, "length", usage, messages, reply={"role": "assistant", "content": reply}
    )


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def bot(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_a_prefill_only_request_makes_no_turn_and_changes_no_record(tmp_path):
    store = SessionStore(ttl_s=3600, journal=Journal(tmp_path))
    store.release(store.acquire(key("s"), "m", is_chat=True), chat_turn([1, 2], [3], [user("a")], "b"))
    store.release(
        store.acquire(key("s"), "m", is_chat=True), chat_turn([1, 2, 3, 4], [5], [user("a"), bot("b"), user("c")], "d")
    )
    before = store.view(key("s"))
    warm = CompletedTurn(
        [1, 2, 3, 4, 5, 6, 7],
        "",
        "length",
        Usage(7, 0, 0),
        [user("a"), bot("b"), user("c"), bot("d"), user("e")],
        is_prefill_only=True,
    )
    store.release(store.acquire(key("s"), "m", is_chat=True), warm)
    after = store.view(key("s"))
    assert (after.transcript_ids, after.turns, after.messages, after.rev) == (
        before.transcript_ids,
        before.turns,
        before.messages,
        before.rev,
    )
    assert after.num_turns == 2
    again = SessionStore(ttl_s=3600, journal=Journal(tmp_path))
    again.restore()
    assert again.view(key("s")).turns == before.turns  # nothing journaled either


def test_a_turn_keeps_only_the_turns_its_prompt_still_holds(store):
    def run(prompt_ids, reply_ids, messages, reply):
        store.release(store.acquire(key("s"), "m", is_chat=True), chat_turn(prompt_ids, reply_ids, messages, reply))
        return store.view(key("s"))

    run([1, 2], [3], [user("a")], "b")  # turn 1 ends at 3 tokens, 2 messages
    run([1, 2, 3, 4], [5], [user("a"), bot("b"), user("c")], "d")  # turn 2: 5 tokens, 4 messages
    extended = run([1, 2, 3, 4, 5, 6], [7], [user("a"), bot("b"), user("c"), bot("d"), user("e")], "f")
    assert [(t.end, t.num_messages) for t in extended.turns] == [(0, 0), (3, 2), (5, 4), (7, 6)]
    # Turn 3's message edited (its tokens too): turns 1 and 2 still hold, the edited one is turn 3 again.
    edited = run([1, 2, 3, 4, 5, 9], [8], [user("a"), bot("b"), user("c"), bot("d"), user("E")], "g")
    assert [(t.end, t.num_messages) for t in edited.turns] == [(0, 0), (3, 2), (5, 4), (7, 6)]
    assert edited.transcript_ids == [1, 2, 3, 4, 5, 9, 8]
    # Same tokens, another message (a field the template does not render): the turn past it goes.
    relabelled = run([1, 2, 3, 4], [6], [user("a"), {**bot("b"), "name": "x"}, user("c")], "h")
    assert [(t.end, t.num_messages) for t in relabelled.turns] == [(0, 0), (5, 4)]
    # A retried first turn: the turn it redoes is not kept beside it.
    retried = run([1, 2], [3], [user("a")], "b")
    assert [(t.end, t.num_messages) for t in retried.turns] == [(0, 0), (3, 2)]
    # A completion retried (no messages): the turn whose reply its prompt does not hold is not kept beside it.
    for _ in range(2):
        store.release(store.acquire(key("plain"), "m"), CompletedTurn([1, 2, 3], "", "stop", Usage(2, 1, 0), None))
    assert [(t.end, t.num_messages) for t in store.view(key("plain")).turns] == [(0, 0), (3, 0)]
    # A prompt that shares no token with the transcript holds no turn, not even the base.
    store.create(
        key("based"), "m", transcript_ids=[1, 2], messages=[{"role": "system", "content": "S"}], turns=[Turn(2, 1)]
    )
    store.release(store.acquire(key("based"), "m", is_chat=True), chat_turn([7, 8], [9], [user("a")], "b"))
    assert [(t.end, t.num_messages) for t in store.view(key("based")).turns] == [(0, 0), (3, 2)]
    store.release(
        store.acquire(key("based"), "m", is_chat=True),
        chat_turn([7, 8, 9, 1], [2], [user("a"), bot("b"), user("c")], "d"),
    )
    assert [(t.end, t.num_messages) for t in store.view(key("based")).turns] == [(0, 0), (3, 2), (5, 4)]


def test_the_session_quota_holds_for_requests_at_once():
    store = SessionStore(ttl_s=3600, max_sessions_per_tenant=3)
    store.create(SessionKey("default", "r", "response"), "m")  # a stored response counts among them
    start = threading.Barrier(12)
    made, refused = [], []

    def first_use(i: int) -> None:
        start.wait()
        try:
            if i % 2:
                made.append(store.acquire(key(f"s{i}"), "m"))
            else:
                made.append(store.create(key(f"s{i}"), "m"))
        except QuotaExceeded:
            refused.append(i)

    threads = [threading.Thread(target=first_use, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 2
    assert len(refused) == 10
    assert store.counts() == {"session": 2, "response": 1}
    assert store.acquire(key("s0", tenant="other"), "m") is not None  # another tenant's quota is its own
    for i in range(3):
        assert store.acquire(SessionKey("default", f"b{i}", "bucket"), "m") is not None
    assert store.acquire(SessionKey("default", "b3", "bucket"), "m") is None  # past it: a bucket is only a hint
    assert store.counts()["bucket"] == 3
    name = made[0].key
    if made[0].is_in_use:
        store.release(made[0])
    store.delete(name)
    store.create(key("again"), "m")  # room again once one is deleted


def test_only_an_empty_idle_session_a_refused_request_made_is_discarded(store):
    made = store.create(key("new"), "m")
    assert store.discard_unused(made)
    assert store.info(key("new")) is None
    taken = store.create(key("taken"), "m")
    store.acquire(key("taken"), "m")  # another request with the same id took it meanwhile
    assert not store.discard_unused(taken)
    store.release(taken, turn([1, 2]))
    assert not store.discard_unused(taken)  # it holds a turn now
    stale = store.create(key("stale"), "m")
    store.delete(key("stale"))
    store.create(key("stale"), "m")  # the name made again by someone else: not the record this request made
    assert not store.discard_unused(stale)
    assert store.info(key("stale")) is not None


def test_a_session_its_first_request_made_goes_when_that_request_makes_no_turn(tmp_path):
    store = SessionStore(ttl_s=3600, journal=Journal(tmp_path))
    store.release(store.acquire(key("failed"), "m"))  # its first request failed or was cancelled: no turn
    assert store.info(key("failed")) is None
    assert not list(tmp_path.rglob("*.json"))  # nor its journal record
    warmed = CompletedTurn([1, 2], "", "length", Usage(2, 0, 0), None, is_prefill_only=True)
    store.release(store.acquire(key("warmed"), "m"), warmed)  # max_tokens 0 did what it was asked: no turn, kept
    assert store.info(key("warmed")) is not None
    complete(store, "kept", [1, 2])
    store.release(store.acquire(key("kept"), "m"))  # a later request that fails leaves the session as it was
    assert store.transcript(key("kept")) == [1, 2]
    store.create(key("made"), "m")  # made by POST /v1/sessions, not by a request on first use
    store.release(store.acquire(key("made"), "m"))
    assert store.info(key("made")) is not None
    bucket = SessionKey("default", "b", kind="bucket")
    store.release(store.acquire(bucket, "m"))  # a bucket is a cache key; it keeps no record to remove
    assert store.tenant_usage("default", key("other"))[0] == 3  # warmed, kept and made


def test_a_session_whose_first_turn_the_journal_refuses_goes_as_if_never_asked_for(tmp_path):
    class FillsUp(Journal):
        def save(self, key, record):
            if record["transcript_ids"]:  # the session was made; the disk filled while its first turn ran
                raise OSError(28, "No space left on device")
            super().save(key, record)

    store = SessionStore(ttl_s=3600, journal=FillsUp(tmp_path), max_sessions_per_tenant=1)
    session = store.acquire(key("new"), "m")
    assert list(tmp_path.rglob("session-new.json"))  # journaled before it existed
    with pytest.raises(StateUnavailable, match="No space left"):
        store.release(session, turn([1, 2, 3]))
    assert store.info(key("new")) is None
    assert store.tenant_usage("default", key("other"))[0] == 0  # counts toward no quota
    assert store.acquire(key("next"), "m") is not None  # so the tenant's one session may be another
    assert not list(tmp_path.rglob("session-new.json"))  # and a restart does not bring it back
    again = SessionStore(ttl_s=3600, journal=Journal(tmp_path))
    again.restore()
    assert again.info(key("new")) is None


class BlockingShared:
    """Stands in for SharedRecords (in memory): a record store that commits on the operation read, whose `load`
    can be held once mid-way (a slow Redis read) while another thread commits."""

    def __init__(self) -> None:
        self.records: dict[SessionKey, dict] = {}
        self.load_entered, self.load_gate = threading.Event(), threading.Event()
        self.hold_next_load = False

    def epoch(self) -> str:
        return "e1"

    def load(self, key):
        found = self.records.get(key)
        found = dict(found) if found is not None else None
        if self.hold_next_load:
            self.hold_next_load = False
            self.load_entered.set()
            assert self.load_gate.wait(60), "the test never let the read answer"
        return found

    def save(self, key, record, expected_op, change="a change"):
        current = self.records.get(key, {}).get("op", "")
        if current != expected_op:
            raise SessionBusy("moved on")
        self.records[key] = dict(record)

    def touch(self, key, ttl_s):
        pass

    def delete(self, key, ttl_s, op):
        self.records.pop(key, None)


def test_a_read_of_the_shared_store_older_than_a_commit_here_is_not_adopted():
    shared = BlockingShared()
    store = SessionStore(ttl_s=3600, shared=shared)
    complete(store, "s", [1, 2])  # turn 1, committed
    shared.hold_next_load = True
    reading = threading.Thread(target=store.view, args=(key("s"),))
    reading.start()  # reads the record as it was after turn 1 ...
    assert shared.load_entered.wait(60)
    session = store.acquire(key("s"), "m")  # ... while turn 2 commits here (its own reads are not held)
    store.release(session, turn([1, 2, 3, 4]))
    shared.load_gate.set()
    reading.join(60)
    assert store.transcript(key("s")) == [1, 2, 3, 4]  # the older read did not roll turn 2 back
    assert store.view(key("s")).num_turns == 2


def test_after_redis_lost_its_data_idle_copies_go_and_one_in_use_is_left_to_its_turn(redis_server, tmp_path):
    """Redis lost its data (a flush, a restart without persistence): idle copies of the old epoch go at once; one in
    use stays, so its turn is refused by the shared store (never told done while nothing holds it) and it goes when
    next read."""
    from server.sessions.errors import SessionError
    from server.sessions.leases import LocalLeases
    from server.sessions.shared import SharedRecords

    store = SessionStore(3600, Journal(tmp_path), leases=LocalLeases(), shared=SharedRecords(redis_server.url))
    complete(store, "idle", [1, 2])
    running = store.acquire(key("busy"), "m")
    redis_server.client.flushall()
    epoch = store.shared.state.read_epoch(store.shared.client)  # a new epoch, as the lease renewer finds it
    assert store.drop_other_epochs(epoch) == 1
    assert store.session_keys() == {key("busy")}
    assert not store.journal.path_for(key("idle")).exists()
    assert store.is_live(key("busy"), running)
    with pytest.raises(SessionError):  # committed on top of a record Redis no longer holds: refused
        store.release(running, turn([3, 4]))
    assert store.view(key("busy")) is None  # read again: Redis holds nothing of it
    assert store.drop_other_epochs(epoch) == 0

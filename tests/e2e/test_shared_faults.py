"""Replicas when Redis misbehaves: what a client is told is what happened.

A change sent to Redis whose answer never came (Redis paused or unreachable mid-command) is resolved before the
client hears anything: applied, or fenced off so that it never applies later. Redis losing its data (a flush, a
restart without persistence) is noticed through its epoch, and no replica writes a copy back: deleted stays
deleted, a copy behind or diverged never commits, and the blocks a replica took as held are stored again. A Redis
that could evict records is refused at start.

A proxy in front of a real redis-server (`redis_proxy.py`) holds a command's bytes back, which is what a paused
Redis does to them, and lets the test choose whether they arrive before or after the replica's question about
their outcome.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from server.sessions.leases import RESOLVE_TAKE, TAKE
from server.sessions.shared import DELETE, RESOLVE, SAVE
from tests.e2e.cluster import CHAT, Redis, replica
from tests.e2e.redis_proxy import HoldingProxy
from tests.e2e.server import Server, _kill_leftovers  # noqa: F401 - the fixture is autouse
from tests.helpers import DEADLINE_S, wait_until

pytestmark = pytest.mark.faults


def sha(script: str) -> bytes:
    """How redis-py names a registered script on the wire (EVALSHA)."""
    return hashlib.sha1(script.encode()).hexdigest().encode()


def turn(base: str, sid: str, history: list[dict]) -> httpx.Response:
    body = {"model": "model", "messages": history, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    return httpx.post(base + CHAT, json=body, headers={"X-Session-ID": sid}, timeout=DEADLINE_S)


def said(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}


def turns_in_redis(store: Redis, sid: str) -> int:
    record = store.client.hget(f"kvserve:rec:default:session:{sid}", "record")
    return len(json.loads(record)["turns"]) - 1 if record is not None else -1


def logged(server: Server, text: str) -> bool:
    return text in server.log_path.read_text()


@pytest.fixture
def cluster(model_dir, tmp_path):
    """A real Redis, a holding proxy in front of it, and one replica that talks to Redis through the proxy and asks
    after an unanswered change for as long as a test needs."""
    store = Redis(tmp_path)
    for script in (SAVE, DELETE, RESOLVE, TAKE, RESOLVE_TAKE):  # known to Redis: a late command runs, not NOSCRIPT
        store.client.script_load(script)
    proxy = HoldingProxy(store.port)
    server = replica(model_dir, tmp_path, "a", proxy.url, KVSERVE_SHARED_RESOLVE_S=str(DEADLINE_S))
    yield store, proxy, server
    proxy.close()


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("arrives", ["before the question", "after the question"])
def test_a_turn_whose_commit_went_unanswered_is_told_as_it_happened(cluster, arrives):
    store, proxy, server = cluster
    history = [{"role": "user", "content": "Hello there"}]
    history += [said(turn(server.base, "s", history)), {"role": "user", "content": "And then?"}]

    _commit, commit_sent = proxy.hold(sha(SAVE))  # the turn's commit: sent, and (for now) not answered
    _question, asked = proxy.hold(sha(RESOLVE))
    sending, answers = in_thread(turn, server.base, "s", history)
    assert commit_sent.wait(DEADLINE_S), "the turn never committed"
    assert asked.wait(DEADLINE_S), "the replica never asked after its unanswered commit"
    if arrives == "before the question":
        proxy.release(sha(SAVE))  # the late commit runs first: it applied, and the question says so
        wait_until(lambda: turns_in_redis(store, "s") == 2, what="the late commit to land")
        proxy.release(sha(RESOLVE))
    else:
        proxy.release(sha(RESOLVE))  # the question runs first: not applied, and fenced off ...
        wait_until(lambda: logged(server, "resolved (b'aborted')"), what="the question to be answered")
        proxy.release(sha(SAVE))  # ... so the late commit refuses itself
    sending.join(DEADLINE_S)
    (second,) = answers
    if arrives == "before the question":
        assert second.status_code == 200, second.text
        assert turns_in_redis(store, "s") == 2
    else:
        assert second.status_code == 503, second.text
        assert second.json()["error"]["code"] == "shared_store_unavailable"
        assert "not applied" in second.json()["error"]["message"]
        assert turns_in_redis(store, "s") == 1  # as the client was told, even after the late commit arrived
        again = turn(server.base, "s", history)  # resent, as told
        assert again.status_code == 200, again.text
        assert turns_in_redis(store, "s") == 2  # one turn more, never two
    described = httpx.get(f"{server.base}/v1/sessions/s").json()
    assert described["turns"] == 2


def test_a_commit_whose_outcome_stays_unknown_is_told_so(model_dir, tmp_path):
    store = Redis(tmp_path)
    store.client.script_load(SAVE)
    proxy = HoldingProxy(store.port)
    try:
        server = replica(model_dir, tmp_path, "a", proxy.url, KVSERVE_SHARED_RESOLVE_S="1")
        history = [{"role": "user", "content": "Hello there"}]
        history += [said(turn(server.base, "s", history)), {"role": "user", "content": "And then?"}]
        proxy.hold(sha(SAVE))
        proxy.hold(sha(RESOLVE))  # no question about it is ever answered in time
        second = turn(server.base, "s", history)
        assert second.status_code == 503, second.text
        assert second.json()["error"]["code"] == "shared_store_uncertain"  # never "as before": it may apply yet
        proxy.release(sha(SAVE))  # and it does
        wait_until(lambda: turns_in_redis(store, "s") == 2, what="the late commit to land")
        wait_until(
            lambda: httpx.get(f"{server.base}/v1/sessions/s").json()["turns"] == 2,
            what="the replica to read the turn back",
        )
    finally:
        proxy.close()


def test_redis_stopped_while_a_turn_generates_never_commits_it_later(model_dir, tmp_path):
    store = Redis(tmp_path)
    server = replica(model_dir, tmp_path, "a", store.url)
    history = [{"role": "user", "content": "Hello there"}]
    history += [said(turn(server.base, "s", history)), {"role": "user", "content": "And then?"}]
    body = {"model": "model", "messages": history, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with httpx.stream(
        "POST", server.base + CHAT, json=body | {"stream": True}, headers={"X-Session-ID": "s"}, timeout=DEADLINE_S
    ) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # generating
        store.proc.send_signal(signal.SIGSTOP)
        try:
            events = [line for line in lines if line.startswith("data: ")]
        finally:
            store.proc.send_signal(signal.SIGCONT)
    assert events[-1] == "data: [DONE]"
    error = events[-2]
    assert '"shared_store_unavailable"' in error
    assert "as before this turn" in error  # not sent at all: Redis did not answer before it
    wait_until(lambda: httpx.get(server.base + "/ready").json()["shared_store"] == "up", what="Redis to answer again")
    assert turns_in_redis(store, "s") == 1  # whatever the stopped Redis had read never became a turn
    again = turn(server.base, "s", history)
    assert again.status_code == 200, again.text
    assert turns_in_redis(store, "s") == 2


@pytest.mark.parametrize("arrives", ["before the question", "after the question"])
def test_a_delete_whose_answer_never_came_is_told_as_it_happened(cluster, arrives):
    store, proxy, server = cluster
    assert turn(server.base, "s", [{"role": "user", "content": "Hello"}]).status_code == 200
    proxy.hold(sha(DELETE))
    _question, asked = proxy.hold(sha(RESOLVE))
    deleting, answers = in_thread(lambda: httpx.delete(f"{server.base}/v1/sessions/s", timeout=DEADLINE_S))
    assert asked.wait(DEADLINE_S), "the replica never asked after its unanswered delete"
    first, second = (sha(DELETE), sha(RESOLVE)) if arrives == "before the question" else (sha(RESOLVE), sha(DELETE))
    proxy.release(first)
    if arrives == "after the question":
        wait_until(lambda: logged(server, "resolved (b'aborted')"), what="the question to be answered")
    proxy.release(second)
    deleting.join(DEADLINE_S)
    (answer,) = answers
    if arrives == "before the question":
        assert answer.status_code == 200, answer.text
        assert turns_in_redis(store, "s") == -1  # deleted
        assert httpx.get(f"{server.base}/v1/sessions/s").status_code == 404
    else:
        assert answer.status_code == 503, answer.text
        assert "not applied" in answer.json()["error"]["message"]
        assert turns_in_redis(store, "s") == 1  # not deleted, as told, after the late delete arrived too
        assert httpx.get(f"{server.base}/v1/sessions/s").status_code == 200


def test_a_lease_take_whose_answer_never_came_never_holds_the_session_later(cluster):
    store, proxy, server = cluster
    proxy.hold(sha(TAKE))
    _question, asked = proxy.hold(sha(RESOLVE_TAKE))
    sending, answers = in_thread(turn, server.base, "s", [{"role": "user", "content": "Hello"}])
    assert asked.wait(DEADLINE_S), "the replica never asked after its unanswered lease"
    proxy.release(sha(RESOLVE_TAKE))
    wait_until(lambda: logged(server, "resolved (b'aborted')"), what="the question to be answered")
    proxy.release(sha(TAKE))  # the late take arrives: it must not take the lease
    sending.join(DEADLINE_S)
    (answer,) = answers
    assert answer.status_code == 503, answer.text
    assert not store.client.exists("kvserve:lease:default:session:s")
    assert turn(server.base, "s", [{"role": "user", "content": "Hello"}]).status_code == 200  # free, not held


def test_after_redis_loses_its_data_nothing_deleted_or_stale_comes_back(model_dir, tmp_path):
    store = Redis(tmp_path)
    a, b = replica(model_dir, tmp_path, "a", store.url), replica(model_dir, tmp_path, "b", store.url)
    history = [{"role": "user", "content": "Hello there"}]
    first = said(turn(a.base, "gone", history))
    assert httpx.get(f"{b.base}/v1/sessions/gone").status_code == 200  # b holds a copy now
    ahead = [*history, first, {"role": "user", "content": "More?"}]
    assert turn(a.base, "behind", history).status_code == 200
    assert httpx.get(f"{b.base}/v1/sessions/behind").json()["turns"] == 1  # b's copy: one turn
    assert turn(a.base, "behind", ahead).status_code == 200  # a's: two
    assert httpx.delete(f"{a.base}/v1/sessions/gone").status_code == 200

    store.client.flushall()  # Redis loses everything: the tombstone and every record
    for server in (a, b):
        wait_until(lambda s=server: logged(s, "the shared store lost its data"), what="the loss to be noticed")
    for server in (a, b):
        for sid in ("gone", "behind"):
            assert httpx.get(f"{server.base}/v1/sessions/{sid}").status_code == 404, (server.base, sid)
    assert turns_in_redis(store, "gone") == turns_in_redis(store, "behind") == -1  # nothing was written back
    again = turn(b.base, "behind", ahead)  # the whole conversation again: a new session, computed anew
    assert again.status_code == 200, again.text
    assert turns_in_redis(store, "behind") == 1
    assert httpx.get(f"{a.base}/v1/sessions/behind").json()["turns"] == 1  # both see the one that exists


def test_blocks_taken_as_held_are_stored_again_after_redis_loses_them(model_dir, tmp_path):
    store = Redis(tmp_path)
    a, b = replica(model_dir, tmp_path, "a", store.url), replica(model_dir, tmp_path, "b", store.url)
    prompt = [{"role": "user", "content": "Numbers 0123456789 and symbols appear in text. " * 6}]
    said(turn(a.base, "first", prompt))
    wait_until(lambda: store.client.keys("kvserve:blk:*"), what="a's blocks to reach Redis")
    store.client.flushall()
    wait_until(lambda: logged(a, "the shared store lost its data"), what="a to notice the loss")
    answer = said(turn(a.base, "second", prompt))  # the same tokens: the same block addresses
    wait_until(lambda: store.client.keys("kvserve:blk:*"), what="a to store the blocks again")
    history = [*prompt, answer, {"role": "user", "content": "Go on"}]
    moved = turn(b.base, "second", history)
    assert moved.status_code == 200, moved.text
    assert moved.headers["x-cache-source"] == "shared"
    assert moved.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


def test_a_redis_that_could_evict_records_is_refused_at_start(model_dir, tmp_path):
    store = Redis(tmp_path)
    store.client.config_set("maxmemory", "100mb")
    store.client.config_set("maxmemory-policy", "allkeys-lru")
    env = {"KVSERVE_REPLICA_ID": "a", "KVSERVE_SHARED_URL": store.url, "HF_HUB_OFFLINE": "1"}
    args = ["serve", "--model", str(model_dir), "--port", "0", "--state-dir", str(tmp_path / "a")]
    done = subprocess.run(
        [sys.executable, "-m", "server", *args], env={**os.environ, **env}, capture_output=True, text=True,
        timeout=DEADLINE_S,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (2, ""), done.stderr  # a bad setting: one line, as any other
    assert done.stderr.splitlines() == [
        "kvserve: --shared-url (KVSERVE_SHARED_URL): the Redis it names has maxmemory 104857600 with maxmemory-policy "
        "allkeys-lru: it could evict session records and tombstones (lost or deleted sessions served again). Give it "
        "maxmemory-policy noeviction (and persistence), or no maxmemory; put K/V blocks, which may be evicted, in "
        "another Redis with KVSERVE_SHARED_BLOCKS_URL (docs/deploy.md)"
    ]
    store.client.config_set("maxmemory-policy", "noeviction")
    replica(model_dir, tmp_path, "b", store.url)  # starts: records cannot be evicted


def test_blocks_in_a_redis_of_their_own_may_be_evicted_and_are_stored_again_when_it_loses_them(model_dir, tmp_path):
    for name in ("records", "blocks"):
        (tmp_path / name).mkdir()
    records, blocks = Redis(tmp_path / "records"), Redis(tmp_path / "blocks")
    blocks.client.config_set("maxmemory", "100mb")
    blocks.client.config_set("maxmemory-policy", "allkeys-lru")  # a cache: refused for records, fine for blocks
    a = replica(model_dir, tmp_path, "a", records.url, KVSERVE_SHARED_BLOCKS_URL=blocks.url)
    prompt = [{"role": "user", "content": "Numbers 0123456789 and symbols appear in text. " * 6}]
    said(turn(a.base, "first", prompt))
    wait_until(lambda: blocks.client.keys("kvserve:blk:*"), what="a's blocks to reach their Redis")
    assert not records.client.keys("kvserve:blk:*")
    blocks.client.flushall()
    wait_until(lambda: logged(a, "the K/V blocks' Redis lost its data"), what="a to notice the loss")
    said(turn(a.base, "second", prompt))  # the same tokens, the same addresses: stored again
    wait_until(lambda: blocks.client.keys("kvserve:blk:*"), what="a to store the blocks again")


def test_the_engine_serves_while_a_delete_waits_on_redis(cluster):
    """No Redis round trip is made under the session store's lock, which the engine thread takes every step: a
    delete waiting on Redis holds no one else up."""
    _store, proxy, server = cluster
    assert turn(server.base, "s", [{"role": "user", "content": "Hello"}]).status_code == 200
    proxy.hold(sha(DELETE))
    _question, asked = proxy.hold(sha(RESOLVE))
    deleting, _answers = in_thread(lambda: httpx.delete(f"{server.base}/v1/sessions/s", timeout=DEADLINE_S))
    try:
        assert asked.wait(DEADLINE_S), "the replica never asked after its unanswered delete"
        body = {"model": "model", "prompt": "Hello", "max_tokens": 4}
        served = httpx.post(server.base + "/v1/completions", json=body, timeout=DEADLINE_S / 4)
        assert served.status_code == 200  # generated while the delete waits
        assert httpx.get(f"{server.base}/v1/sessions", timeout=DEADLINE_S / 4).status_code == 200
    finally:
        proxy.release(sha(RESOLVE))
        proxy.release(sha(DELETE))
        deleting.join(DEADLINE_S)


def test_a_change_that_finds_redis_lost_its_data_drops_what_was_lost(tmp_path):
    """The first to notice a loss may be a change (its script refuses the old epoch), not the lease renewer: the
    replica then drops what Redis lost all the same."""
    from server.sessions.errors import SharedStoreUnavailable
    from server.sessions.record import Session, SessionKey
    from server.sessions.shared import SharedRecords
    from server.sessions.shared_state import SharedStoreState, new_op

    store = Redis(tmp_path)
    state = SharedStoreState()
    told = threading.Event()
    state.on_epoch_change(told.set)
    records = SharedRecords(store.url, state=state)
    session = Session(SessionKey("t", "s"), "m", op=new_op(), rev=1, epoch=records.epoch())
    records.save(session.key, session.to_record(), expected_op="")
    store.client.flushall()
    with pytest.raises(SharedStoreUnavailable, match="lost its data"):
        records.save(session.key, {**session.to_record(), "op": new_op(), "rev": 2}, expected_op=session.op)
    assert told.wait(DEADLINE_S), "the loss was noticed, and nothing was dropped"
    assert state.held_epoch() != session.epoch
    records.close()


def test_a_turn_on_a_record_redis_lost_is_told_so_even_once_the_new_epoch_is_known(tmp_path):
    """Between acquire and release Redis is flushed, and another thread (the lease renewer, a request) reads the new
    epoch before the turn commits: the turn is refused for the lost data (503), not as another replica's change."""
    from server.sessions.errors import SharedStoreLost
    from server.sessions.leases import LocalLeases
    from server.sessions.record import CompletedTurn, SessionKey, Usage
    from server.sessions.shared import SharedRecords
    from server.sessions.store import SessionStore

    store = Redis(tmp_path)
    records = SharedRecords(store.url)
    sessions = SessionStore(3600, leases=LocalLeases(), shared=records)
    key = SessionKey("t", "s")
    sessions.release(sessions.acquire(key, "m"), CompletedTurn([1, 2], "", "stop", Usage(2, 0, 0), None))
    session = sessions.acquire(key, "m")
    store.client.flushall()
    records.state.read_epoch(records.client)  # what the lease renewer does within a third of a lease
    with pytest.raises(SharedStoreLost, match="this turn was not applied: the shared store lost its data"):
        sessions.release(session, CompletedTurn([1, 2, 3, 4], "", "stop", Usage(2, 0, 0), None))
    assert turns_in_redis(store, "s") == -1  # nothing written back
    assert sessions.view(key) is None  # the copy goes too: Redis holds nothing of it
    records.close()


def test_redis_flushed_under_a_streamed_turn_ends_it_with_what_happened(model_dir, tmp_path):
    store = Redis(tmp_path)
    server = replica(model_dir, tmp_path, "a", store.url)
    history = [{"role": "user", "content": "Hello there"}]
    history += [said(turn(server.base, "s", history)), {"role": "user", "content": "And then?"}]
    body = {"model": "model", "messages": history, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with httpx.stream(
        "POST", server.base + CHAT, json=body | {"stream": True}, headers={"X-Session-ID": "s"}, timeout=DEADLINE_S
    ) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # generating
        store.client.flushall()
        wait_until(lambda: logged(server, "the shared store lost its data"), what="the loss to be noticed")
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "shared_store_unavailable", error
    assert error["type"] == "service_unavailable"
    assert error["message"] == (
        "session 's': this turn was not applied: the shared store lost its data (restarted without persistence, or "
        "flushed), this session with it"
    )
    assert turns_in_redis(store, "s") == -1  # not applied, and nothing written back
    assert httpx.get(f"{server.base}/v1/sessions/s").status_code == 404

"""Sessions across real replicas sharing a real Redis: a conversation continues exactly on whichever replica
gets it, restored from K/V blocks in Redis; a turn commits only on top of the revision its replica read; a
delete is seen everywhere; a tampered block is recomputed, never served; tenants share no block."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import httpx
import pytest

from server.sessions.errors import SessionBusy
from server.sessions.journal import Journal
from server.sessions.leases import LocalLeases
from server.sessions.record import CompletedTurn, SessionKey, Usage
from server.sessions.shared import SharedRecords
from server.sessions.store import SessionStore
from server.settings import Settings
from tests.e2e.cluster import CHAT, Redis, replica
from tests.e2e.server import _kill_leftovers  # noqa: F401 - the fixture is autouse
from tests.helpers import wait_until
from tests.http.conftest import serve_live
from tests.http.test_responsiveness import Held, health_while_held

pytestmark = pytest.mark.e2e
BLOCK_SIZE = 16
QUESTIONS = ["Hello there", "Tell me more", "And then?"]


def chat(base: str, sid: str, history: list[dict], max_tokens: int = 8, key: str | None = None) -> httpx.Response:
    body = {"model": "model", "messages": history, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    headers = {"X-Session-ID": sid} | ({"Authorization": f"Bearer {key}"} if key else {})
    return httpx.post(base + CHAT, json=body, headers=headers, timeout=120)


def reply(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def converse(bases: list[str], sid: str, before: Callable[[int], None] = lambda i: None) -> list[httpx.Response]:
    """One turn per question, turn i on bases[i] after `before(i)`; each turn's answer."""
    history: list[dict] = []
    answers = []
    for i, (base, question) in enumerate(zip(bases, QUESTIONS, strict=True)):
        before(i)
        history.append({"role": "user", "content": question})
        answers.append(chat(base, sid, history))
        history.append({"role": "assistant", "content": reply(answers[-1])})
    return answers


def seen(answers: list[httpx.Response]) -> list[tuple[str, int]]:
    return [(reply(r), r.json()["usage"]["prompt_tokens"]) for r in answers]


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.timeout(300)
def test_a_session_continues_exactly_on_any_replica_and_once(model_dir, tmp_path):
    store = Redis(tmp_path)
    a, b = replica(model_dir, tmp_path, "a", store.url), replica(model_dir, tmp_path, "b", store.url)
    reference = converse([a.base] * 3, "reference")

    def kill_a_before_the_last(i: int) -> None:
        if i == 2:
            a.proc.send_signal(signal.SIGKILL)
            a.proc.wait(30)

    # Turns 1 and 2 on a; a is SIGKILLed; turn 3 on b, which never saw the session.
    moved = converse([a.base, a.base, b.base], "moved", kill_a_before_the_last)
    assert seen(moved) == seen(reference)  # the same replies from the same token ids: the transcript came from Redis
    assert moved[2].headers["x-kvserve-replica"] == "b"
    assert moved[2].headers["x-cache-source"] == "shared"  # the K/V a computed, from Redis' blocks
    history_tokens = moved[1].json()["usage"]["total_tokens"]
    # At least the history but its last partial block (more: "reference" holds the same tokens, same tenant).
    assert history_tokens - BLOCK_SIZE <= cached(moved[2]) < moved[2].json()["usage"]["prompt_tokens"]

    described = httpx.get(b.base + "/v1/sessions/moved").json()
    assert described["turns"] == 3
    assert described["transcript_tokens"] == httpx.get(b.base + "/v1/sessions/reference").json()["transcript_tokens"]

    # Deleted on b: no replica serves it afterwards (a restarted replica with its own stale copy included).
    assert httpx.delete(b.base + "/v1/sessions/moved").status_code == 200
    a = replica(model_dir, tmp_path, "a", store.url)  # its journal still holds "moved"
    assert httpx.get(a.base + "/v1/sessions/moved").status_code == 404
    assert httpx.get(a.base + "/v1/sessions/reference").json()["turns"] == 3

    # Every block in Redis tampered with: a's next turn of "reference" (its pool empty since the kill) reads
    # them, refuses them by their checksum and computes the whole prompt instead.
    for name in store.client.scan_iter("kvserve:blk:*"):
        value = bytearray(store.client.get(name))
        value[-1] ^= 0xFF
        store.client.set(name, bytes(value))
    history = []
    for r, question in zip(reference, QUESTIONS, strict=True):
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": reply(r)}]
    tampered = chat(a.base, "reference", [*history, {"role": "user", "content": "One more"}])
    reply(tampered)
    assert tampered.headers["x-cache-source"] == "none"
    assert cached(tampered) == 0

    # The same new session on both replicas at once: one 200, one 409, one turn recorded.
    results: list[httpx.Response] = []
    go = threading.Barrier(2)

    def send(base: str) -> None:
        go.wait(30)
        results.append(chat(base, "both", [{"role": "user", "content": "Hi"}], max_tokens=300))

    threads = [threading.Thread(target=send, args=(base,)) for base in (a.base, b.base)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(240)
    assert sorted(r.status_code for r in results) == [200, 409], [r.text for r in results]
    for base in (a.base, b.base):
        assert httpx.get(base + "/v1/sessions/both").json()["turns"] == 1
    assert int(store.client.hget("kvserve:rec:default:session:both", "rev")) == 2  # created, then one turn


def test_a_turn_commits_only_on_the_revision_it_read(tmp_path):
    """Two stores on one Redis whose leases did not keep them apart (an expired lease, say): the second
    turn on the same revision is refused and not applied, and neither store's record moves backwards."""
    server = Redis(tmp_path)
    stores = [SessionStore(3600, leases=LocalLeases(), shared=SharedRecords(server.url)) for _ in range(2)]
    key = SessionKey("t", "s1")
    stores[0].create(key, "m")
    first, second = (store.acquire(key, "m", is_chat=False) for store in stores)
    assert first is not None
    assert second is not None
    stores[0].release(first, CompletedTurn([1, 2, 3], "", "stop", Usage(3, 0, 0), None))
    with pytest.raises(SessionBusy, match="changed by another replica"):
        stores[1].release(second, CompletedTurn([4, 5], "", "stop", Usage(2, 0, 0), None))
    assert stores[1].view(key) is not None
    assert stores[1].view(key).transcript_ids == [1, 2, 3]  # the committed turn, read back
    assert stores[0].view(key).num_turns == 1
    # A record the two stores never shared: creating it on both is one success and one refusal.
    other = SessionKey("t", "s2")
    stores[1].create(other, "m")
    with pytest.raises(SessionBusy, match="already exists"):
        stores[0].create(other, "m")


@pytest.mark.timeout(240)
def test_blocks_are_stored_once_per_tenant_and_never_across(model_dir, tmp_path):
    store = Redis(tmp_path)
    keys = {"alice": "sk-alice-000001", "bob": "sk-bob-0000001"}
    api_keys = ",".join(f"{key}:{tenant}" for tenant, key in keys.items())
    a = replica(model_dir, tmp_path, "a", store.url, KVSERVE_API_KEYS=api_keys, KVSERVE_METRICS_NEEDS_KEY="false")
    prompt = [{"role": "system", "content": "You are a careful assistant. " * 12}, {"role": "user", "content": "Hi"}]

    def blocks_after(tenant: str, sid: str) -> int:
        """Run the prompt as `tenant`; once the writer has handled every block handed to it, how many Redis holds."""
        reply(chat(a.base, sid, prompt, key=keys[tenant]))  # blocks are handed over before the final event
        wait_until(
            lambda: (
                _shared_blocks(a.base, "written") + _shared_blocks(a.base, "skipped")
                == _shared_blocks(a.base, "queued")
            ),
            30,
            "the shared writer to handle the turn's blocks",
        )
        return len(list(store.client.scan_iter("kvserve:blk:*")))

    first = blocks_after("alice", "s1")
    assert first >= 5  # a system prompt of more than 5 blocks, and the reply
    assert blocks_after("alice", "s2") == first  # the same tokens of the same tenant: stored once
    assert blocks_after("bob", "s1") == 2 * first  # the same tokens of another tenant: none shared


def _shared_blocks(base: str, outcome: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(f'kvserve:kv_store_blocks_total{{outcome="{outcome}",tier="shared"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no kvserve:kv_store_blocks_total for the shared tier's {outcome}")


@pytest.mark.parametrize("call", ["record", "lease"])
async def test_waiting_on_redis_never_holds_the_event_loop(tiny_spec, tmp_path, monkeypatch, call):
    """A session turn's Redis round trips (reading the record, taking the lease) run on worker threads: held
    mid-way, /health still answers (a hung Redis must not freeze every other request)."""
    store = Redis(tmp_path)
    with serve_live([tiny_spec], Settings(shared_url=store.url, state_dir=None)) as (base, engine):
        target = engine.store.shared if call == "record" else engine.store.leases.leases
        held = Held(target.load if call == "record" else target.take)
        monkeypatch.setattr(target, "load" if call == "record" else "take", held)

        async def send() -> httpx.Response:
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
                return await client.post(CHAT, json=body, headers={"X-Session-ID": "held"})

        r = await health_while_held(base, held, send())
        assert r.status_code == 200, r.text


def test_a_name_deleted_here_and_reused_elsewhere_is_journaled_here_again(tmp_path):
    server = Redis(tmp_path)
    a, b = (
        SessionStore(3600, Journal(tmp_path / n), leases=LocalLeases(), shared=SharedRecords(server.url)) for n in "ab"
    )
    key = SessionKey("t", "reused")
    a.create(key, "m")
    assert a.delete(key)
    assert b.view(key) is None  # the tombstone: b never adopts a deleted session
    b.create(key, "m")  # a new session under the same name
    assert a.view(key) is not None  # a reads it from Redis...
    assert a.journal.path_for(key).exists()  # ...and journals it, though it deleted that name before

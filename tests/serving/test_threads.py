"""Message threads' bookkeeping on the session store alone (no model): each message is continued once, a continue
in flight refuses another, a failed one frees its parent, and what each refusal tells the client."""

from __future__ import annotations

import threading

import pytest

from server.openai.errors import ApiError
from server.serving.threads import THREAD_KIND, claim, thread_node
from server.sessions.errors import SessionBusy
from server.sessions.journal import Journal
from server.sessions.record import SessionKey
from server.sessions.store import SessionStore

PARENT = "msg_" + "a" * 32
CHILD, OTHER = "msg_" + "b" * 32, "msg_" + "c" * 32


def node(store: SessionStore, name: str, status: str = "completed", parent: str | None = None) -> SessionKey:
    key = SessionKey("alice", name, THREAD_KIND)
    store.create(key, "m", 60, parent=parent, extras={"status": status})
    return key


def refusal(store: SessionStore, parent: SessionKey, child: str) -> ApiError:
    with pytest.raises(ApiError) as err:
        claim(store, parent, child)
    return err.value


def test_a_message_is_continued_once():
    store = SessionStore(ttl_s=60)
    parent = node(store, PARENT)
    claim(store, parent, CHILD)
    assert store.view(parent).extras["continued_by"] == CHILD
    node(store, CHILD, "completed", PARENT)
    err = refusal(store, parent, OTHER)
    assert (err.status, err.code) == (400, "thread_already_continued")
    assert store.view(parent).extras["continued_by"] == CHILD  # the refused one changed nothing


def test_a_continue_in_flight_refuses_another():
    store = SessionStore(ttl_s=60)
    parent = node(store, PARENT)
    claim(store, parent, CHILD)
    node(store, CHILD, "in_progress", PARENT)
    err = refusal(store, parent, OTHER)
    assert (err.status, err.code) == (400, "thread_continue_in_flight")


def test_a_claim_naming_a_node_that_is_gone_is_free():
    store = SessionStore(ttl_s=60)
    parent = node(store, PARENT)
    claim(store, parent, CHILD)  # its node was never made, or its turn failed and it went
    claim(store, parent, OTHER)
    assert store.view(parent).extras["continued_by"] == OTHER


def test_only_a_completed_node_of_the_tenant_can_be_continued():
    store = SessionStore(ttl_s=60)
    unfinished = node(store, PARENT, "in_progress")
    assert refusal(store, unfinished, CHILD).code == "thread_not_found"
    assert refusal(store, SessionKey("alice", OTHER, THREAD_KIND), CHILD).status == 404  # unknown
    node(store, CHILD)
    assert refusal(store, SessionKey("bob", CHILD, THREAD_KIND), OTHER).code == "thread_not_found"  # foreign
    assert thread_node(store, "bob", CHILD) is None
    assert thread_node(store, "alice", CHILD) is not None
    assert thread_node(store, "alice", "not-a-message-id") is None  # never one of ours


def test_two_claims_at_once_one_wins(monkeypatch):
    """Both read the parent unclaimed; the mark is a compare-and-set, so the second is refused as in flight."""
    store = SessionStore(ttl_s=60)
    parent = node(store, PARENT)
    first_read, release = threading.Event(), threading.Event()
    view = store.view

    def slow_view(key):
        found = view(key)
        if key == parent and threading.current_thread().name == "first":
            first_read.set()
            assert release.wait(30), "the second claim did not run"
        return found

    monkeypatch.setattr(store, "view", slow_view)
    errors: list[ApiError] = []

    def first() -> None:
        try:
            claim(store, parent, CHILD)
        except ApiError as exc:
            errors.append(exc)

    thread = threading.Thread(target=first, name="first")
    thread.start()
    assert first_read.wait(30), "the first claim did not read the parent"
    claim(store, parent, OTHER)  # the second, while the first has read but not marked
    release.set()
    thread.join(30)
    assert [e.code for e in errors] == ["thread_continue_in_flight"]
    assert view(parent).extras["continued_by"] == OTHER


def test_mark_is_journaled_and_compares_first(tmp_path):
    store = SessionStore(ttl_s=60, journal=Journal(tmp_path))
    parent = node(store, PARENT)
    store.mark(parent, "continued_by", CHILD, None)
    with pytest.raises(SessionBusy):
        store.mark(parent, "continued_by", OTHER, None)  # not what it is now
    again = SessionStore(ttl_s=60, journal=Journal(tmp_path))
    again.restore()
    assert again.view(parent).extras == {"status": "completed", "continued_by": CHILD}

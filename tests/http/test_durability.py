"""What the API answered is what survives a restart: faults of the state directory (read-only, full, removed
while running), then a restart on the same directory, and a comparison."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from tests.http.conftest import wait_ready

pytestmark = pytest.mark.faults


CHAT = "/v1/chat/completions"


@pytest.fixture
def state(tmp_path) -> Path:
    return tmp_path / "state"


def serve(tiny_spec, state: Path, **settings) -> TestClient:
    return TestClient(create_app(Settings(state_dir=state, default_max_tokens=4, **settings), specs=[tiny_spec]))


def chat_turns(client, sid: str, users: list[str]):
    messages, last = [], None
    for user in users:
        messages.append({"role": "user", "content": user})
        last = client.post(CHAT, json={"model": "tiny", "session_id": sid, "messages": messages, "temperature": 0})
        if last.status_code != 200:
            return last
        messages.append({"role": "assistant", "content": last.json()["choices"][0]["message"]["content"]})
    return last


def sessions_of(client) -> dict[str, tuple[int, int]]:
    """Every session: (turns, transcript tokens)."""
    data = client.get("/v1/sessions", params={"limit": 1000}).json()["data"]
    return {s["id"]: (s["turns"], s["transcript_tokens"]) for s in data}


def journal_fault(monkeypatch, state: Path, method: str, code: int) -> None:
    """Writes (`write_text`) or removals (`unlink`) of journal files fail with `code` (EROFS, ENOSPC)."""
    real = getattr(Path, method)

    def failing(self, *args, **kwargs):
        if (state / "sessions") in self.parents:
            raise OSError(code, errno.errorcode[code])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, method, failing)


def test_a_read_only_journal_refuses_deletes_and_nothing_comes_back(tiny_spec, state, monkeypatch):
    with serve(tiny_spec, state) as client:
        wait_ready(client)
        sid = client.post("/v1/sessions", json={"system": "Be brief."}).json()["id"]
        assert chat_turns(client, sid, ["Hello", "Paris is"]).status_code == 200
        before = sessions_of(client)
        journal_fault(monkeypatch, state, "unlink", errno.EROFS)
        r = client.delete(f"/v1/sessions/{sid}")
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "state_unavailable"
        assert sessions_of(client) == before  # refused, so not applied
        monkeypatch.undo()
        assert chat_turns(client, sid, ["Hello", "Paris is", "The quick"]).status_code == 200  # and it goes on
        before = sessions_of(client)
        assert before[sid][0] == 3
    with serve(tiny_spec, state) as client:
        wait_ready(client)
        assert sessions_of(client) == before
        assert client.delete(f"/v1/sessions/{sid}").status_code == 200  # writable again: it goes, for good
    with serve(tiny_spec, state) as client:
        wait_ready(client)
        assert sid not in sessions_of(client)


@pytest.mark.parametrize("change", ["rewind", "turn", "create", "fork"])
def test_a_full_disk_refuses_every_change_and_memory_never_runs_ahead(tiny_spec, state, monkeypatch, change):
    with serve(tiny_spec, state) as client:
        wait_ready(client)
        sid = client.post("/v1/sessions", json={}).json()["id"]
        assert chat_turns(client, sid, ["Hello", "Paris is"]).status_code == 200
        before = sessions_of(client)
        journal_fault(monkeypatch, state, "write_text", errno.ENOSPC)
        if change == "rewind":
            r = client.post(f"/v1/sessions/{sid}/rewind", json={"turn": 1})
        elif change == "turn":
            r = chat_turns(client, sid, ["Hello", "Paris is", "The quick"])
        elif change == "create":
            r = client.post("/v1/sessions", json={})
        else:
            r = client.post(f"/v1/sessions/{sid}/fork", json={"turn": 1})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "state_unavailable"
        assert sessions_of(client) == before
        monkeypatch.undo()
    with serve(tiny_spec, state) as client:
        wait_ready(client)
        assert sessions_of(client) == before


def test_a_first_turn_the_full_disk_refuses_leaves_no_session(tiny_spec, state, monkeypatch):
    """The session is made (journaled) on first use, then the disk fills while its first turn generates: the 503
    says the session is as before this turn, and before this turn there was none."""
    real = Path.write_text

    def fills_up(self, data, *args, **kwargs):
        if (state / "sessions") in self.parents and '"transcript_ids":[]' not in data:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data, *args, **kwargs)

    with serve(tiny_spec, state, max_sessions_per_tenant=1) as client:
        wait_ready(client)
        monkeypatch.setattr(Path, "write_text", fills_up)
        r = client.post(
            CHAT, json={"model": "tiny", "session_id": "first", "messages": [{"role": "user", "content": "Hi"}]}
        )
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "state_unavailable"
        monkeypatch.undo()
        assert client.get("/v1/sessions/first").status_code == 404
        assert client.post("/v1/sessions", json={}).status_code == 201  # the tenant's one session is still free
        kept = sessions_of(client)
    with serve(tiny_spec, state) as client:
        wait_ready(client)
        assert sessions_of(client) == kept
        assert client.get("/v1/sessions/first").status_code == 404  # nor does a restart bring it back


def test_a_state_directory_removed_while_running_is_written_again_at_shutdown(tiny_spec, state):
    with serve(tiny_spec, state) as client:
        wait_ready(client)
        for i in range(3):
            sid = client.post("/v1/sessions", json={"system": f"Assistant {i}."}).json()["id"]
            assert chat_turns(client, sid, ["Hello", "Paris is"]).status_code == 200
        before = sessions_of(client)
        shutil.rmtree(state)  # an operator's mistake, or a volume gone bad
    with serve(tiny_spec, state) as client:
        wait_ready(client)
        assert sessions_of(client) == before
        restored = client.get(f"/v1/sessions/{next(iter(before))}").json()
        assert restored["cache"]["disk"]["tokens"] > 0  # and the K/V with them


def test_a_sessions_next_turn_after_a_restart_reads_its_kv_from_disk(tiny_spec, state):
    body = {"model": "tiny", "session_id": "kept", "temperature": 0}
    with serve(tiny_spec, state) as client:
        wait_ready(client)
        messages = [{"role": "user", "content": "Hello"}]
        first = client.post(CHAT, json={**body, "messages": messages})
        assert first.status_code == 200, first.text
    reply = {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}
    messages += [reply, {"role": "user", "content": "Paris is"}]
    with serve(tiny_spec, state) as client:
        wait_ready(client)
        again = client.post(CHAT, json={**body, "messages": messages})  # its first request after the restart
        assert again.status_code == 200, again.text
        assert again.headers["X-Cache-Source"] == "disk"  # the pool starts empty: its snapshot was read
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_response_continued_after_a_restart_reads_its_parents_kv_from_disk(tiny_spec, state):
    body = {"model": "tiny", "temperature": 0, "max_output_tokens": 4}
    with serve(tiny_spec, state) as client:
        wait_ready(client)
        parent = client.post("/v1/responses", json={**body, "input": "Hello world"})
        assert parent.status_code == 200, parent.text
    with serve(tiny_spec, state) as client:
        wait_ready(client)
        child = client.post(
            "/v1/responses", json={**body, "input": "Paris is", "previous_response_id": parent.json()["id"]}
        )
        assert child.status_code == 200, child.text
        assert child.headers["X-Cache-Source"] == "disk"
        assert child.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0

"""Restarts of a real server process: SIGTERM drains and saves K/V, SIGKILL loses no completed turn."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from server.kv.block_store import addresses
from server.kv.disk_blocks import DiskBlocks
from tests.e2e.server import Server, _kill_leftovers  # noqa: F401 - the fixture is autouse
from tests.helpers import DEADLINE_S, wait_until

pytestmark = pytest.mark.faults


CHAT = "/v1/chat/completions"
# The drained stream: long enough to outlast the first refused request by far (milliseconds after the signal).
# The grace is far longer than it could ever take (~1 ms per token here): the drain ends when the stream does,
# so the test waits for that event, never for a time.
STREAM_TOKENS = 1000
GRACE_S = 600
GRACE = {"KVSERVE_SHUTDOWN_GRACE_S": str(GRACE_S)}


def chat(base: str, sid: str, messages: list[dict], **extra) -> httpx.Response:
    body = {"model": "model", "session_id": sid, "messages": messages, "temperature": 0, "max_tokens": 8, **extra}
    return httpx.post(base + CHAT, json=body, timeout=60)


def two_turns(base: str, sid: str, first: str = "Hello world") -> list[dict]:
    messages = []
    for user in (first, "Paris is"):
        messages.append({"role": "user", "content": user})
        r = chat(base, sid, messages)
        assert r.status_code == 200, r.text
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    return messages


def session(base: str, sid: str) -> dict:
    return httpx.get(f"{base}/v1/sessions/{sid}").json()


def stream_in_thread(base: str, out: list) -> threading.Thread:
    def read() -> None:
        body = {"model": "model", "messages": [{"role": "user", "content": "Tell"}], "max_tokens": STREAM_TOKENS}
        body |= {"stream": True, "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", base + CHAT, json=body, timeout=DEADLINE_S) as r:
            out.extend(r.iter_lines())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(4 * DEADLINE_S + 300)  # waits below: each has its own deadline and message
def test_sigterm_drains_then_sessions_come_back_with_their_kv(model_dir, tmp_path):
    state = tmp_path / "state"
    server = Server(model_dir, state, tmp_path / "log.txt", GRACE)
    sids = [httpx.post(server.base + "/v1/sessions", json={"system": "Be brief."}).json()["id"] for _ in range(2)]
    firsts = ["Hello", "Numbers 0123"]
    conversations = {sid: two_turns(server.base, sid, first) for sid, first in zip(sids, firsts, strict=True)}
    before = {sid: session(server.base, sid) for sid in sids}
    lines: list[str] = []
    reader = stream_in_thread(server.base, lines)
    wait_until(lambda: lines, what="the stream to start")
    server.proc.send_signal(signal.SIGTERM)
    refused = None
    for _ in range(200):  # the drain starts at once; new requests are refused while the stream goes on
        refused = chat(server.base, sids[0], conversations[sids[0]] + [{"role": "user", "content": "x"}])
        if refused.status_code == 503:
            break
        time.sleep(0.02)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "shutting_down"
    assert httpx.get(server.base + "/ready").status_code == 503
    reader.join(DEADLINE_S)
    assert not reader.is_alive(), "the drained stream did not end"
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2]  # the stream finished whole
    assert server.proc.wait(DEADLINE_S) == 0  # drained: it exits as soon as the stream has ended
    server.log.close()
    manifests = {p.name for p in (state / "kv").rglob("*.kv.json")}
    assert manifests >= {f"session-{sid}.kv.json" for sid in sids}
    # Break the first block of the second session's that the first does not share (blocks are stored once): it
    # must be refused with a warning and recomputed, never crash the server.
    names = []
    for sid in sids:
        manifest = json.loads(next((state / "kv").rglob(f"session-{sid}.kv.json")).read_text())
        tenant, fingerprint, block_size = manifest["session"][0], manifest["fingerprint"], manifest["block_size"]
        names.append(addresses(fingerprint, block_size, tenant, manifest["token_ids"]))
    broken = DiskBlocks(state / "kv" / "blocks").path_for(next(n for n in names[1] if n not in names[0]))
    data = bytearray(broken.read_bytes())
    data[-1] ^= 0xFF
    broken.write_bytes(bytes(data))

    again = Server(model_dir, state, tmp_path / "log.txt", GRACE)
    try:
        listed = {s["id"]: s for s in httpx.get(again.base + "/v1/sessions").json()["data"]}
        for sid in sids:  # listed at once, before any turn restores anything
            assert listed[sid]["turns"] == 2
            assert listed[sid]["transcript_tokens"] == before[sid]["transcript_tokens"]
            assert listed[sid]["cache"]["disk"]["tokens"] > 0
            assert listed[sid]["cache"]["device"]["tokens"] == 0
        for sid, is_intact in zip(sids, [True, False], strict=True):
            r = chat(again.base, sid, conversations[sid] + [{"role": "user", "content": "The quick"}])
            assert r.status_code == 200, r.text
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            if is_intact:
                assert r.headers["X-Cache-Source"] == "disk"
                assert r.headers["X-Cache"] == "partial"
                assert cached == before[sid]["transcript_tokens"] - 1
            else:  # its turns recomputed; only what it shares with the first session (system prompt) is reused
                assert r.headers["X-Cache-Source"] in ("device", "none")
                assert cached < before[sid]["transcript_tokens"] - 8
            assert session(again.base, sid)["turns"] == 3
    finally:
        assert again.stop(signal.SIGTERM) == 0
    assert "checksum mismatch" in (tmp_path / "log.txt").read_text()


def test_sigkill_loses_no_completed_turn(model_dir, tmp_path):
    state = tmp_path / "state"
    server = Server(model_dir, state, tmp_path / "log.txt", GRACE)
    messages = two_turns(server.base, "kept")
    before = session(server.base, "kept")
    server.stop(signal.SIGKILL)  # right after the second turn's response: no chance to save anything else
    again = Server(model_dir, state, tmp_path / "log.txt", GRACE)
    try:
        after = session(again.base, "kept")
        assert after["turns"] == 2
        assert after["transcript_tokens"] == before["transcript_tokens"]
        r = chat(again.base, "kept", [*messages, {"role": "user", "content": "The quick"}])
        assert r.status_code == 200
        assert r.headers["X-Cache"] == "miss"  # the K/V is recomputed
        transcript_ids = before["transcript_tokens"]
        assert r.json()["usage"]["prompt_tokens"] > transcript_ids  # the transcript, then the new turn
        assert session(again.base, "kept")["turns"] == 3
    finally:
        again.stop(signal.SIGTERM)

"""Restarts of a real server process: SIGTERM drains and saves K/V, SIGKILL loses no completed turn."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx
import pytest

from server.kv.block_store import addresses
from server.kv.disk_blocks import DiskBlocks
from tests.e2e.server import Server, _kill_leftovers  # noqa: F401 - the fixture is autouse
from tests.helpers import DEADLINE_S, wait_until

pytestmark = pytest.mark.faults


CHAT = "/v1/chat/completions"
# The drain is held open by events, never by a time. A stateless stream whose generation cannot end before the test
# lets it go (its tokens take all but SLACK_TOKENS of the pool, and far longer than the test could wait) keeps a
# session's streamed turn queued behind it for blocks, so both are in flight when the signal comes. The test sees
# /ready and new requests answered 503, then its client leaves the held stream; the queued turn then runs whole
# during the drain, and the server exits once it has ended, saving what the pool holds of the sessions.
POOL_TOKENS = 1 << 17
SLACK_TOKENS = 512  # the pool left beside the held stream: less than the queued turn needs
HELD_TOKENS = POOL_TOKENS - SLACK_TOKENS
LONG_MESSAGE = "The quick brown fox jumps over the lazy dog. " * 40  # 760 tokens: the queued turn needs the slack
STREAM_TOKENS = 16
GRACE_S = 600  # far longer than the drain takes: it ends when the streams do
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


def stream_in_thread(base: str, body: dict, out: list, let_go: threading.Event | None = None) -> threading.Thread:
    """Stream `body`'s answer, its lines into `out`; with `let_go`, leave at its first event once that is set (the
    client goes away: its generation stops within a step)."""

    def read() -> None:
        with httpx.stream("POST", base + CHAT, json=body, timeout=DEADLINE_S) as r:
            for line in r.iter_lines():
                out.append(line)
                if let_go is not None and let_go.is_set() and line.startswith("data: "):
                    return

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def streamed(messages: list[dict], max_tokens: int, sid: str | None = None) -> dict:
    body = {"model": "model", "messages": messages, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    body |= {"temperature": 0, "stream_options": {"include_usage": True}}
    return body | ({"session_id": sid} if sid else {})


def requests_in_engine(base: str) -> tuple[float, float]:
    """(running, waiting) as the engine last published them: one snapshot, taken after a step."""
    found = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        for gauge in ("running", "waiting"):
            if line.startswith(f'kvserve:num_requests_{gauge}{{model="model"}}'):
                found[gauge] = float(line.split()[-1])
    return found["running"], found["waiting"]


def pool_bytes(model_dir: Path, num_tokens: int) -> int:
    """The bytes of a pool holding `num_tokens` of the model's K/V in fp32 (as Server serves it)."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4 * num_tokens


@pytest.mark.timeout(4 * DEADLINE_S + 300)  # waits below: each has its own deadline and message
def test_sigterm_drains_then_sessions_come_back_with_their_kv(model_dir, tmp_path):
    state = tmp_path / "state"
    env = GRACE | {  # nothing but its client ends the held stream: not its length, a timeout or a slow read
        "KVSERVE_KV_BUDGET_BYTES": str(pool_bytes(model_dir, POOL_TOKENS)),
        "KVSERVE_MAX_TOKENS_LIMIT": str(HELD_TOKENS),
        "KVSERVE_MAX_UNREAD_EVENTS": str(2 * HELD_TOKENS),
        "KVSERVE_REQUEST_TIMEOUT_S": "36000",
    }
    server = Server(model_dir, state, tmp_path / "log.txt", env, max_context=2 * POOL_TOKENS)
    sids = [httpx.post(server.base + "/v1/sessions", json={"system": "Be brief."}).json()["id"] for _ in range(2)]
    firsts = ["Hello", "Numbers 0123"]
    conversations = {sid: two_turns(server.base, sid, first) for sid, first in zip(sids, firsts, strict=True)}
    before = session(server.base, sids[0])
    held_lines: list[str] = []
    let_go = threading.Event()
    tell = streamed([{"role": "user", "content": "Tell"}], HELD_TOKENS)
    held = stream_in_thread(server.base, tell, held_lines, let_go)
    wait_until(lambda: held_lines, what="the held stream to start")  # admitted: its blocks are reserved
    queued = conversations[sids[1]] + [{"role": "user", "content": LONG_MESSAGE}]
    lines: list[str] = []
    reader = stream_in_thread(server.base, streamed(queued, STREAM_TOKENS, sids[1]), lines)
    # the held stream running and one more request in the engine (published after a step the held one ran in)
    wait_until(lambda: requests_in_engine(server.base) == (1, 1), what="the session's turn to queue for blocks")
    server.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(server.base + "/ready").status_code == 503, what="/ready to answer 503")
    refused = chat(server.base, sids[0], conversations[sids[0]] + [{"role": "user", "content": "x"}])
    assert refused.status_code == 503, refused.text  # refused, not queued
    assert refused.json()["error"]["code"] == "shutting_down"
    assert not lines, "the queued turn ran while the held stream held its blocks"
    let_go.set()  # the held stream's client leaves: the queued turn gets its blocks
    held.join(DEADLINE_S)
    assert not held.is_alive(), "the held stream's client did not leave"
    reader.join(DEADLINE_S)
    assert not reader.is_alive(), "the drained stream did not end"
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    events = [json.loads(item) for item in data[:-1]]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"  # whole, in the drain
    usage = events[-1]["usage"]
    reply = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    conversations[sids[1]] = [*queued, {"role": "assistant", "content": reply}]
    assert server.proc.wait(DEADLINE_S) == 0  # drained: it exits as soon as the streams have ended
    server.log.close()
    log = (tmp_path / "log.txt").read_text()
    assert "draining: 2 requests still running" in log
    assert "the K/V of 1 sessions" in log  # the turn run in the drain, saved at shutdown (the other went down
    # a tier while the turn waited for blocks)
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
        turns = {sids[0]: 2, sids[1]: 3}
        for sid in sids:  # listed at once, before any turn restores anything
            assert listed[sid]["turns"] == turns[sid]
            assert listed[sid]["cache"]["disk"]["tokens"] > 0
            assert listed[sid]["cache"]["device"]["tokens"] == 0
        assert listed[sids[0]]["transcript_tokens"] == before["transcript_tokens"]
        assert listed[sids[1]]["transcript_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        for sid, is_intact in zip(sids, [True, False], strict=True):
            r = chat(again.base, sid, conversations[sid] + [{"role": "user", "content": "The quick"}])
            assert r.status_code == 200, r.text
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            if is_intact:
                assert r.headers["X-Cache-Source"] == "disk"
                assert r.headers["X-Cache"] == "partial"
                assert cached == listed[sid]["transcript_tokens"] - 1
            else:  # its turns recomputed; only what it shares with the first session (system prompt) is reused
                assert r.headers["X-Cache-Source"] in ("device", "none")
                assert cached < listed[sid]["transcript_tokens"] - 8
            assert session(again.base, sid)["turns"] == turns[sid] + 1
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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_more_signals_while_draining_end_the_drain_at_once_and_the_shutdown_still_runs(model_dir, tmp_path, sig):
    """A supervisor's second SIGTERM, or Ctrl-C pressed three times: the running request is ended without waiting
    for the grace period (an hour here: nothing else could end the drain), and the app's shutdown still runs, the
    engine stopped and the session's K/V written. Never uvicorn's force-exit, which skips the app's shutdown and
    leaves the engine's thread running in torch into the interpreter's exit."""
    env = {
        "KVSERVE_SHUTDOWN_GRACE_S": "3600",
        "KVSERVE_KV_BUDGET_BYTES": str(pool_bytes(model_dir, POOL_TOKENS)),
        "KVSERVE_MAX_TOKENS_LIMIT": str(HELD_TOKENS),
        "KVSERVE_MAX_UNREAD_EVENTS": str(2 * HELD_TOKENS),
        "KVSERVE_REQUEST_TIMEOUT_S": "36000",
    }
    server = Server(model_dir, tmp_path / "state", tmp_path / "log.txt", env, max_context=2 * POOL_TOKENS)
    two_turns(server.base, "kept")
    lines: list[str] = []
    held = stream_in_thread(server.base, streamed([{"role": "user", "content": "Tell"}], HELD_TOKENS), lines)
    wait_until(lambda: lines, what="the held stream to start")
    server.proc.send_signal(sig)
    wait_until(lambda: "draining: 1 requests still running" in server.log_path.read_text(), what="the drain")
    server.proc.send_signal(sig)  # each sent once the one before was seen: the kernel merges signals pending at once
    wait_until(lambda: "Waiting for connections to close" in server.log_path.read_text(), what="uvicorn to stop")
    server.proc.send_signal(sig)
    assert server.proc.wait(DEADLINE_S) == 0
    held.join(DEADLINE_S)
    assert not held.is_alive(), "the held stream did not end"
    server.log.close()
    log = server.log_path.read_text()
    assert "Application shutdown complete" in log
    assert "the K/V of 1 sessions" in log
    assert "terminate called" not in log

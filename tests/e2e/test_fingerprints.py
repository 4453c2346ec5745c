"""Replicas that serve one model id with other weights share no K/V, and say so (a real redis-server, real
replicas). b's weights differ from a's in one layer's k_proj only (a fine-tune deployed under the old id, a
rolling upgrade half done): a session moving between them is recomputed on each, never restored from the
other's blocks, and every answer equals that replica's own answer with every cache bypassed; b's log warns,
and GET /v1/models/model on each shows its own fingerprint and the other's. c, with a's weights, is the
control: it does restore a's blocks from Redis.
"""

from __future__ import annotations

import logging
import shutil
import signal
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from server.kv.fingerprints import FingerprintBoard
from server.kv.redis_blocks import RedisBlocks
from server.models.digest import DIGEST_FILE
from tests.e2e.cluster import CHAT, Redis, replica
from tests.e2e.server import Server, _kill_leftovers  # noqa: F401 - the fixture is autouse
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e
SYSTEM = "You are a careful assistant. " * 12  # several blocks of 16 tokens before the first question
QUESTIONS = ["Hello there", "Tell me more", "And then?", "Why?"]
# The history's replies are the client's (not the random model's bytes, whose text does not tokenize back into
# the ids it sampled), so a cache-bypassed request holds exactly the ids of the session's turn.
REPLY = "Sure, here it is."


def other_k_proj(model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the model whose last layer's k_proj is drawn anew, in a directory also named "model": served
    under the same id."""
    target = tmp_path / "tuned" / "model"
    shutil.copytree(model_dir, target)
    (target / DIGEST_FILE).unlink(missing_ok=True)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64)
    torch.manual_seed(1)
    with torch.no_grad():
        model.model.layers[-1].self_attn.k_proj.weight.normal_(0.0, 0.2)
    model.save_pretrained(target)
    return target


def chat(base: str, history: list[dict], sid: str | None = None) -> httpx.Response:
    body = {"model": "model", "messages": [{"role": "system", "content": SYSTEM}, *history], "max_tokens": 8}
    body |= {"temperature": 0, "ignore_eos": True} | ({} if sid else {"cache_prompt": False})
    r = httpx.post(base + CHAT, json=body, headers={"X-Session-ID": sid} if sid else {}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def content(r: httpx.Response) -> str:
    return str(r.json()["choices"][0]["message"]["content"])


def cached(r: httpx.Response) -> int:
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def shared_blocks(base: str) -> dict[str, float]:
    """kvserve:kv_store_blocks_total of the shared tier, by outcome (queued, written, skipped, ...)."""
    counts = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith('kvserve:kv_store_blocks_total{outcome="') and 'tier="shared"' in line:
            counts[line.split('"')[1]] = float(line.split()[-1])
    return counts


def shared_writer_done(base: str) -> bool:
    """Every block this replica handed to its shared-store writer (before its answer) was written or found there
    already."""
    counts = shared_blocks(base)
    return counts["written"] + counts["skipped"] == counts["queued"]


def model_object(server: Server) -> dict:
    r = httpx.get(server.base + "/v1/models/model")
    assert r.status_code == 200, r.text
    return dict(r.json())


def peers(server: Server) -> dict[str, dict]:
    return {peer["replica"]: peer for peer in model_object(server)["other_replicas"]}


def converse(servers: list[tuple[str, Server]], sid: str) -> list[tuple[str, Server, httpx.Response]]:
    """Turn i of session `sid` on the i-th (name, replica), each once its predecessor's blocks are in Redis."""
    history: list[dict] = []
    turns = []
    for (name, server), question in zip(servers, QUESTIONS, strict=False):
        history.append({"role": "user", "content": question})
        r = chat(server.base, history, sid)
        assert r.headers["x-kvserve-replica"] == name
        turns.append((name, server, r))
        history.append({"role": "assistant", "content": REPLY})
        wait_until(lambda s=server: shared_writer_done(s.base), 60, f"{name}'s blocks to reach Redis")
    return turns


@pytest.mark.timeout(600)  # three servers; every wait below has its own deadline
def test_replicas_with_other_weights_under_one_id_share_no_kv_and_say_so(model_dir, tmp_path):
    store = Redis(tmp_path)
    a = replica(model_dir, tmp_path, "a", store.url)
    b = replica(other_k_proj(model_dir, tmp_path), tmp_path, "b", store.url)
    c = replica(model_dir, tmp_path, "c", store.url)  # a's weights

    # One conversation moving between a and b at every turn: never restored from the other's blocks, and each
    # answer is that replica's own, computed with every cache bypassed.
    turns = converse([("a", a), ("b", b), ("a", a), ("b", b)], "moving")
    history: list[dict] = []
    for (name, server, r), question in zip(turns, QUESTIONS, strict=True):
        history.append({"role": "user", "content": question})
        assert r.headers["x-cache-source"] != "shared", (name, r.headers["x-cache-source"], cached(r))
        assert content(r) == content(chat(server.base, history)), f"turn {len(history) // 2 + 1} on {name}"
        history.append({"role": "assistant", "content": REPLY})
    b_turn = turns[1][2]
    assert cached(b_turn) == 0  # b never saw this prompt: nothing of a's was taken
    # The two models do answer differently here, so an answer from a's K/V would have shown.
    assert content(chat(a.base, history[:3])) != content(chat(b.base, history[:3]))

    # The control: c has a's weights, and restores the blocks a wrote.
    control = converse([("a", a), ("a", a), ("c", c)], "control")[2][2]
    assert control.headers["x-cache-source"] == "shared"
    assert cached(control) > 0

    # Each says which fingerprint it serves the id with, and sees the others'.
    mine = {name: model_object(server) for name, server in {"a": a, "b": b, "c": c}.items()}
    assert mine["a"]["kv_fingerprint"] == mine["c"]["kv_fingerprint"] != mine["b"]["kv_fingerprint"]
    assert mine["a"]["weights_digest"] != mine["b"]["weights_digest"]
    for part in ("kv_layout", "config_digest", "tokenizer_digest"):
        assert mine["a"][part] == mine["b"][part], part
    wait_until(lambda: set(peers(a)) == {"b", "c"}, 60, "a to see b and c")  # each looks every few seconds
    wait_until(lambda: set(peers(b)) == {"a", "c"}, 60, "b to see a and c")
    assert peers(a)["b"] == {
        "replica": "b",
        "kv_fingerprint": mine["b"]["kv_fingerprint"],
        "shares_kv_blocks": False,
        "differs_in": ["weights"],
    }
    assert peers(a)["c"]["shares_kv_blocks"] is True
    assert peers(a)["c"]["differs_in"] == []
    assert {name: peer["shares_kv_blocks"] for name, peer in peers(b).items()} == {"a": False, "c": False}
    assert peers(b)["a"]["kv_fingerprint"] == mine["a"]["kv_fingerprint"]

    # b warned at its start; a and c at their next look at the store after b came. c never warns about a.
    warning = "replica {} serves it with another K/V fingerprint"
    assert warning.format("a") in b.log_path.read_text()
    assert "share no K/V blocks" in b.log_path.read_text()
    for server in (a, c):
        wait_until(lambda s=server: warning.format("b") in s.log_path.read_text(), 60, f"{server.base} to warn")
    assert warning.format("a") not in c.log_path.read_text()

    # A replica that stops is no longer listed.
    assert c.stop(signal.SIGTERM) == 0
    wait_until(lambda: set(peers(a)) == {"b"}, 60, "a to see that c stopped")


def test_replicas_see_each_others_fingerprints_until_they_go(tmp_path, caplog):
    """Boards over one real Redis, refreshed every 50 ms and gone after 500 ms without a refresh."""
    server = Redis(tmp_path)
    clients = [RedisBlocks(server.url) for _ in range(3)]
    ours = {"kv_fingerprint": "f1", "kv_layout": "layers=2", "weights_digest": "w1"}
    ours |= {"config_digest": "c1", "tokenizer_digest": "t1"}
    a, b, c = (
        FingerprintBoard(client.client, client.errors, name, period_s=0.05, ttl_s=0.5)
        for client, name in zip(clients, "abc", strict=True)
    )
    a.announce("m", ours)
    b.announce("m", ours)
    wait_until(
        lambda: a.peers("m") == [{"replica": "b", "kv_fingerprint": "f1", "shares_kv_blocks": True, "differs_in": []}]
    )
    assert "another K/V fingerprint" not in caplog.text

    with caplog.at_level(logging.WARNING, logger="kvserve.shared"):
        c.announce("m", ours | {"kv_fingerprint": "f2", "kv_layout": "layers=2,dtype=bfloat16"})
        wait_until(lambda: [p["replica"] for p in a.peers("m")] == ["b", "c"], what="a to see c")
        wait_until(lambda: len(b.peers("m")) == 2, what="b to see c")
        wait_until(lambda: len(c.peers("m")) == 2, what="c to see a and b")
        a._stop.wait(0.3)  # several more rounds: each difference is said once
    said = [r.getMessage() for r in caplog.records if "another K/V fingerprint" in r.getMessage()]
    assert sorted(message.split()[3] for message in said) == ["a", "b", "c", "c"]  # c of a and b; a, b of c
    about_c = [message for message in said if message.startswith("model m: replica c ")]
    assert len(about_c) == 2  # a's and b's
    assert all("they differ in layout (layers=2 here, layers=2,dtype=bfloat16 there)" in m for m in about_c)
    assert all("pin the dtype" in message for message in said)
    assert a.peers("m")[1]["differs_in"] == ["layout"]

    b.close()  # a clean stop takes its entry out at once
    assert not server.client.exists("kvserve:fp:b:m")
    assert server.client.smembers("kvserve:fps:m") == {b"a", b"c"}
    wait_until(lambda: [p["replica"] for p in a.peers("m")] == ["c"], what="a to see that b left")
    c._stop.set()  # c dies: it no longer refreshes, and its entry expires
    wait_until(lambda: a.peers("m") == [], what="c's entry to expire")
    assert server.client.smembers("kvserve:fps:m") == {b"a"}
    a.close()
    for client in clients:
        client.close()

"""Whether two replicas share K/V blocks is a matter of what they store in Redis: the form their shared tier keeps
the K/V in (and the block size), not the pool's K/V fingerprint. Three model hosts over one real redis-server on
loopback serve the tiny model: `a` as is, `b` keeping its shared blocks in int8 (KVSERVE_SHARED_KV_DTYPE), `c` with
an int8 pool whose shared tier keeps the pool's form. a and b compute the same K/V but never find each other's
blocks; b and c compute it in other forms, yet store the same int8 blocks under the same addresses."""

from __future__ import annotations

import dataclasses

import pytest

from server.hosting import ModelHost
from server.http.routes.models import model_object
from server.kv.block_store import addresses
from server.settings import Settings
from tests.e2e.redis_server import Redis
from tests.helpers import DEADLINE_S, run, settled, wait_until

BLOCK = 4


@pytest.fixture
def hosts(tiny_spec, tmp_path):
    redis = Redis(tmp_path)
    spec = dataclasses.replace(tiny_spec, id="m")
    made: dict[str, ModelHost] = {}
    try:
        for name, env in (("a", {}), ("b", {"shared_kv_dtype": "int8"}), ("c", {"kv_dtype": "int8"})):
            settings = Settings(
                replica_id=name, shared_url=redis.url, state_dir=None, block_size=BLOCK, kv_budget_bytes=1 << 20, **env
            )
            host = ModelHost(settings, [spec])
            assert host.fingerprints is not None
            host.fingerprints.period_s = 0.05  # each looks at the others' entries every 50 ms, not every 5 s
            made[name] = host
            host.start()
            host.wait_loaded(DEADLINE_S)  # one at a time: transformers sets torch's default dtype while it loads
            assert host.states["m"].status == "ready", host.states["m"].detail
        yield made
    finally:
        for host in made.values():
            host.close()
        redis.stop()


def peers(host: ModelHost) -> dict[str, dict]:
    return {peer["replica"]: peer for peer in model_object(host, "m")["other_replicas"]}


def test_replicas_share_blocks_where_their_shared_tiers_store_them_alike(hosts, caplog):
    for name, host in hosts.items():
        wait_until(lambda h=host: len(peers(h)) == 2, what=f"{name} to see the two others")
    a, b, c = (model_object(hosts[name], "m") for name in "abc")
    assert a["kv_fingerprint"] == b["kv_fingerprint"] != c["kv_fingerprint"]  # a and b compute the same K/V
    assert a["shared_kv_fingerprint"] != b["shared_kv_fingerprint"] == c["shared_kv_fingerprint"]  # b and c store it

    # a and b: the same K/V fingerprint, but b's blocks in Redis are int8 under other addresses
    assert peers(hosts["a"])["b"] == {
        "replica": "b",
        "kv_fingerprint": b["kv_fingerprint"],
        "shares_kv_blocks": False,
        "differs_in": ["shared layout"],
    }
    assert peers(hosts["b"])["a"]["shares_kv_blocks"] is False
    # b and c: other K/V fingerprints (c's pool is int8), the same blocks in Redis
    assert peers(hosts["b"])["c"] == {
        "replica": "c",
        "kv_fingerprint": c["kv_fingerprint"],
        "shares_kv_blocks": True,
        "differs_in": ["layout"],
    }
    assert peers(hosts["c"])["b"]["shares_kv_blocks"] is True
    assert peers(hosts["a"])["c"]["shares_kv_blocks"] is False
    assert peers(hosts["a"])["c"]["differs_in"] == ["layout", "shared layout"]

    # what the flag stands for: the addresses each one's blocks are written and read under (Offloader.share)
    engines = {name: host.engines["m"] for name, host in hosts.items()}
    names = {n: addresses(e.offloader.shared_fingerprint, BLOCK, "t", list(range(8))) for n, e in engines.items()}
    assert names["b"] == names["c"] != names["a"]

    # each difference said once by each side; b and c, which share, say nothing of each other
    records = caplog.get_records("setup") + caplog.get_records("call")  # some as they started, some since
    warned = [r.getMessage() for r in records if r.getMessage().startswith("model m: replica ")]
    said = sorted(" ".join(m.split()[3:8]) for m in warned)
    assert said == [
        "a computes the same K/V",  # by b
        "a serves it with another",  # by c
        "b computes the same K/V",  # by a
        "c serves it with another",  # by a
    ]
    about_b = next(m for m in warned if "replica b computes the same K/V" in m)
    assert "they differ in shared layout (layers=2,kv_heads=2,head_dim=16,dtype=float64 here, " in about_b
    assert "KVSERVE_SHARED_KV_DTYPE" in about_b


async def test_what_the_replicas_are_told_is_what_restores(hosts):
    """A session moving b -> c -> a: c restores b's blocks from Redis (they share), a restores none of them."""
    tokenizer = hosts["a"].engines["m"].loaded.tokenizer
    prompt = tokenizer("The quick brown fox jumps over the lazy dog. Sessions keep their cache.")["input_ids"]
    more = tokenizer(" Hello world")["input_ids"]
    transcript = prompt
    turns = {}
    for name in "bca":
        engine = hosts[name].engines["m"]
        turns[name] = result = await run(engine, transcript, session="s", max_tokens=4, ignore_eos=True)
        assert result.error is None, result.error
        transcript = transcript + result.token_ids + more
        assert hosts[name].tiers.shared is not None
        await settled(engine)  # the turn's blocks are handed to the writer between steps, after the client hears
        hosts[name].tiers.shared.flush()  # the turn's full blocks, in Redis
    assert (turns["c"].admitted.source, turns["c"].admitted.num_cached > 0) == ("shared", True)
    assert (turns["a"].admitted.source, turns["a"].admitted.num_cached) == ("none", 0)

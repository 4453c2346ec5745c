"""Side-stream copies between the device and host memory (server/kv/transfers.py): the order of the device calls,
checked with a recording stand-in for CUDA's, and a session's K/V down to host RAM and back through them."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

import torch

from server.kv.tiers import TierStore
from server.kv.transfers import Transfers, transfers_for
from server.sessions.record import SessionKey
from tests.helpers import make_engine, reference_greedy, run, tiers_below, wait_until_async

CPU = torch.device("cpu")


class Event(str):
    """A side-stream event: its name (event-1, event-2, ... in the order they were recorded), and a wait that logs
    which thread waited for which event."""

    def __new__(cls, log: list[str], name: str) -> Event:
        event = super().__new__(cls, name)
        event.log = log
        return event

    def synchronize(self) -> None:
        self.log.append(f"waited on {threading.current_thread().name} for {self}")


class Recording:
    """CUDA's calls as a log; tensors stay on the CPU."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.on_side_now = False
        self.made: dict[str, set[int]] = {"pinned": set(), "device": set()}  # storages it handed out, by kind
        self.num_events = 0

    def _made(self, kind: str, tensor):
        self.made[kind].add(tensor.untyped_storage().data_ptr())
        return tensor

    def is_(self, kind: str, tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self.made[kind]

    def side_waits_for_compute(self) -> None:
        self.log.append("side waits for compute")

    @contextmanager
    def on_side(self):
        self.log.append("side {")
        self.on_side_now = True
        yield
        self.on_side_now = False
        self.log.append("}")

    def pinned_like(self, tensor):
        self.log.append("pinned" + ("" if self.on_side_now else " (off the side stream)"))
        return self._made("pinned", torch.empty_like(tensor))

    def empty_on_device(self, tensor):
        self.log.append("device tensor")
        return self._made("device", torch.empty_like(tensor))

    def keep_for_side(self, tensor) -> None:
        self.log.append("kept for side")

    def keep_for_compute(self, tensor) -> None:
        self.log.append("kept for compute")

    def side_done(self):
        self.num_events += 1
        self.log.append(f"event-{self.num_events}")
        return Event(self.log, f"event-{self.num_events}")

    def compute_waits(self, event) -> None:
        self.log.append(f"compute waits for {event}")


def test_down_copies_wait_for_the_gather_and_run_on_the_side_stream():
    ops = Recording()
    tensors = [torch.randn(2, 3), torch.randn(2, 3)]
    hosts, event = Transfers(ops).to_host(tensors)
    assert ops.log == ["side waits for compute", "side {", "pinned", "kept for side", "pinned", "kept for side", "}",
                       "event-1"]  # fmt: skip
    assert event == "event-1"
    assert all(torch.equal(h, t) and h is not t for h, t in zip(hosts, tensors, strict=True))


def test_up_copies_are_staged_pinned_and_the_compute_stream_waits_for_them():
    ops = Recording()
    transfers = Transfers(ops)
    tensors = [torch.randn(4), torch.randn(4)]
    on_device, staged, event = transfers.to_device(tensors)
    assert ops.log == ["side {", "pinned", "device tensor", "pinned", "device tensor", "}", "event-1"]
    assert all(torch.equal(d, t) for d, t in zip(on_device, tensors, strict=True))
    assert len(staged) == 2  # kept alive until the copy's event
    ops.log.clear()
    transfers.use_on_compute(event, on_device)
    assert ops.log == ["compute waits for event-1", "kept for compute", "kept for compute"]


def test_without_a_device_nothing_is_copied():
    transfers = transfers_for(CPU)
    assert transfers.ops is None
    tensors = [torch.randn(3)]
    assert transfers.to_host(tensors) == (tensors, None)
    assert transfers.to_device(tensors) == (tensors, [], None)


async def test_a_session_goes_down_to_host_ram_and_back_through_the_side_stream(tiny, monkeypatch):
    """Its K/V is gathered, copied down (side stream), evicted, read back by the loader thread, which waits for the
    copy down still in flight before it copies the K/V up (side stream); the compute stream waits for that copy
    before the pool is written; the turn is HF's."""
    ops = Recording()
    tiers = TierStore(1 << 30, 0, None, block_size=4)
    engine = make_engine(tiny, tiers=tiers, budget_bytes=4 << 20, block_size=4)
    pool = engine.runner.pool
    pool.transfers = Transfers(ops)
    scatter = pool.scatter

    def spy(slots, k, v, *rest):
        ops.log.append("pool written")
        assert all(ops.is_("device", t) for t in k + v), "the restore wrote host tensors, not the device copies"
        return scatter(slots, k, v, *rest)

    monkeypatch.setattr(pool, "scatter", spy)
    try:
        prompt = tiny.tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
        first = await run(engine, prompt, session="a", max_tokens=4, ignore_eos=True)
        transcript = prompt + first.token_ids
        key = SessionKey("default", "a")
        snapshot = await engine.query(lambda: engine.offloader.gather(key, transcript))
        assert snapshot.ready == "event-1"
        assert all(ops.is_("pinned", t) for t in snapshot.k + snapshot.v)  # the host copies, not the gathered
        tiers.put(snapshot)
        await engine.query(lambda: engine.blocks.discard(engine.blocks.chain(key.tenant, transcript)[0]))
        down = list(ops.log)
        ops.log.clear()
        turn2 = transcript + tiny.tokenizer(" Hello")["input_ids"]
        second = await asyncio.wait_for(run(engine, turn2, session="a", max_tokens=4, ignore_eos=True), 120)
    finally:
        engine.stop()
        tiers.close()
    assert down[0] == "side waits for compute"
    assert down[-1] == "event-1"
    assert second.admitted.source == "host"
    assert second.token_ids == reference_greedy(tiny.model, turn2, 4)
    up = ops.log
    waits = [e for e in up if e.startswith("waited on")]
    assert len(waits) == 1, up
    assert waits[0].startswith("waited on kv-loader-"), up  # off the engine thread
    assert waits[0].endswith(" for event-1"), up  # the copy down, never waited for until now
    order = [waits[0], "side {", "event-2", "compute waits for event-2", "pool written"]
    assert [up.index(e) for e in order] == sorted(up.index(e) for e in order), up
    assert "pinned (off the side stream)" not in ops.log


async def test_a_turn_shared_with_redis_is_copied_down_on_the_side_stream(tiny, tmp_path):
    """Its full blocks are gathered on the compute stream and copied down on the side stream; the writer thread,
    not the engine thread, waits for that copy before encoding the blocks for Redis."""
    ops = Recording()
    with tiers_below("shared", tmp_path, 4) as tiers:
        engine = make_engine(tiny, tiers=tiers, budget_bytes=4 << 20, block_size=4)
        engine.runner.pool.transfers = Transfers(ops)
        try:
            prompt = tiny.tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
            result = await run(engine, prompt, session="a", max_tokens=4, ignore_eos=True)
            assert result.error is None
            await wait_until_async(lambda: any(e.startswith("waited on") for e in ops.log), what="the writer's wait")
            await wait_until_async(lambda: tiers.shared.stats.num_written > 0, what="the blocks in Redis")
        finally:
            engine.stop()
    waited = next(e for e in ops.log if e.startswith("waited on"))
    assert not waited.startswith("waited on engine-"), waited
    assert waited.endswith(" for event-1"), waited
    assert ops.log.index("side waits for compute") < ops.log.index("event-1") < ops.log.index(waited)

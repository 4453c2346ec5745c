"""Decode steps over static tensors (server/engine/decode_graphs.py): what a CUDA graph replays, run eagerly here
(the Triton kernels in triton's interpreter). The capture itself needs CUDA: tests/engine/test_cuda.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from server.engine import model_runner
from server.engine.decode_graphs import BUCKETS, StaticDecode, bucket_of, buckets_for
from server.engine.model_runner import static_decode_graphs
from server.engine.scheduler import Row
from server.models.loader import load_model
from server.startup import Startup, StartupStopped
from tests.helpers import make_engine, reference_greedy, run


@pytest.fixture(scope="module")
def tiny32(tiny_spec):
    return load_model(dataclasses.replace(tiny_spec, dtype="float32", max_context=256), Path("unused"))


def words(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


def test_buckets():
    assert buckets_for(256) == BUCKETS
    assert buckets_for(12) == (1, 2, 4, 8)
    assert buckets_for(8) == (1, 2, 4, 8)
    assert buckets_for(64) == BUCKETS
    assert buckets_for(0) == (1,)
    assert [bucket_of(n, (1, 2, 4, 8)) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]


async def test_decode_steps_from_static_tensors_answer_as_eager_steps(tiny32):
    """Three conversations decoding at once take the 4-row bucket (one padding row), a lone one the 1-row bucket;
    more rows than the largest bucket, and prefill steps, run eagerly; every answer is HF's."""
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, attention="triton")
    runner = engine.runner
    assert runner.graphs is None  # a CPU: nothing captured
    assert runner.graphs_detail == "CUDA only, with the Triton backend"
    graphs = static_decode_graphs(runner, tiny32, (1, 4))
    assert [s.max_blocks for s in graphs.statics] == [64, 64]  # 256 keys in blocks of 4
    used: list[int] = []
    load = graphs.statics[1].load

    def spy(rows, slot_ids):
        used.append(len(rows))
        load(rows, slot_ids)

    graphs.statics[1].load = spy  # type: ignore[method-assign]
    runner.graphs = graphs
    try:
        prompts = [words(tiny32, t) for t in ("The quick brown fox", "Paris is the capital", "Hello world, hello")]
        results = await asyncio.gather(
            *(run(engine, p, rid=f"r{i}", max_tokens=6, ignore_eos=True) for i, p in enumerate(prompts))
        )
        for prompt, result in zip(prompts, results, strict=True):
            assert result.token_ids == reference_greedy(tiny32.model, prompt, 6)
        assert 3 in used  # three rows in the 4-row bucket
        lone = await run(engine, prompts[0], session="s", max_tokens=5, ignore_eos=True)
        follow = prompts[0] + lone.token_ids + words(tiny32, " jumps")
        second = await run(engine, follow, session="s", max_tokens=5, ignore_eos=True)
        assert second.token_ids == reference_greedy(tiny32.model, follow, 5)
        replays = graphs.stats.num_replays
        five = [words(tiny32, f"Numbers {i} and symbols") for i in range(5)]
        await asyncio.gather(*(run(engine, p, rid=f"f{i}", max_tokens=3, ignore_eos=True) for i, p in enumerate(five)))
    finally:
        engine.stop()
    assert replays >= 5 + 4 + 4  # the decode steps above (a turn's first token comes from its prefill)
    assert graphs.stats.num_eager > 0  # five rows: more than the largest bucket


def test_a_padded_step_writes_its_rows_slots_only_and_answers_as_the_eager_step(tiny32):
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, attention="triton")
    engine.stop()
    runner = engine.runner
    graphs = static_decode_graphs(runner, tiny32, (4,))
    generator = torch.Generator().manual_seed(0)
    for t in runner.pool.k + runner.pool.v:
        t.copy_(torch.randn(t.shape, generator=generator))
    before = [t.clone() for t in runner.pool.k + runner.pool.v]
    blocks = [SimpleNamespace(block_id=5), SimpleNamespace(block_id=9)]
    seq = SimpleNamespace(blocks=blocks, num_computed=6, is_prefilled=True)
    row = Row(seq, [17], True)  # type: ignore[arg-type]
    logits = graphs.run([row])
    static = graphs.statics[0]
    assert static.slots.tolist() == [9 * 4 + 2, -1, -1, -1]  # position 6: block 9, offset 2
    assert static.lens.tolist() == [7, 0, 0, 0]
    for t, b in zip(runner.pool.k + runner.pool.v, before, strict=True):
        assert (t != b).any(-1).any(0).nonzero().flatten().tolist() == [38]  # that slot, nothing else
    after = [t.clone() for t in runner.pool.k + runner.pool.v]
    for t, b in zip(runner.pool.k + runner.pool.v, before, strict=True):
        t.copy_(b)
    runner.graphs = None
    eager = runner.run([row])
    # the same K/V written (up to the linear layers' rounding at 1 row against 4)
    assert all(torch.allclose(t, a, atol=1e-5) for t, a in zip(runner.pool.k + runner.pool.v, after, strict=True))
    assert logits is not None
    assert logits.shape == eager.shape == (1, tiny32.vocab_size)
    assert torch.allclose(logits, eager, atol=1e-4)


def test_a_row_longer_than_the_graphs_hold_runs_eagerly(tiny32):
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, attention="triton")
    engine.stop()
    graphs = static_decode_graphs(engine.runner, tiny32, (2,))
    static = graphs.statics[0]
    assert (static.max_keys, static.max_blocks) == (256, 64)  # the model's context (under GRAPH_MAX_KEYS)

    def row(num_blocks: int, position: int) -> Row:
        seq = SimpleNamespace(blocks=[SimpleNamespace(block_id=0)] * num_blocks, num_computed=position)
        return Row(seq, [3], True)  # type: ignore[arg-type]

    assert graphs.run([row(65, 5)]) is None  # more blocks than the static tables hold
    assert graphs.run([row(64, 256)]) is None  # its 257th key: more than the workspace's splits hold
    assert graphs.stats.num_eager == 2
    assert graphs.run([row(2, 5)]) is not None
    assert graphs.run([row(64, 255)]) is not None  # the last key a captured step holds
    assert graphs.stats.num_replays == 2
    unsampled = Row(row(2, 5).seq, [3], False)  # a prompt's one-token chunk that yields no token: not a decode row
    assert graphs.run([unsampled]) is None
    assert graphs.run([row(2, 5), Row(row(2, 5).seq, [3, 4], True)]) is None  # a prefill chunk beside it


def test_the_graphs_hold_rows_up_to_a_key_limit_and_their_tables_round_up(tiny32, monkeypatch):
    monkeypatch.setattr(model_runner, "GRAPH_MAX_KEYS", 64)
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=3, attention="triton")
    engine.stop()
    static = static_decode_graphs(engine.runner, tiny32, (1,)).statics[0]
    assert (static.max_keys, static.max_blocks) == (64, 22)  # 64 keys in blocks of 3: 22 blocks
    monkeypatch.setattr(model_runner, "GRAPH_MAX_KEYS", 16384)
    static = static_decode_graphs(engine.runner, tiny32, (1,)).statics[0]
    assert (static.max_keys, static.max_blocks) == (256, 86)  # the model's context, under the limit


def test_a_replayed_step_is_the_runner_s_step_and_its_logits_outlive_the_next_replay(tiny32, monkeypatch):
    """A step the graphs serve is counted once and never also run eagerly; the logits it returns are its own copy
    (a captured graph writes every replay's into one tensor)."""
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, attention="triton")
    engine.stop()
    runner = engine.runner
    graphs = static_decode_graphs(runner, tiny32, (4,))
    static = graphs.statics[0]
    static.forward()  # as a capture leaves it: one output tensor, written by each replay

    def replay() -> None:  # what a replay does to the graph's output: writes it in place
        with torch.inference_mode():
            static.logits.add_(1.0)

    graphs.graphs[4] = SimpleNamespace(replay=replay)
    runner.graphs = graphs
    monkeypatch.setattr(runner, "_prepare", lambda rows: pytest.fail("a replayed step was also prepared eagerly"))
    blocks = [SimpleNamespace(block_id=5), SimpleNamespace(block_id=9)]
    row = Row(SimpleNamespace(blocks=blocks, num_computed=6, is_prefilled=True), [17], True)  # type: ignore[arg-type]
    forwards, decoded = runner.counter.num_forwards, runner.counter.num_decode_tokens
    first = runner.run([row])
    kept = first.clone()
    runner.run([row])
    assert torch.equal(first, kept)
    assert (runner.counter.num_forwards, runner.counter.num_decode_tokens) == (forwards + 2, decoded + 2)


def test_every_step_passes_transformers_a_4d_mask_it_keeps_as_it_is(tiny32, monkeypatch):
    """Eager and static steps alike: transformers builds no mask and never checks the positions for packed
    sequences (a device sync each step, which a CUDA graph's capture refuses)."""
    import transformers.masking_utils as masking

    def refuse(*args, **kwargs):
        raise AssertionError("a step made transformers look for packed sequences")

    monkeypatch.setattr(masking, "find_packed_sequence_indices", refuse)
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, attention="triton")
    engine.stop()
    runner = engine.runner
    blocks = [SimpleNamespace(block_id=5), SimpleNamespace(block_id=9)]
    seq = SimpleNamespace(blocks=blocks, num_computed=5, is_prefilled=False)
    runner.run([Row(seq, [4, 9], True)])  # type: ignore[arg-type]  # eager: a two-token chunk
    runner.graphs = static_decode_graphs(runner, tiny32, (2,))
    seq.num_computed, seq.is_prefilled = 7, True
    runner.run([Row(seq, [17], True)])  # type: ignore[arg-type]  # the static step
    assert runner.graphs.stats.num_replays == 1


class StandIn:
    """What a capture asks of CUDA, stood in for on a CPU: every forward runs eagerly; the calls are recorded in
    order. `stop_during`: the bucket whose recording asks start-up to stop (a signal arriving meanwhile);
    `fail_during`: the one whose recording raises (a capture CUDA refuses)."""

    def __init__(self, startup: Startup, stop_during: int | None = None, fail_during: int | None = None) -> None:
        self.startup, self.stop_during, self.fail_during = startup, stop_during, fail_during
        self.calls: list[object] = []

    @contextlib.contextmanager
    def side_stream(self):
        self.calls.append("side stream")
        yield
        self.calls.append("default stream")

    def record(self, forward):
        size = forward.__self__.size
        self.calls.append(("record", size))
        if size == self.fail_during:
            raise RuntimeError("operation not permitted when stream is capturing")
        forward()
        if size == self.stop_during:
            self.startup.stop()
        return SimpleNamespace(replay=forward)

    def synchronize(self):
        self.calls.append("synchronize")


def test_a_capture_warms_every_bucket_up_on_a_side_stream_then_records_them_largest_first(tiny32, monkeypatch):
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, attention="triton")
    engine.stop()
    graphs = static_decode_graphs(engine.runner, tiny32, (1, 2, 4))
    ran: list[int] = []
    forward = StaticDecode.forward

    def counted(static: StaticDecode) -> None:
        ran.append(static.size)
        forward(static)

    monkeypatch.setattr(StaticDecode, "forward", counted)
    recorder = StandIn(Startup())
    graphs.capture(recorder)
    assert ran == [4, 2, 1] * 2  # the warm-ups, then each forward once more under its recording
    assert recorder.calls == ["side stream", "default stream", ("record", 4), ("record", 2), ("record", 1),
                              "synchronize"]  # fmt: skip
    assert sorted(graphs.graphs) == [1, 2, 4]


def test_a_stop_asked_during_the_capture_ends_it_between_two_buckets_never_inside_one(tiny32):
    """Start-up is stopped while bucket 4 is recorded: that recording completes, bucket 2's never starts, and the
    runner lets StartupStopped through (no "capture failed, every step eager": the model is not served at all)."""
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, attention="triton")
    engine.stop()
    runner = engine.runner
    startup = Startup()
    recorder = StandIn(startup, stop_during=4)
    with pytest.raises(StartupStopped):
        runner._capture(tiny32, 4, startup, recorder)
    assert recorder.calls == ["side stream", "default stream", ("record", 4)]
    assert runner.graphs is not None
    assert sorted(runner.graphs.graphs) == [4]
    assert startup.phase == "capture"


def test_a_capture_that_fails_leaves_every_step_eager_and_says_why(tiny32):
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, attention="triton")
    engine.stop()
    runner = engine.runner
    runner._capture(tiny32, 4, Startup(), StandIn(Startup(), fail_during=2))
    assert runner.graphs is None
    assert runner.graphs_detail == (
        "capture failed, every step eager: RuntimeError: operation not permitted when stream is capturing"
    )

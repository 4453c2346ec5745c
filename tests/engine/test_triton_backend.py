"""The engine through the Triton backend (the GPU's kernels; here in triton's interpreter on CPU tensors): its
plan of a step, chunked prompts beside decode rows, 8-bit pools, deterministic mode, and asking for a backend."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from server import kv
from server.engine import model_runner
from server.engine.scheduler import Row
from server.kv import kernels, triton_attention
from server.kv.attention import stepping
from server.kv.backends import StepRow
from server.models.loader import load_model
from server.models.packed_linear import batch_invariance, linear_invariance, pad_rows
from tests.helpers import make_engine, reference_greedy, run


@pytest.fixture(scope="module")
def tiny32(tiny_spec):
    return load_model(dataclasses.replace(tiny_spec, dtype="float32"), Path("unused"))


def words(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


async def test_chunked_prompts_beside_decode_rows_and_a_continued_turn_match_hf(tiny32, monkeypatch):
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, max_batch_tokens=12, attention="triton")
    backend = engine.runner.backend
    assert backend.name == "triton"
    assert not backend.every_token
    mixed: list[tuple[int, int]] = []  # steps holding both: (chunks, decode rows)
    prepare = engine.runner._prepare

    def spy(rows: list[Row]):
        meta, *rest = prepare(rows)
        if meta.prefill is not None and meta.decode is not None:
            mixed.append((meta.prefill.q_starts.numel(), meta.decode.rows.numel()))
        return (meta, *rest)

    monkeypatch.setattr(engine.runner, "_prepare", spy)
    try:
        short = words(tiny32, "Paris is")
        long = words(tiny32, "Numbers, symbols and emoji appear in text; " * 4)
        assert len(long) > 3 * 12  # chunks of the long prompt's prefill follow the short one's first decode steps
        first, other = await asyncio.gather(
            run(engine, short, session="s", max_tokens=12, ignore_eos=True),
            run(engine, long, rid="o", max_tokens=4, ignore_eos=True),
        )
        assert first.token_ids == reference_greedy(tiny32.model, short, 12)
        assert other.token_ids == reference_greedy(tiny32.model, long, 4)
        follow = short + first.token_ids + words(tiny32, " Hello world")
        second = await run(engine, follow, session="s", max_tokens=5, ignore_eos=True)
        assert second.usage.cached_tokens == len(short) + 12 - 1
        assert second.token_ids == reference_greedy(tiny32.model, follow, 5)
    finally:
        engine.stop()
    assert mixed, "no step held a prefill chunk beside a decode row"
    assert backend.stats.num_prefill_chunks > 0
    assert backend.stats.num_decode_rows > 0


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
async def test_an_8_bit_pool_answers_as_sdpa_does_over_the_same_pool(tiny32, kv_dtype):
    """The kernels dequantize in place what SDPA reads dequantized: the same K/V, so the same greedy ids."""
    prompts = [words(tiny32, t) for t in ("The quick brown fox jumps over the lazy dog.", "Paris is the capital")]
    answers = {}
    for attention in ("triton", "sdpa"):
        engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, kv_dtype=kv_dtype, attention=attention)
        try:
            assert engine.runner.layout.is_quantized
            assert engine.runner.backend.name == attention
            results = await asyncio.gather(
                *(run(engine, p, rid=f"r{i}", max_tokens=8, ignore_eos=True) for i, p in enumerate(prompts))
            )
            answers[attention] = [r.token_ids for r in results]
        finally:
            engine.stop()
    assert answers["triton"] == answers["sdpa"]


def test_deterministic_mode_makes_every_token_a_decode_row_where_the_linear_layers_allow(tiny32, monkeypatch):
    monkeypatch.setattr(model_runner, "linear_invariance", lambda model: None)
    monkeypatch.setattr(kernels, "paged_decode_available", lambda: False)  # as on a GPU host: no CPU kernels
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, deterministic=True, attention="triton")
    engine.stop()
    assert not engine.runner.deterministic
    assert engine.runner.deterministic_detail == (
        "unavailable: its linear layers are not batch-invariant on cpu in torch.float32"
    )
    assert not engine.runner.backend.every_token

    monkeypatch.undo()
    monkeypatch.setattr(model_runner, "linear_invariance", lambda model: {"as they are": 15})
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, deterministic=True, attention="triton")
    engine.stop()
    runner = engine.runner
    assert runner.deterministic
    assert runner.backend.every_token
    assert runner.deterministic_detail == "on: attention by the triton backend, linear products 15 as they are"
    table = [3, 7]
    rows = [StepRow(0, 5, 6, table, []), StepRow(5, 1, 3, [1], [])]
    meta = runner.backend.plan(rows, torch.zeros(6, dtype=torch.long))
    assert meta.prefill is None
    assert meta.decode.rows.tolist() == [0, 1, 2, 3, 4, 5]  # each token over its own keys
    assert meta.decode.context_lens.tolist() == [2, 3, 4, 5, 6, 3]


def test_the_deterministic_split_gives_a_token_one_answer_however_it_was_batched(tiny32):
    """A prompt's last token: the same logits, bit for bit, computed with the whole prompt in one step, in chunks,
    and beside another sequence, when every token is a decode row (the kernels' fixed split) and the linear
    layers are batch-invariant (here the CPU's packed ones, made so as the CPU's deterministic mode makes them;
    on a GPU that is `linear_invariance`'s question)."""
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, attention="triton")
    engine.stop()
    runner = engine.runner
    assert batch_invariance(runner.model) is not None
    runner.backend.every_token = True
    prompt = words(tiny32, "The quick brown fox jumps over the lazy dog.")
    beside = words(tiny32, "Paris is the capital")
    pool = runner.pool

    def last_logits(chunks: list[int], other: list[int]) -> torch.Tensor:
        table, other_table = list(range(0, 16)), list(range(20, 28))
        done, logits = 0, torch.empty(0)
        for size in chunks:
            rows = [StepRow(0, size, done + size, table, [])]
            ids, positions = prompt[done : done + size], list(range(done, done + size))
            slots = pool.slot_ids(table, done, done + size)
            if other:
                rows.append(StepRow(size, len(other), len(other), other_table, []))
                ids, positions = ids + other, positions + list(range(len(other)))
                slots += pool.slot_ids(other_table, 0, len(other))
            meta = runner.backend.plan(rows, torch.tensor(slots))
            with torch.inference_mode(), stepping(meta):
                out = runner.model(
                    input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), use_cache=False,
                    logits_to_keep=torch.tensor([size - 1]),
                )  # fmt: skip
            done += size
            logits = out.logits[0, 0]
        return logits

    try:
        whole = last_logits([len(prompt)], [])
        assert torch.equal(whole, last_logits([5, 4, len(prompt) - 9], []))
        assert torch.equal(whole, last_logits([len(prompt)], beside))
        runner.backend.every_token = False  # the prefill kernel: another order, close but not the same bits
        assert torch.allclose(whole, last_logits([len(prompt)], []), atol=1e-4)
    finally:
        pad_rows(runner.model, 1)


def test_a_host_where_the_kernels_do_not_run_serves_by_sdpa_and_says_why(tiny32, monkeypatch):
    failure = "RuntimeError: Failed to find C compiler. Please specify via CC environment variable."
    monkeypatch.setattr(triton_attention, "self_test", lambda *args: failure)
    monkeypatch.setattr(model_runner, "linear_invariance", lambda model: {"as they are": 15})
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, attention="triton", deterministic=True)
    engine.stop()
    backend = engine.runner.backend
    assert backend.name == "sdpa"
    assert backend.detail == f"every row one SDPA call (the Triton kernels do not run here: {failure})"
    assert not engine.runner.deterministic
    assert engine.runner.deterministic_detail == "unavailable: the Triton kernels do not run here"


def test_a_triton_whose_kernels_module_does_not_import_serves_by_sdpa_and_says_why(tiny32, monkeypatch):
    """The self-test imports the kernels' module: a triton that fails there is a host where they do not run, not
    a model that fails to start."""
    monkeypatch.setattr(model_runner, "triton_available", lambda: True)  # installed, by what pip says
    monkeypatch.setitem(sys.modules, "triton", None)  # and `import triton` fails
    monkeypatch.delitem(sys.modules, "server.kv.triton_attention")  # imported again, by the self-test
    monkeypatch.delattr(kv, "triton_attention")
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, attention="triton")
    engine.stop()
    backend = engine.runner.backend
    assert backend.name == "sdpa"
    assert backend.detail == (
        "every row one SDPA call (the Triton kernels do not run here: triton does not import: ModuleNotFoundError: "
        "import of triton halted; None in sys.modules)"
    )


def test_asking_for_a_backend_checks_it_can_run_here(tiny32, monkeypatch):
    with pytest.raises(ValueError, match="expected auto or one of"):
        make_engine(tiny32, attention="flash")
    with pytest.raises(ValueError, match="serves bf16 pools"):
        make_engine(tiny32, attention="tiled")  # float32
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="only under TRITON_INTERPRET=1"):
        make_engine(tiny32, attention="triton")
    monkeypatch.setattr(model_runner, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="triton is not installed"):
        make_engine(tiny32, attention="triton")


class RowByRow(nn.Linear):
    """Each row's product alone: batch-invariant by construction."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([super(RowByRow, self).forward(x[:, i : i + 1]) for i in range(x.shape[1])], 1)


class RowByRowPlus(nn.Linear):
    """Row by row, plus 1e-3 on the rows where `hit(row's place, rows in the call)` holds."""

    def __init__(self, hit) -> None:
        super().__init__(8, 4)
        self.hit = hit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        rows = [super(RowByRowPlus, self).forward(x[:, i : i + 1]) + 1e-3 * self.hit(i, n) for i in range(n)]
        return torch.cat(rows, 1)


class CountsRows(nn.Linear):
    """A product that changes with the rows in the call (as a kernel picked by the row count may)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (x.shape[1] > 16) * 1e-3


def test_the_plain_linear_probe_finds_what_depends_on_the_rows_beside():
    assert linear_invariance(nn.Sequential(RowByRow(8, 4), RowByRow(8, 4), RowByRow(4, 2))) == {"as they are": 3}
    assert linear_invariance(nn.Sequential(RowByRow(8, 4), CountsRows(4, 2))) is None
    assert linear_invariance(nn.Sequential(nn.ReLU())) is None  # nothing to probe
    # by its place in the call (only a shifted call shows it), by the call's size (only calls of 2 to 64 rows)
    assert linear_invariance(nn.Sequential(RowByRowPlus(lambda i, n: i % 8 == 7))) is None
    assert linear_invariance(nn.Sequential(RowByRowPlus(lambda i, n: 2 <= n <= 64))) is None


def test_a_step_s_workspace_holds_the_splits_of_its_longest_row_and_serves_every_layer(tiny32):
    engine = make_engine(tiny32, budget_bytes=4 << 20, block_size=4, attention="triton")
    engine.stop()
    backend = engine.runner.backend
    for t in backend.pool.k + backend.pool.v:
        t.normal_()  # keys and values to read (the pool is made empty)
    rows = [StepRow(0, 1, 5, [0, 1], []), StepRow(1, 1, 300, list(range(2, 77)), [])]
    meta = backend.plan(rows, torch.tensor([4, 300 + 7]))
    assert meta.launch.max_keys == 300
    query = torch.randn(1, 4, 2, 16)
    out = torch.empty(2, 4, 16)
    backend.attend(meta, 0, query, out, 0.25, None, None)
    workspace = meta.launch.workspace
    assert workspace[0].shape[2] == 2  # 300 keys: two splits of 256
    backend.attend(meta, 1, query, out, 0.25, None, None)
    assert meta.launch.workspace is workspace  # made by the step's first layer, reused by the others


def test_the_workspace_holds_a_split_for_every_256_keys():
    acc, run_max, run_sum = triton_attention.decode_workspace(3, 4, 16, 2 * triton_attention.SPLIT_KEYS + 1, "cpu")
    assert acc.shape == (3, 4, 3, 16)
    assert run_max.shape == run_sum.shape == (3, 4, 3)

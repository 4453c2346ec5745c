"""The compiled model (server/engine/compiled.py) end to end: compiled at start, every step through its graphs,
the greedy ids of HF generate() in fp32, the artifacts in the cache directory."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from server.engine.compiled import CACHE_ENV, WARM_UP_TOKENS, CompiledModel, _cache_dir
from server.engine.threads import COMPUTE_THREADS_ENV
from server.http.routes.models import model_object
from server.kv.attention import StepMeta, current_step, stepping
from server.kv.pool import KVLayout, KVPool
from server.models.loader import load_model
from server.models.packed_linear import PackedLinear
from tests.engine.test_families import FAMILIES, hf_reference, save_family
from tests.helpers import make_engine, reference_greedy, run
from tests.tiny import build_tokenizer

FINAL_SOFTCAP = 2.0  # not 1: there tanh(x) * cap would equal tanh(x / cap) * cap


@pytest.fixture(scope="module")
def tiny(tiny_spec):
    """The tiny model in fp32: its linear layers packed, so the graph calls kvserve::packed_linear too."""
    return load_model(dataclasses.replace(tiny_spec, dtype="float32"), Path("unused-cache"))


def served(engine) -> SimpleNamespace:
    """What GET /v1/models/{id} reads of the model host, for an engine made here."""
    state = SimpleNamespace(status="ready", detail="")
    return SimpleNamespace(engines={engine.model_id: engine}, states={engine.model_id: state}, fingerprints=None)


def ids(tiny, text: str) -> list[int]:
    return tiny.tokenizer(text)["input_ids"]


# Inductor builds two graphs of some ten C++ kernels each (gcc, -O3): about 100 s on an idle 2-core machine, well
# past pytest's 300 s default under load; nothing here waits on a clock, so the bound only stops a real hang.
@pytest.mark.timeout(1800)
async def test_the_compiled_model_answers_as_hf_generate(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)  # restored after the test: the engine sets its own
    # The engine thread runs on one thread, its caller on two: dynamo guards the count, so the graphs must be built
    # for the engine's (and the engine must keep it: something under the graph calls was seen to set it back).
    monkeypatch.setenv(COMPUTE_THREADS_ENV, "1")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = make_engine(tiny, block_size=4, compile_dir=str(tmp_path))
    finally:
        torch.set_num_threads(before)
    try:
        compiled = engine.runner.compiled
        assert compiled is not None, "the CPU engine was asked to compile"
        described = model_object(served(engine), "tiny")  # GET /v1/models/tiny's body
        assert described["compiled"] is True
        assert described["compile_detail"].startswith("compiled by torch.compile at start in ")
        assert described["compile_detail"].endswith(" s (0 of 2 graphs from the cache)")
        assert isinstance(
            tiny.model.model.layers[0].mlp.packed_gate_up, PackedLinear
        )  # in the graph: kvserve::packed_linear
        assert os.environ[CACHE_ENV] == str(tmp_path / "inductor")
        assert compiled.cache_hits == 0
        first = ids(tiny, "The quick brown fox jumps over")
        second = ids(tiny, "Paris is the capital of France; Berlin is")
        # two conversations at once: prefill chunks beside decode rows in one step, then decode steps of two rows
        results = await asyncio.gather(
            run(engine, first, session="a", max_tokens=12, ignore_eos=True),
            run(engine, second, session="b", max_tokens=12, ignore_eos=True),
        )
        assert results[0].token_ids == reference_greedy(tiny.model, first, 12)
        assert results[1].token_ids == reference_greedy(tiny.model, second, 12)
        # a later turn continues from the session's K/V, on the same graphs
        later = first + results[0].token_ids + ids(tiny, " and then")
        again = await run(engine, later, session="a", max_tokens=6, ignore_eos=True)
        assert again.usage.cached_tokens > 0
        assert again.token_ids == reference_greedy(tiny.model, later, 6)
        assert compiled.num_steps >= 12 + 6
        assert compiled.num_graph_steps == compiled.num_steps, "attention ran outside the graph's op"
        assert compiled.num_eager_steps == 0, "a step ran eager: no compiled graph fitted it"
        # inputs no graph was compiled for (int32 ids) run eager rather than compile on the engine thread
        row = [5, 17, 42]
        with torch.inference_mode():
            logits = compiled(torch.tensor([row], dtype=torch.int32), torch.tensor([[0, 1, 2]]), torch.tensor([2]))
            expected = tiny.model(input_ids=torch.tensor([row])).logits[0, 2:]
        assert compiled.num_eager_steps == 1
        assert torch.allclose(logits, expected, atol=1e-5), (logits - expected).abs().max()
    finally:
        engine.stop()
    # a restart: the same model compiled again in a fresh dynamo finds both graphs in the cache directory
    torch._dynamo.reset()
    again = CompiledModel(tiny.model, tmp_path, "tiny")
    again.compile()
    assert again.cache_hits == len(WARM_UP_TOKENS)


async def test_a_model_that_fails_to_compile_serves_eager(tiny, tmp_path, monkeypatch):
    def fail(self, startup=None):
        raise RuntimeError("inductor could not build this graph")

    monkeypatch.setattr(CompiledModel, "compile", fail)
    engine = make_engine(tiny, block_size=4, compile_dir=str(tmp_path))
    try:
        assert engine.runner.compiled is None
        described = model_object(served(engine), "tiny")
        assert described["compiled"] is False
        assert described["compile_detail"] == (
            "asked, but runs eager: compiling failed (RuntimeError: inductor could not build this graph)"
        )
        prompt = ids(tiny, "The quick brown fox")
        result = await run(engine, prompt, max_tokens=4, ignore_eos=True)
        assert result.token_ids == reference_greedy(tiny.model, prompt, 4)
    finally:
        engine.stop()


def gemma2_final_softcap(directory: Path):
    """The Gemma-2 family's tiny model (windowed, soft-capped attention) with a final logit softcap too, in fp64."""
    family = FAMILIES["gemma2-softcap"]
    FAMILIES["gemma2-final-softcap"] = lambda: dataclasses.replace(family(), final_logit_softcapping=FINAL_SOFTCAP)
    try:
        return load_model(save_family("gemma2-final-softcap", build_tokenizer(), directory), directory)
    finally:
        del FAMILIES["gemma2-final-softcap"]


def test_a_model_is_compiled_only_where_the_head_is_a_linear_layer_and_a_softcap(tmp_path):
    """Gemma-2's final logit softcap is applied after the compiled decoder; a head that does more is caught at start."""
    loaded = gemma2_final_softcap(tmp_path / "gemma2")
    gemma2 = CompiledModel(loaded.model, tmp_path, "gemma2")  # compiling is lazy: nothing is built here
    assert gemma2.softcap == FINAL_SOFTCAP
    assert gemma2.head_matches()
    row = torch.tensor([ids(loaded, "The quick brown fox jumps over the lazy dog.")])
    sampled = torch.tensor([0, 4, row.shape[1] - 1])
    with torch.inference_mode():  # the sampled rows' logits, as the model's own forward caps them
        hidden = gemma2.body(input_ids=row, use_cache=False).last_hidden_state
        expected = loaded.model(input_ids=row, use_cache=False).logits[0].index_select(0, sampled)
        got = gemma2._logits(hidden, sampled)  # the head on 3 rows, not 18: sums may part in the last bits
    assert torch.allclose(got, expected, rtol=0, atol=1e-12), (got - expected).abs().max()
    assert expected.abs().max() > 0.5 * FINAL_SOFTCAP  # the cap bites: another cap would show
    gemma2.softcap = None  # as if the head's transform were unknown to us
    assert not gemma2.head_matches()
    llama = load_model(save_family("llama", build_tokenizer(), tmp_path / "llama"), tmp_path)
    llama = CompiledModel(llama.model, tmp_path, "llama")
    assert llama.softcap is None
    assert llama.head_matches()


async def test_a_softcapping_model_is_compiled_and_answers_as_its_own_forward(tmp_path, monkeypatch):
    """The runner compiles a model whose head caps its logits (the head check passes), and each sampled token's
    log-probabilities are the capped ones. Traced by dynamo, run by its eager backend: inductor's code generation
    (the slow part, test_the_compiled_model_answers_as_hf_generate's) adds nothing to what is checked here."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.delenv(CACHE_ENV, raising=False)  # restored after the test: the engine sets its own
    loaded = gemma2_final_softcap(tmp_path / "gemma2")
    torch._dynamo.reset()
    engine = make_engine(loaded, block_size=4, compile_dir=str(tmp_path))
    try:
        compiled = engine.runner.compiled
        assert compiled is not None, "the softcapping model was not compiled"
        assert compiled.softcap == FINAL_SOFTCAP
        prompt = ids(loaded, "The quick brown fox jumps over")
        result = await run(engine, prompt, max_tokens=6, ignore_eos=True, num_logprobs=3)
        assert compiled.num_graph_steps == compiled.num_steps >= 6
        assert compiled.num_eager_steps == 0
    finally:
        engine.stop()
        torch._dynamo.reset()
    reference = hf_reference(tmp_path / "gemma2")  # transformers' own eager attention and softcap
    transcript = prompt + result.token_ids
    with torch.inference_mode():
        want = torch.log_softmax(reference(torch.tensor([transcript[:-1]])).logits[0, len(prompt) - 1 :], -1)
    for step, got in enumerate(result.logprobs):
        assert got.token_id == int(want[step].argmax())
        for token, logprob in got.top:
            assert abs(logprob - float(want[step, token])) < 1e-6, (step, token)


def test_inductor_caches_where_the_environment_says_else_in_our_cache_directory(tmp_path, monkeypatch):
    ours = tmp_path / "inductor"
    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert _cache_dir(ours) == str(ours)
    monkeypatch.setenv(CACHE_ENV, default_cache_dir())  # torch's shared default, written by torch itself
    assert _cache_dir(ours) == str(ours)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "given"))
    assert _cache_dir(ours) == str(tmp_path / "given")


def test_a_step_set_inside_another_gives_the_outer_one_back(tiny):
    pool = KVPool(KVLayout.of(tiny.model.config, torch.float32), 4, 4, torch.device("cpu"))
    outer, inner = StepMeta(pool, torch.zeros(1, dtype=torch.long), []), StepMeta(pool, torch.ones(1), [])
    with stepping(outer):
        with stepping(inner):
            assert current_step() is inner
        assert current_step() is outer
    assert current_step() is None

"""Structured output in the engine: a grammar masks each constrained row inside the batched step."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from server.engine.grammar import FORBIDDEN, GrammarError, apply_bitmask
from tests.helpers import make_engine, reference_greedy, run

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["calm", "busy", "tired"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny):
    engine = make_engine(tiny, budget_bytes=16 << 20)
    yield engine
    engine.stop()


def words(tiny, text: str) -> list[int]:
    return tiny.tokenizer(text)["input_ids"]


async def test_every_seeded_sample_parses_and_fits_the_schema(engine, tiny):
    grammar = engine.grammars.json_schema(SCHEMA)
    prompt = words(tiny, "Describe a person as JSON:")

    async def sample(seed: int):
        constraint = await asyncio.to_thread(engine.grammars.compile, grammar)
        params = {"temperature": 1.0, "seed": seed, "max_tokens": 120, "constraint": constraint}
        return await run(engine, prompt, rid=f"s{seed}", **params)

    engine.loop.max_batch_seen = 0
    results = await asyncio.gather(*(sample(seed) for seed in range(50)))
    for seed, result in enumerate(results):
        assert result.error is None, result.error
        assert result.finish_reason == "stop", (seed, result.text)
        jsonschema.validate(json.loads(result.text), SCHEMA)  # a random model, held to the schema
    assert len({r.text for r in results}) > 10  # sampled, not one forced document
    assert engine.loop.max_batch_seen > 1


async def test_constrained_and_free_rows_share_a_step_and_free_ones_are_untouched(engine, tiny):
    prompt = words(tiny, "Hello world, hello kvserve.")
    json_object = engine.grammars.json_schema({"type": "object"})
    constraints = [await asyncio.to_thread(engine.grammars.compile, json_object) for _ in range(3)]
    before = len(engine.loop.step_log)
    free = [run(engine, prompt, rid=f"free{i}", max_tokens=12, ignore_eos=True) for i in range(3)]
    constrained = [
        run(engine, prompt, rid=f"json{i}", max_tokens=60, temperature=1.0, seed=i, constraint=c)
        for i, c in enumerate(constraints)
    ]
    results = await asyncio.gather(*free, *constrained)
    for result in results[:3]:
        assert result.token_ids == reference_greedy(tiny.model, prompt, 12)
    for result in results[3:]:
        assert isinstance(json.loads(result.text), dict), result.text
    steps = list(engine.loop.step_log)[before:]
    assert any(
        any(r.startswith("json") for r in step.decode) and any(r.startswith("free") for r in step.decode)
        for step in steps
    ), "no step decoded a constrained and a free row together"


async def test_a_finished_grammar_ends_the_reply_even_with_ignore_eos(engine, tiny):
    constraint = await asyncio.to_thread(engine.grammars.compile, engine.grammars.json_schema({"enum": ["yes", "no"]}))
    result = await run(engine, words(tiny, "Yes or no?"), max_tokens=50, ignore_eos=True, constraint=constraint)
    assert result.finish_reason == "stop"
    assert json.loads(result.text) in ("yes", "no")
    assert result.usage.completion_tokens < 50


async def test_a_grammar_that_fails_ends_its_request_and_no_other(engine, tiny, monkeypatch):
    def broken(constraints):
        raise RuntimeError("the grammar library failed")

    monkeypatch.setattr(engine.grammars, "fill_masks", broken)
    prompt = words(tiny, "Hello world, hello kvserve.")
    constraint = await asyncio.to_thread(engine.grammars.compile, engine.grammars.json_schema({"type": "object"}))
    free, constrained = await asyncio.gather(
        run(engine, prompt, rid="free", max_tokens=12, ignore_eos=True),
        run(engine, prompt, rid="json", max_tokens=12, constraint=constraint),
    )
    assert constrained.error is not None
    assert constrained.error.code == "internal_error"
    assert constrained.error.message == "the output grammar failed"
    assert free.error is None
    assert free.token_ids == reference_greedy(tiny.model, prompt, 12)


def test_a_schema_the_library_cannot_compile_says_why(engine):
    with pytest.raises(GrammarError, match="Invalid type: frob"):
        engine.grammars.compile(engine.grammars.json_schema({"type": "object", "properties": {"a": {"type": "frob"}}}))
    with pytest.raises(GrammarError, match="does not exist"):
        engine.grammars.compile(engine.grammars.json_schema({"$ref": "#/definitions/missing"}))


def test_a_mask_lands_on_its_own_row_only():
    logits = torch.zeros(4, 40)
    bitmask = torch.full((2, 2), -1, dtype=torch.int32)
    bitmask[0, 0] = ~(1 << 3)  # row 0 of the mask forbids token 3
    bitmask[1, 1] = ~(1 << 2)  # row 1 forbids token 34 (word 1, bit 2)
    apply_bitmask(logits, bitmask, [2, 0])
    assert logits[2, 3] == FORBIDDEN
    assert logits[0, 34] == FORBIDDEN
    assert int((logits != 0).sum()) == 2  # rows 1 and 3 (unconstrained) and every allowed token untouched


MANY_OPTIONAL = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}


def test_a_schema_past_the_parsers_limits_is_refused_when_compiled(engine):
    """1,000 optional properties compile, then the parser's row overflows right after the forced `{`: the walk
    of the forced start at compile time finds it, and says so without the grammar in the message."""
    with pytest.raises(GrammarError) as refused:
        engine.grammars.compile(engine.grammars.json_schema(MANY_OPTIONAL))
    assert "too many alternatives" in refused.value.message
    assert "p999" not in refused.value.message
    assert len(refused.value.message) < 400
    fine = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50)}}
    engine.grammars.compile(engine.grammars.json_schema(fine))


async def test_a_grammar_failing_mid_reply_logs_its_reason_not_the_grammar(engine, tiny, caplog):
    """Past the forced start a model's choice can still trip the limits (null, or the 1,000-property object): that
    request fails alone, and no log line carries the grammar (a megabyte each, before)."""
    grammar = engine.grammars.json_schema({"anyOf": [{"type": "null"}, MANY_OPTIONAL]})
    failed = []
    for seed in range(8):
        constraint = await asyncio.to_thread(engine.grammars.compile, grammar)
        result = await run(engine, words(tiny, "Describe"), rid=f"big{seed}", temperature=1.0, seed=seed,
                           max_tokens=20, constraint=constraint)  # fmt: skip
        failed += [result] if result.error is not None else []
    assert failed, "no seed took the object branch"
    assert {r.error.code for r in failed} == {"internal_error"}
    logged = [caplog.handler.format(record) for record in caplog.records]
    assert all("p999" not in line and len(line) < 4000 for line in logged)
    assert any("too many alternatives" in line for line in logged)


def test_a_grammar_is_validated_and_walked_once_and_a_refused_one_every_time(engine, monkeypatch):
    from server.engine import grammar as grammar_module

    walks = []
    real_probe = grammar_module.probe
    monkeypatch.setattr(grammar_module, "probe", lambda *args: walks.append(args) or real_probe(*args))
    grammars = engine.grammars
    schema = {"type": "object", "properties": {"walked_once": {"type": "integer"}}, "required": ["walked_once"]}
    text = grammars.json_schema(schema)
    first, second = grammars.compile(text), grammars.compile(text)
    assert len(walks) == 1  # the same grammar again (an agent's tools, every turn): not walked again
    assert first.matcher is not second.matcher  # each request still gets a fresh matcher
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
    for _ in range(2):
        with pytest.raises(GrammarError, match="too many alternatives"):
            grammars.compile(grammars.json_schema(wide))  # refused each time: a refusal is never remembered

"""Schemas that allow no finite document are found (and refused before anything runs); recursion with a way out
is fine."""

from __future__ import annotations

import json

import pytest

from server.engine.grammar import Grammars
from server.serving.json_schema import finite_document_problem


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
        {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
        {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
         "type": "object", "properties": {"head": {"$ref": "#/$defs/n"}}, "required": ["head"]},
    ],
)  # fmt: skip
def test_a_schema_with_no_finite_document_is_found(schema):
    assert "no finite document" in finite_document_problem(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"self": {"$ref": "#"}}},  # optional: {} ends it
        {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["next"]},
        {"type": "array", "items": {"$ref": "#"}},  # [] ends it
        {"$defs": {"tree": {"type": "object", "required": ["kids"],
                            "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}}}}},
         "$ref": "#/$defs/tree"},
        {"type": ["object", "null"], "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        {"$ref": "https://example.com/elsewhere.json"},  # not ours to judge: the library's
    ],
)  # fmt: skip
def test_recursion_with_a_way_out_is_fine(tiny, schema):
    assert finite_document_problem(schema) is None
    if "https" not in json.dumps(schema):  # and the grammar library compiles it
        grammars = Grammars(tiny.tokenizer, tiny.vocab_size, tiny.eos_ids)
        grammars.compile(grammars.json_schema(schema))

"""Choosing the grammar library: llguidance against xgrammar, side by side in one run.

python bench/probes/grammar_cost.py [--batch 8] [--steps 200] [--documents 30] [--no-docs]

kvserve depends on llguidance only; `pip install xgrammar` first to compare (it brings triton, ~1 GB).

On the default model's tokenizer (SmolLM2, 49,152 tokens):

1. Cost per decoded token. One JSON schema of the kind clients send (bounded strings, an integer
   range, an enum, an array, a nested object); `--batch` sequences decode together for `--steps`
   steps: each step computes the batch's token masks (each library's batched, multi-threaded call),
   applies them to random logits [batch, vocab] (the server's own `apply_bitmask`, the same for
   both), takes each row's best allowed token and feeds it back; a finished document starts again.
   Microseconds per decoded token, medians over steps.
2. Held to the schema. For schemas using keywords clients do send (uniqueItems, if/then, allOf, a
   pattern, a recursive $ref...), each library either refuses the schema (it says why: kvserve turns
   that into a 400) or compiles it; a compiled one then drives `--documents` documents from random
   logits, and each is checked with `jsonschema`. A library that compiles a schema it does not
   enforce emits documents that do not validate: the count is the column that matters.

outlines-core, the third library the issue names, builds its vocabulary from token strings in a
format its helpers fetch from a hub, so it is not run here. Writes docs/benchmarks.md ("grammar").
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the source tree
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py and the benchmarks
from common import ROOT, machine_line, replace_section

from server.engine.grammar import apply_bitmask  # the server's own, for both libraries
from server.models.loader import read_specs, resolve_source

VOCAB = 49152
MAX_DOCUMENT_TOKENS = 400  # a document not done by then counts as not valid
COST_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "status", "tags", "address"],
    "additionalProperties": False,
}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 3}
HELD_SCHEMAS = {
    "the cost schema above": COST_SCHEMA,
    "pattern": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    "recursive $ref": {
        "$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"},
                                                               "maxItems": 2}}, "additionalProperties": False}},
        "$ref": "#/$defs/n",
    },
    "anyOf with null": {"type": "object", "properties": {"a": {"anyOf": [SMALL_INT, {"type": "null"}]}},
                        "required": ["a"], "additionalProperties": False},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "maximum": 5}}, "required": ["a"],
                         "additionalProperties": False}, {"properties": {"a": {"minimum": 3}}}]},
    "uniqueItems": {"type": "array", "items": SMALL_INT, "uniqueItems": True, "minItems": 3, "maxItems": 4},
    "if/then": {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}, "b": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
        "if": {"properties": {"a": {"const": 1}}},
        "then": {"required": ["b"]},
    },
}  # fmt: skip


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.lib = llguidance
        start = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
        self.setup_s = time.perf_counter() - start
        self.executor = llguidance.LLExecutor()
        self.version = llguidance.__version__

    def compile(self, schema: dict) -> str | None:
        """The grammar for `schema`, or raises ValueError saying why the library refuses it."""
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        message = self.lib.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if message and not message.startswith("WARNING"):
            raise ValueError(message)
        return grammar

    def matchers(self, grammar, n: int) -> list:
        return [self.lib.LLMatcher(self.tokenizer, grammar) for _ in range(n)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.lib.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    @staticmethod
    def consume(matcher, token: int) -> bool:
        """Feed the token; whether the document is done."""
        assert matcher.consume_token(token), matcher.get_error()
        return matcher.is_stopped()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar

        self.lib = xgrammar
        start = time.perf_counter()
        self.compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB))
        self.setup_s = time.perf_counter() - start
        self.batch = xgrammar.BatchGrammarMatcher()
        self.version = importlib.metadata.version("xgrammar")

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    def matchers(self, grammar, n: int) -> list:
        return [self.lib.GrammarMatcher(grammar) for _ in range(n)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    @staticmethod
    def consume(matcher, token: int) -> bool:
        assert matcher.accept_token(token)
        return matcher.is_terminated()


def cost(lib, batch: int, steps: int) -> dict:
    start = time.perf_counter()
    grammar = lib.compile(COST_SCHEMA)
    matchers = lib.matchers(grammar, batch)
    compile_ms = (time.perf_counter() - start) * 1000
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.full((batch, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    times: dict[str, list[float]] = {"mask": [], "apply": [], "consume": []}
    for step in range(steps + 20):  # the first 20 warm up
        logits = torch.randn(batch, VOCAB, generator=gen)
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask)
        t1 = time.perf_counter()
        apply_bitmask(logits, bitmask)
        t2 = time.perf_counter()
        for i, token in enumerate(logits.argmax(dim=-1).tolist()):
            if lib.consume(matchers[i], token):
                matchers[i] = lib.matchers(grammar, 1)[0]
        t3 = time.perf_counter()
        if step >= 20:
            for part, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[part].append(seconds * 1e6 / batch)  # us per decoded token
    medians = {part: statistics.median(values) for part, values in times.items()}
    return {"per_token_us": medians, "total_us": sum(medians.values()), "compile_ms": compile_ms}


def held(lib, schema: dict, documents: int, eos: int) -> str:
    """'refused: why', or how many of `documents` random-logit documents validate."""
    try:
        grammar = lib.compile(schema)
    except (ValueError, RuntimeError) as exc:
        return f"refused ({str(exc).splitlines()[0][:60]})"
    gen = torch.Generator().manual_seed(1)
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    valid = 0
    for _ in range(documents):
        matcher, tokens = lib.matchers(grammar, 1)[0], []
        for _ in range(MAX_DOCUMENT_TOKENS):
            lib.fill([matcher], bitmask)
            logits = torch.randn(1, VOCAB, generator=gen)
            apply_bitmask(logits, bitmask)
            token = int(logits.argmax())
            if token == eos:
                break
            tokens.append(token)
            if lib.consume(matcher, token):
                break
        try:
            jsonschema.validate(json.loads(lib.tokenizer_hf.decode(tokens)), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return f"{valid} of {documents} valid"


def report(results: dict, args) -> str:
    lines = [
        "## Grammars: choosing the structured-output library",
        "",
        f"`python bench/probes/grammar_cost.py` ({machine_line()}), SmolLM2's tokenizer (49,152 tokens). Cost: one "
        f"JSON schema (bounded strings, an integer range, an enum, an array, a nested object), {args.batch} sequences "
        f"decoding together for {args.steps} steps from random logits, each library's own batched mask call, the "
        "same mask application for both; microseconds per decoded token, medians over steps.",
        "",
        f"| library | mask | apply | feed token | **per token** | compile + {args.batch} matchers | tokenizer setup |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in results.items():
        t = result["cost"]["per_token_us"]
        lines.append(
            f"| {name} {result['version']} | {t['mask']:.0f} | {t['apply']:.0f} | {t['consume']:.0f} | "
            f"**{result['cost']['total_us']:.0f}** | {result['cost']['compile_ms']:.0f} ms | "
            f"{result['setup_s'] * 1000:.0f} ms |"
        )
    names = list(results)
    lines += [
        "",
        f"Held to the schema: each schema compiled (or refused, with the library's reason), then {args.documents} "
        "documents from random logits checked with `jsonschema`.",
        "",
        "| schema | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for schema in HELD_SCHEMAS:
        lines.append(f"| {schema} | " + " | ".join(results[n]["held"][schema] for n in names) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--documents", type=int, default=30)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    spec = read_specs(ROOT / "models" / "models.toml")[0]
    tokenizer = AutoTokenizer.from_pretrained(resolve_source(spec, ROOT / "models" / "cache"))
    results = {}
    for cls in (Llguidance, Xgrammar):
        try:
            lib = cls(tokenizer)
        except ImportError:
            print(f"{cls.name} is not installed: skipped")
            continue
        lib.tokenizer_hf = tokenizer
        found = {"version": lib.version, "setup_s": lib.setup_s, "cost": cost(lib, args.batch, args.steps)}
        found["held"] = {name: held(lib, s, args.documents, tokenizer.eos_token_id) for name, s in HELD_SCHEMAS.items()}
        results[lib.name] = found
        print(lib.name, found)
    text = report(results, args)
    print(text)
    if not args.no_docs:
        replace_section(ROOT / "docs" / "benchmarks.md", "grammar", text)


if __name__ == "__main__":
    main()

"""Constrained decoding: a request's grammar masks the tokens it cannot take next, inside the batched step.

The grammar library is llguidance (bench/probes/grammar_cost.py compares it with xgrammar; docs/benchmarks.md).
`Grammars` holds what it needs per model (its view of the tokenizer, built once, ~1 s) and compiles a
grammar (a JSON schema or a Lark grammar, as llguidance's grammar text) into a `Constraint`: one
request's matcher. Each step, the constrained rows' masks are computed together, on llguidance's own
threads (`fill_masks`), and applied to those rows' logits (`apply_bitmask`) before any sampling, so
constrained and free rows still share one forward pass and one batched argmax or draw.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from server.errors import Refused

MAX_GRAMMAR_ERROR = 300  # characters of the library's message kept in a 400 or a log line
MAX_PROBE_STEPS = 64  # forced stretches walked at compile time (a tool call's opening is a few)
MAX_HELD_GRAMMARS = 4096  # grammars remembered (by digest) as validated and walked


class GrammarError(Refused):
    """A schema or grammar the library cannot compile: a 400 saying why."""

    code = "invalid_parameter"


class Constraint:
    """One request's grammar state: what it allows next, fed every token the request generates."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    @property
    def is_done(self) -> bool:
        """The grammar is complete and takes nothing more (only end of sequence)."""
        return bool(self.matcher.is_stopped())

    def consume(self, token_id: int) -> bool:
        """Feed a sampled token; False when the grammar refused it (a bug: masked tokens cannot be drawn)."""
        return bool(self.matcher.consume_token(token_id))

    @property
    def error(self) -> str:
        """The library's reason, bounded (its parser limits keep the grammar itself out of it: see `_limits`)."""
        return reason(str(self.matcher.get_error()))


def reason(message: str) -> str:
    """The library's error message as a person reads it: its debug marker dropped, its length bounded."""
    text = message.replace("<non-verbose/>", "").strip()
    if "Current row has" in text:  # an Earley row past max_items_in_row: too many alternatives at one point
        count = text.split("Current row has", 1)[1].split()[0]
        text = (
            f"too many alternatives at one point of the document ({count} parser items; at most "
            f"{MAX_ITEMS_IN_ROW}): for example, fewer optional properties in one object"
        )
    elif text in ("NoExtension", "NoExtensionBias"):
        text = "it allows no document at all"
    return text[:MAX_GRAMMAR_ERROR]


MAX_ITEMS_IN_ROW = 2000  # llguidance's default, named so the message can say it


def _limits() -> Any:
    """llguidance's default limits, but errors without the grammar in them (a 1,000-property schema's grammar in
    every error: a megabyte per log line)."""
    import llguidance

    return llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW, verbose_errors=False)


class Grammars:
    """The grammar library's view of one model's tokenizer, and compiling grammars for it."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self._hf_tokenizer, self.vocab_size, self._eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._executor: Any = None
        # Grammars already validated and walked: agents send the same tools and schemas every turn, and the walk
        # costs a few mask computations per function. Only what passed is kept (a refusal is checked anew).
        self._held: OrderedDict[bytes, None] = OrderedDict()  # digests of grammar text and starts

    def _llg_tokenizer(self) -> Any:
        with self._lock:  # built once, on the first request that needs it (about a second)
            if self._tokenizer is None:
                import llguidance
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_ids
                )
                self._executor = llguidance.LLExecutor()
            return self._tokenizer

    @staticmethod
    def json_schema(schema: dict[str, Any]) -> str:
        """A grammar for JSON documents of `schema`, compact (no free whitespace: a model cannot pad forever)."""
        import llguidance

        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))
        except ValueError as exc:
            raise GrammarError(f"the JSON schema cannot be used: {str(exc)[:MAX_GRAMMAR_ERROR]}") from exc

    @staticmethod
    def lark(text: str) -> str:
        import llguidance

        return str(llguidance.LLMatcher.grammar_from_lark(text))

    def compile(self, grammar: str, starts: Mapping[str, str] | None = None) -> Constraint:
        """A fresh matcher for one request, its forced start walked (`probe`), and as well from each of `starts`
        (what it names -> text the grammar takes from its beginning: a forced call's opening per function).
        Blocking (up to a second for a large schema): call off the loop."""
        import llguidance

        tokenizer, limits = self._llg_tokenizer(), _limits()
        key = hashlib.blake2b(repr((grammar, sorted((starts or {}).items()))).encode(), digest_size=16).digest()
        with self._lock:
            is_held = key in self._held
        if not is_held:
            message = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
            if message and not message.startswith("WARNING"):
                raise GrammarError(f"the schema or grammar cannot be compiled: {reason(message)}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarError(f"the schema or grammar cannot be compiled: {reason(matcher.get_error())}")
        if not is_held:
            probe(matcher, tokenizer)
            for label, start in (starts or {}).items():
                try:
                    probe(matcher, tokenizer, start)
                except GrammarError as exc:
                    raise GrammarError(f"{label}: {exc.message}") from exc
            with self._lock:
                self._held[key] = None
                while len(self._held) > MAX_HELD_GRAMMARS:
                    self._held.popitem(last=False)
        return Constraint(matcher)

    def fill_masks(self, constraints: list[Constraint]) -> torch.Tensor:
        """The allowed-token bitmask [len(constraints), ceil(vocab / 32)] (int32), computed in parallel."""
        import llguidance.torch

        bitmask = torch.full((len(constraints), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        matchers = [(c.matcher, i) for i, c in enumerate(constraints)]
        llguidance.torch.fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        return bitmask


def probe(matcher: Any, tokenizer: Any, start: str = "") -> None:
    """Walk the grammar's forced stretch (after `start`) on a copy of `matcher`, computing each mask on the way:
    what the library can only find out by computing a mask (a parser row past its limits, a grammar that allows
    nothing) is then a 400 before the request is admitted, not a failure at its first decode step. A schema's
    first brace and a call's opening up to its arguments' first brace are forced, and the limits mostly trip
    right after them; what a model's own choices lead to later can still fail there (a 500 with the reason)."""
    copy = matcher.deep_copy()
    if start and not copy.consume_tokens(tokenizer.tokenize_str(start)):
        raise GrammarError(f"the grammar refused its own start: {reason(copy.get_error())}")
    for _ in range(MAX_PROBE_STEPS):
        if copy.is_stopped():
            break
        copy.compute_bitmask()
        forced = b"" if copy.is_error() else copy.compute_ff_bytes()
        if forced:
            copy.consume_tokens(tokenizer.tokenize_bytes(forced))
        if copy.is_error():
            raise GrammarError(f"the schema or grammar cannot be held: {reason(copy.get_error())}")
        if not forced:
            break


FORBIDDEN = -1e30  # added to a forbidden token's logit: no softmax, argmax or draw can pick it


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """In place: row `rows[r]` of logits [B, V] (row r, without `rows`) gets FORBIDDEN added where bit j of
    bitmask row r ([R, ceil(V / 32)], int32) is 0.

    An add of 0 or FORBIDDEN, not masked_fill: filling by a mask this irregular runs branch by branch on the
    CPU (1.5 ms for 8 rows of 49,152 here, against 0.7 ms); and an indexed add, not a gather and a scatter back
    (0.14 ms against 0.44 ms for 4 rows of 8)."""
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]  # [R, V] 0/1
    penalty = torch.from_numpy(bits).to(logits.device, logits.dtype).sub_(1).mul_(-FORBIDDEN)
    if rows is None or rows == list(range(logits.shape[0])):
        logits.add_(penalty)
    else:
        logits.index_add_(0, torch.tensor(rows, device=logits.device), penalty)

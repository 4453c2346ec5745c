"""Banned openings: a text no line of the reply may open with (a tool result's tag the model would echo)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from server.engine.grammar import FORBIDDEN
from server.engine.openings import KEEPS, OPENS, WRITES, OpeningBans, apply_bans
from tests.helpers import make_engine, reference_greedy, run

TAG = "<tool_response>"


class Pieces:
    """A tokenizer that is only its tokens' texts (what the table reads)."""

    def __init__(self, pieces: list[str], special: tuple[int, ...] = ()) -> None:
        self.pieces, self.all_special_ids = pieces, list(special)

    def __len__(self) -> int:
        return len(self.pieces)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


PIECES = [
    "<",  # 0: begins the tag
    "<tool",  # 1: begins it
    TAG,  # 2: all of it
    "<tool_response>\n",  # 3: all of it and more
    " <",  # 4: begins it after a space
    "<tools",  # 5: cannot begin it
    "x",  # 6
    "\n",  # 7: a line break
    "\n<",  # 8: a line break and the tag's start, in one token
    ".\n  <to",  # 9: the same after spaces
    "a<tool_response>b",  # 10: holds all of it mid-line
    "  ",  # 11: only spaces
    "ab\n",  # 12: ends a line
    "\n x",  # 13: starts a line and writes
    "<|im_end|>",  # 14: the end of sequence
    "</tool_response>",  # 15: another tag
    "",  # 16: writes nothing
]


def test_the_tokens_that_could_open_the_text_are_masked_where_a_line_starts_and_only_there():
    bans = OpeningBans(Pieces(PIECES, special=(14,)), len(PIECES) + 2, frozenset({14}), torch.device("cpu"))
    assert not bans.is_ready((TAG,))
    ban = bans.ban((TAG,))
    assert bans.is_ready((TAG,))
    anywhere = {2, 3, 8, 9, 10}  # the whole tag, or a line break before its start
    assert set(ban.banned().tolist()) == anywhere | {0, 1, 4}  # a reply opens a line
    ban.observe(6)
    assert set(ban.banned().tolist()) == anywhere  # mid-line `<` is allowed
    for token_id, at_line_start in [(7, True), (11, True), (16, True), (14, True), (6, False), (12, True), (13, False)]:
        ban.observe(token_id)
        assert ban.is_at_line_start is at_line_start, PIECES[token_id]
    ban.observe(len(PIECES) + 1)  # an id past the tokenizer's (a padding row): it writes
    assert not ban.is_at_line_start
    assert bans.ban((TAG,)).is_at_line_start  # each request's own state, from a line's start


def test_line_moves_of_token_texts():
    bans = OpeningBans(Pieces(PIECES), len(PIECES), frozenset(), torch.device("cpu"))
    bans.prepare(("x",))
    moves = bans.ban(("x",))._moves
    assert [moves[i] for i in (6, 7, 11, 12, 13, 16)] == [WRITES, OPENS, KEEPS, OPENS, WRITES, KEEPS]


def test_a_ban_fills_only_its_rows_forbidden_ids():
    bans = OpeningBans(Pieces(PIECES), len(PIECES), frozenset(), torch.device("cpu"))
    first, second = bans.ban((TAG,)), bans.ban((TAG,))
    second.observe(6)
    logits = torch.zeros(3, len(PIECES))
    apply_bans(logits, [0, 2], [first, second])
    assert (logits[0] == FORBIDDEN).nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert not logits[1].any()
    assert (logits[2] == FORBIDDEN).nonzero().flatten().tolist() == [2, 3, 8, 9, 10]


@pytest.fixture(scope="module")
def engine(tiny):
    engine = make_engine(tiny, budget_bytes=16 << 20)
    yield engine
    engine.stop()


def words(tiny, text: str) -> list[int]:
    return tiny.tokenizer(text)["input_ids"]


def line_openings(text: str) -> list[str]:
    return [line.lstrip(" \t\r")[:1] for line in text.split("\n")]


async def test_a_banned_opening_never_opens_a_line_sampled_with_a_bias_toward_it(engine, tiny):
    """Pushed toward `<` and line breaks, the tiny model opens lines with `<` often; told not to open one with the
    tag, it never does, and still writes `<` inside lines. Each row samples on its own here (a logit bias)."""
    tokenizer = tiny.tokenizer
    less, newline = tokenizer.convert_tokens_to_ids("<"), tokenizer.convert_tokens_to_ids("\u010a")  # byte-level
    assert (tokenizer.decode([less]), tokenizer.decode([newline])) == ("<", "\n")
    starts = [
        t
        for t in range(len(tokenizer))
        if tokenizer.decode([t]).lstrip() and TAG.startswith(tokenizer.decode([t]).lstrip())
    ]
    assert starts == [less]  # so a line that opens with `<` would be a line that could open with the tag
    bias = {less: 5.0, newline: 4.0}
    prompt = words(tiny, "Hello world, hello kvserve.")

    async def sample(seed: int, banned: tuple[str, ...]):
        params = {"temperature": 1.0, "seed": seed, "max_tokens": 40, "ignore_eos": True, "logit_bias": bias}
        return await run(engine, prompt, rid=f"b{seed}{bool(banned)}", banned_openings=banned, **params)

    free = await asyncio.gather(*(sample(seed, ()) for seed in range(8)))
    banned = await asyncio.gather(*(sample(seed, (TAG,)) for seed in range(8)))
    assert sum(line_openings(r.text).count("<") for r in free) > 4, [r.text for r in free]
    for result in banned:
        assert result.error is None, result.error
        assert "<" not in line_openings(result.text), result.text
    assert sum(r.text.count("<") for r in banned) > 4  # mid-line it is allowed
    again = await sample(3, (TAG,))
    assert again.token_ids == banned[3].token_ids  # seeded: the ban is part of a reproducible draw


async def test_plain_greedy_and_sampled_rows_never_open_with_a_banned_text_in_one_batch(engine, tiny):
    """Rows with nothing else to adjust take their tokens together (one argmax, one draw pass): the ban is in the
    logits before either. Each row is banned from opening with what it opened with unbanned; a free row of the
    same steps is the model's own greedy reply."""
    prompt = words(tiny, "Paris is the capital of France;")
    steady = {"max_tokens": 12, "ignore_eos": True}
    sampled = {"temperature": 1.0, **steady}
    special = set(tiny.tokenizer.all_special_ids)  # an end of sequence is never banned: seeds that open otherwise
    greedy = await run(engine, prompt, rid="g", **steady)
    drawn = {seed: await run(engine, prompt, rid=f"s{seed}", seed=seed, **sampled) for seed in range(12)}
    seeds = [seed for seed, r in drawn.items() if r.token_ids[0] not in special][:6]
    first = [greedy, *(drawn[seed] for seed in seeds)]
    openings = [tiny.tokenizer.decode(r.token_ids[:1]).lstrip(" ") for r in first]
    assert len(seeds) == 6
    assert all(openings), openings
    rows = [run(engine, prompt, rid="free", **steady)]
    rows.append(run(engine, prompt, rid="g-banned", banned_openings=(openings[0],), **steady))
    for seed, opening in zip(seeds, openings[1:], strict=True):
        rows.append(run(engine, prompt, rid=f"s{seed}-banned", seed=seed, banned_openings=(opening,), **sampled))
    before = len(engine.loop.step_log)
    free, *banned = await asyncio.gather(*rows)
    assert free.token_ids == reference_greedy(tiny.model, prompt, 12)
    for opening, unbanned, result in zip(openings, first, banned, strict=True):
        assert result.error is None, result.error
        assert result.token_ids[0] != unbanned.token_ids[0]  # the token that opened with it is masked
        assert not result.text.lstrip(" ").startswith(opening), (opening, result.text)
    steps = list(engine.loop.step_log)[before:]
    together = {"free", "g-banned", f"s{seeds[0]}-banned"}
    assert any(together <= set(step.decode) for step in steps), "the rows never shared a step"


async def test_a_grammar_decides_alone_where_a_ban_would_forbid_what_it_needs(engine, tiny):
    """A JSON grammar must open with `{`: a ban of that opening is not applied beside it (a forced call's grammar
    opens with the call tag, which the tool-response ban's first token may be)."""
    grammar = engine.grammars.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    constraint = await asyncio.to_thread(engine.grammars.compile, grammar)
    prompt = words(tiny, "JSON:")
    result = await run(engine, prompt, max_tokens=40, constraint=constraint, banned_openings=("{",))
    assert result.error is None, result.error
    assert isinstance(json.loads(result.text)["a"], int)

"""Texts a line of the reply may not open with: the tokens that would start one are masked where a line starts.

A small model given a tool result inside `<tool_response>` tags answers by writing such a block itself (it
imitates its prompt, where the result opens a line); its readers hide the block, and the reply is left empty.
Masking a later token of the tag does not help: once the model wrote `<` it is set on a tag, and writes
`<tool_error>` or `<tool_call>` with a made-up call instead. So the tag is kept from opening a line: where a line
of the reply starts (the reply's start, or after a line break and spaces), every token whose text, spaces left
aside, could begin the text (a prefix of it, or the text and more) is masked; and so, anywhere, is a token that
holds a line break followed by such a start, or the whole text. Every tokenization the model could start the text
with is one of these tokens, so the text never opens a line; mid-line the same token is allowed (`x < y`).

Every token's text is read once per model and each text's masks built once (`OpeningBans.prepare`, on a worker
thread when `Engine.submit_async` finds them missing: the engine thread does not wait for it). A request that bans
nothing pays nothing; one that does pays a lookup per token and one indexed fill of its row per step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from server.engine.grammar import FORBIDDEN

SPACES = " \t\r"  # what may stand before a line's first text without making it start elsewhere

# How a token moves the line state: text after its last line break is only spaces (a line starts), it holds only
# spaces or nothing (the state stays as it was), or it writes something (the line has started).
OPENS, KEEPS, WRITES = 0, 1, 2


@dataclass(slots=True, frozen=True)
class BannedOpenings:
    """The masks of some texts: `anywhere` (token ids forbidden at every step), `at_line_start` (forbidden where
    a line starts: these and `anywhere`)."""

    anywhere: torch.Tensor
    at_line_start: torch.Tensor


class OpeningBan:
    """One request's: where its reply stands (at a line's start or not), and the ids it may not take next."""

    def __init__(self, masks: BannedOpenings, moves: bytes) -> None:
        self._masks, self._moves = masks, moves
        self.is_at_line_start = True  # a reply opens a line: the generation prompt ends one, or nothing came before

    def banned(self) -> torch.Tensor:
        return self._masks.at_line_start if self.is_at_line_start else self._masks.anywhere

    def observe(self, token_id: int) -> None:
        move = self._moves[token_id] if token_id < len(self._moves) else WRITES
        if move != KEEPS:
            self.is_at_line_start = move == OPENS


class OpeningBans:
    """One model's view: each token's text, read once, and the masks of each text asked for."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int], device: torch.device) -> None:
        self._tokenizer, self._vocab_size, self._eos_ids, self._device = tokenizer, vocab_size, eos_ids, device
        self._lock = threading.Lock()
        self._pieces: list[str] | None = None
        self._moves = b""
        self._masks: dict[tuple[str, ...], BannedOpenings] = {}

    def is_ready(self, texts: tuple[str, ...]) -> bool:
        return texts in self._masks  # a dict read: atomic

    def prepare(self, texts: tuple[str, ...]) -> None:
        """The masks of `texts`, built once: every token's text is read on the first call (a second or so for a
        large vocabulary), so the first request that bans has it done off the engine thread."""
        with self._lock:
            if self._pieces is None:
                size = min(self._vocab_size, len(self._tokenizer))
                # Special tokens as written (a template's tags may be some); ids the model has past the
                # tokenizer's (padding rows) write nothing a line could open with.
                self._pieces = [self._tokenizer.decode([i], skip_special_tokens=False) for i in range(size)]
                # A special token writes nothing the client sees (its text is dropped): the line stays as it was.
                special = set(getattr(self._tokenizer, "all_special_ids", []))
                self._moves = bytes(KEEPS if i in special else _move(p) for i, p in enumerate(self._pieces))
            if texts not in self._masks:
                self._masks[texts] = self._build(texts)

    def ban(self, texts: tuple[str, ...]) -> OpeningBan:
        """A fresh ban of `texts` for one request (its masks built here if no request asked for them yet)."""
        if not self.is_ready(texts):
            self.prepare(texts)
        return OpeningBan(self._masks[texts], self._moves)

    def _build(self, texts: tuple[str, ...]) -> BannedOpenings:
        assert self._pieces is not None
        anywhere: list[int] = []
        at_line_start: list[int] = []
        for token_id, piece in enumerate(self._pieces):
            if token_id in self._eos_ids:
                continue  # a reply may always end
            if any(_opens_inside(piece, text) for text in texts):
                anywhere.append(token_id)
                at_line_start.append(token_id)
            elif any(_may_begin(piece.lstrip(SPACES), text) for text in texts):
                at_line_start.append(token_id)

        def ids(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self._device)

        return BannedOpenings(ids(anywhere), ids(at_line_start))


def apply_bans(logits: torch.Tensor, rows: list[int], bans: list[OpeningBan]) -> None:
    """In place: each of these rows of logits [B, V] gets FORBIDDEN at the ids its ban forbids now."""
    for row, ban in zip(rows, bans, strict=True):
        ids = ban.banned()
        if ids.numel():
            logits[row].index_fill_(0, ids, FORBIDDEN)


def _may_begin(text: str, opening: str) -> bool:
    """`text` could be how `opening` begins: a prefix of it, or all of it and more."""
    return bool(text) and (opening.startswith(text) or text.startswith(opening))


def _opens_inside(piece: str, opening: str) -> bool:
    """The token holds all of `opening`, or a line break followed by how it begins: wherever it stands."""
    if opening in piece:
        return True
    lines = piece.split("\n")
    return any(_may_begin(line.lstrip(SPACES), opening) for line in lines[1:])


def _move(piece: str) -> int:
    if "\n" in piece:
        return OPENS if not piece.rsplit("\n", 1)[1].strip(SPACES) else WRITES
    return KEEPS if not piece.strip(SPACES) else WRITES

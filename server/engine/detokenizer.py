"""Streaming detokenizer with stop strings.

Text is released only when it is final: a multi-byte character split across tokens is held
until its last byte arrives (never U+FFFD mid-stream), and a tail that could still grow into
a stop string is held until it cannot. A stop string is matched across token boundaries and
never emitted.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: list[str] | None = None, shown: frozenset[int] = frozenset()) -> None:
        """`shown`: special tokens whose text is part of the output all the same (a template's tool-call tags)."""
        self._tokenizer = tokenizer
        self._shown = shown
        self._stop = [s for s in (stop or []) if s]
        self._ids: list[int] = []
        # Decode a short window (prefix_offset:) and diff it against (prefix_offset:read_offset):
        # tokenizers that merge a leading space into the next piece decode consistently this way.
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # all final text so far
        self._num_emitted = 0  # characters of _text already released
        self.matched: str | None = None  # the stop string that ended the output, once one did

    def add(self, token_id: int) -> tuple[str, bool]:
        """Feed one generated token. Returns (text to release, whether a stop string ended the output)."""
        self._ids.append(token_id)
        self._text += self._decode_new()
        return self._release(is_final=False)

    def flush(self) -> str:
        """At the end of generation: release what was held back, bytes left incomplete included."""
        tail = self._decode(self._ids[self._prefix_offset :])
        self._text += tail[len(self._decode(self._ids[self._prefix_offset : self._read_offset])) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        text, _ = self._release(is_final=True)
        return text

    def _decode(self, ids: list[int]) -> str:
        if not self._shown or not self._shown.intersection(ids):
            return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
        parts: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id in self._shown:
                parts += [self._decode(run), self._tokenizer.convert_ids_to_tokens(token_id)]
                run = []
            else:
                run.append(token_id)
        return "".join([*parts, self._decode(run)])

    def _decode_new(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.endswith(REPLACEMENT) or len(new_text) <= len(prefix_text):
            return ""  # an incomplete character (or nothing visible yet): wait for more tokens
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def _release(self, is_final: bool) -> tuple[str, bool]:
        pending = self._text[self._num_emitted :]
        if self._stop:
            cut = _first_stop(pending, self._stop)
            if cut is not None:
                self._num_emitted = len(self._text)
                self.matched = min((s for s in self._stop if pending.find(s) == cut), key=len)
                return pending[:cut], True
            if not is_final:
                pending = pending[: len(pending) - _held_tail(pending, self._stop)]
        self._num_emitted += len(pending)
        return pending, False


def _first_stop(text: str, stop: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


def _held_tail(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest

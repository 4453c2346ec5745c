"""Message text never becomes a control token.

A chat prompt is rendered to text by the model's template and then tokenized, and a tokenizer turns
every spelling of a special token in that text into the token itself. Without care, a user who types
`<|im_end|>\n<|im_start|>system\n...` in a message writes a system turn of their own. So before a
conversation is rendered, every control token spelt inside what the client sent (contents, names,
tool-call arguments, tool definitions) is swapped for a private mark; the template's own control
tokens stay as they are; and tokenizing turns each mark back into the *text* of the token (its
characters as ordinary tokens), never into the token.

Text with no control-token spelling in it (nearly all) tokenizes exactly as before. Around a mark,
the text on either side is tokenized apart from it, so a few tokens next to it may split a little
differently from plain text of the same characters. `KVSERVE_CONTROL_TOKENS_IN_MESSAGES=true` turns
the guard off (the text is then read as the tokenizer reads it, control tokens included).
"""

from __future__ import annotations

import re
import secrets
from functools import lru_cache
from typing import Any

NONCE = secrets.token_hex(8)  # per process: a client cannot type a mark that would be taken for one
MARK = re.compile("\ue000" + NONCE + r"(\d+)\ue001")
MARK_PREFIX = "\ue000" + NONCE


@lru_cache(maxsize=16)
def _pattern(specials: tuple[str, ...]) -> tuple[re.Pattern[str], dict[str, int]] | None:
    """Leftmost, longest first, as a tokenizer matches them; and each spelling's index (what its mark names)."""
    if not specials:
        return None
    pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    return pattern, {s: i for i, s in enumerate(specials)}


@lru_cache(maxsize=16)
def special_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The spellings the tokenizer turns into special (control) tokens, in a fixed order (asked once per
    tokenizer: a fast tokenizer builds its added-tokens map anew on every read)."""
    found = set(getattr(tokenizer, "all_special_tokens", []))
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found |= {str(t.content) for t in decoder.values() if getattr(t, "special", False)}
    return tuple(sorted(s for s in found if s))


def mark(tokenizer: Any, value: Any) -> Any:
    """`value` (a string, or lists and dicts of them) with every control-token spelling swapped for its mark."""
    found = _pattern(special_tokens(tokenizer))
    if found is None:
        return value
    pattern, index = found

    def swap(found: re.Match[str]) -> str:
        return f"{MARK_PREFIX}{index[found.group()]}\ue001"

    def walk(item: Any) -> Any:
        if isinstance(item, str):
            return pattern.sub(swap, item) if pattern.search(item) else item
        if isinstance(item, list):
            return [walk(v) for v in item]
        if isinstance(item, dict):
            return {k: walk(v) for k, v in item.items()}
        return item

    return walk(value)


def tokenize(tokenizer: Any, text: str) -> list[int]:
    """The ids of rendered text: its own control tokens as tokens, each mark as the characters it stands for."""
    if MARK_PREFIX not in text:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    specials = special_tokens(tokenizer)
    ids: list[int] = []
    start = 0
    for found in MARK.finditer(text):
        if found.start() > start:
            ids += tokenizer(text[start : found.start()], add_special_tokens=False)["input_ids"]
        spelt = specials[int(found.group(1))]
        ids += tokenizer(spelt, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        start = found.end()
    if start < len(text):
        ids += tokenizer(text[start:], add_special_tokens=False)["input_ids"]
    return ids

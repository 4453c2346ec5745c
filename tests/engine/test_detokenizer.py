"""Streaming detokenizer: no U+FFFD for split characters, stop strings across token boundaries."""

from __future__ import annotations

import copy

import pytest

from server.engine.detokenizer import Detokenizer
from tests.tiny import build_tokenizer

TEXT = "Emoji \U0001f600 caf\u00e9 \u4e2d\u6587 done"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def stream(tokenizer, ids, stop=None):
    detok = Detokenizer(tokenizer, stop)
    pieces = []
    for token_id in ids:
        text, is_stopped = detok.add(token_id)
        pieces.append(text)
        if is_stopped:
            return pieces, True
    pieces.append(detok.flush())
    return pieces, False


def test_multibyte_characters_split_across_tokens_never_emit_replacement(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    single = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in s for s in single)  # the premise: some tokens hold half a character
    pieces, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT


def test_stop_string_spanning_tokens_is_matched_and_not_emitted(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    pieces, is_stopped = stream(tokenizer, ids, stop=["\u00e9 \u4e2d"])
    assert is_stopped
    assert "".join(pieces) == "Emoji \U0001f600 caf"


def test_partial_stop_prefix_is_released_when_it_cannot_match(tokenizer):
    ids = tokenizer("caf\u00e9 creme")["input_ids"]
    pieces, is_stopped = stream(tokenizer, ids, stop=["caf\u00e9 cr\u00e8me"])
    assert not is_stopped
    assert "".join(pieces) == "caf\u00e9 creme"


def test_earliest_of_several_stops_wins(tokenizer):
    ids = tokenizer("Hello world, hello kvserve.")["input_ids"]
    pieces, is_stopped = stream(tokenizer, ids, stop=["kvserve", "world"])
    assert is_stopped
    assert "".join(pieces) == "Hello "


def test_tool_call_tags_that_are_special_tokens_are_kept_when_asked(tiny):
    from server.serving.tools import ToolSpec, ToolUse, call_markers

    tokenizer = copy.deepcopy(tiny.tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    text = '<tool_call>{"name": "f"}</tool_call>'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    tools = ToolUse((ToolSpec("f", None, {}),))
    shown = call_markers(tokenizer, tools)
    assert len(shown) == 2  # both tags are special tokens of this tokenizer
    assert call_markers(tokenizer, None) == frozenset()
    plain, kept = Detokenizer(tokenizer), Detokenizer(tokenizer, shown=shown)
    assert "".join(plain.add(t)[0] for t in ids) + plain.flush() == '{"name": "f"}'  # decoding drops them
    assert "".join(kept.add(t)[0] for t in ids) + kept.flush() == text

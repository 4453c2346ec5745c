"""Token-exact chat continuation under a template that rewrites past turns and inserts a default system prompt."""

from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.sessions.record import SessionKey
from server.settings import Settings
from tests.helpers import reference_greedy
from tests.http.conftest import wait_ready

# Like reasoning-model templates: earlier assistant turns are re-rendered differently from how the model
# produced them (another header, reasoning stripped, whitespace trimmed); with no system message, a default
# one is inserted (as SmolLM2's template does).
REWRITING_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}{% for m in messages %}"
    "{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant (earlier)\\n' + (m['content'].split('</think>')[-1] | trim) + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def rewriting(tiny_spec):
    spec = dataclasses.replace(tiny_spec, id="rewriting", chat_template=REWRITING_TEMPLATE)
    with TestClient(create_app(Settings(), specs=[spec])) as c:
        wait_ready(c)
        yield c


def ids_of(tiny, text: str) -> list[int]:
    return tiny.tokenizer(text, add_special_tokens=False)["input_ids"]


def turn(client, sid, messages, max_tokens, **extra):
    body = {"model": "rewriting", "session_id": sid, "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    r = client.post("/v1/chat/completions", json={**body, **extra})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("reply_end", ["cut", "end_of_turn"])  # cut by max_tokens, or ended on <|im_end|>
def test_continuation_keeps_the_transcript_tokens_the_template_would_rewrite(rewriting, tiny, reply_end):
    sid = f"rewrite-{reply_end}"
    store = rewriting.app.state.host.store
    ends_turn = reply_end == "end_of_turn"
    end_of_turn = tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")
    extra = {"logit_bias": {str(end_of_turn): 100}} if ends_turn else {}  # the reply is <|im_end|> alone
    max_tokens = 40 if ends_turn else 4
    messages = [{"role": "user", "content": "Hello world"}]
    first = turn(rewriting, sid, messages, max_tokens, **extra)["choices"][0]["message"]["content"]
    messages.append({"role": "assistant", "content": first})
    for user in ("Paris is", "The quick brown fox"):
        transcript = store.transcript(SessionKey("default", sid))
        assert (transcript[-1] == end_of_turn) == ends_turn
        messages.append({"role": "user", "content": user})
        body = turn(rewriting, sid, messages, max_tokens, **extra)
        closing = "\n" if ends_turn else "<|im_end|>\n"  # what the transcript lacks of the reply's closing
        expected = transcript + ids_of(tiny, f"{closing}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
        usage = body["usage"]
        assert usage["prompt_tokens"] == len(expected)
        assert store.transcript(SessionKey("default", sid))[: len(expected)] == expected
        assert usage["prompt_tokens_details"]["cached_tokens"] == len(transcript) - 1  # nothing recomputed
        reply = body["choices"][0]["message"]["content"]
        if ends_turn:
            assert reply == ""
            assert usage["completion_tokens"] == 1
        else:
            reference = reference_greedy(tiny.model, expected, usage["completion_tokens"])
            assert reply == tiny.tokenizer.decode(reference, skip_special_tokens=True)
        # A full re-render would not give these ids back: the template rewrote the earlier turns.
        text = tiny.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, chat_template=REWRITING_TEMPLATE
        )
        assert ids_of(tiny, text)[: len(transcript)] != transcript
        messages.append({"role": "assistant", "content": reply})


@pytest.mark.parametrize("edited_at", [0, 1])  # the question, or the reply; as many messages as a continuation
def test_edited_history_falls_back_to_the_longest_common_prefix(rewriting, tiny, edited_at):
    sid = f"edited-{edited_at}"
    store = rewriting.app.state.host.store
    messages = [{"role": "user", "content": "Hello world"}]
    reply = turn(rewriting, sid, messages, 4)["choices"][0]["message"]["content"]
    transcript = store.transcript(SessionKey("default", sid))
    edited = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "Hi"}]
    edited[edited_at] = {**edited[edited_at], "content": edited[edited_at]["content"] + " (edited)"}
    body = turn(rewriting, sid, edited, 4)
    # A full render of the edited conversation, not the transcript plus the new message.
    text = tiny.tokenizer.apply_chat_template(
        edited, add_generation_prompt=True, tokenize=False, chat_template=REWRITING_TEMPLATE
    )
    expected = ids_of(tiny, text)
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(expected)
    assert store.transcript(SessionKey("default", sid))[: len(expected)] == expected
    shared = 0
    while shared < min(len(expected), len(transcript)) and expected[shared] == transcript[shared]:
        shared += 1
    assert usage["prompt_tokens_details"]["cached_tokens"] <= shared  # only the longest common prefix is reused
    reference = reference_greedy(tiny.model, expected, usage["completion_tokens"])
    assert body["choices"][0]["message"]["content"] == tiny.tokenizer.decode(reference, skip_special_tokens=True)

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


def turn(client, sid, messages, max_tokens):
    body = {"model": "rewriting", "session_id": sid, "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("max_tokens", [4, 40])  # a reply cut by max_tokens, and one that may end on <|im_end|>
def test_continuation_keeps_the_transcript_tokens_the_template_would_rewrite(rewriting, tiny, max_tokens):
    sid = f"rewrite-{max_tokens}"
    store = rewriting.app.state.host.store
    messages = [{"role": "user", "content": "Hello world"}]
    messages.append(
        {"role": "assistant", "content": turn(rewriting, sid, messages, max_tokens)["choices"][0]["message"]["content"]}
    )
    for user in ("Paris is", "The quick brown fox"):
        transcript = store.transcript(SessionKey("default", sid))
        messages.append({"role": "user", "content": user})
        body = turn(rewriting, sid, messages, max_tokens)
        closing = "\n" if transcript[-1] in tiny.eos_ids else "<|im_end|>\n"  # what the transcript lacks of it
        expected = transcript + ids_of(tiny, f"{closing}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
        usage = body["usage"]
        assert usage["prompt_tokens"] == len(expected)
        assert usage["prompt_tokens_details"]["cached_tokens"] == len(transcript) - 1  # nothing recomputed
        reference = reference_greedy(tiny.model, expected, usage["completion_tokens"])
        reply = body["choices"][0]["message"]["content"]
        assert reply == tiny.tokenizer.decode(reference, skip_special_tokens=True)
        # A full re-render would not give these ids back: the template rewrote the earlier turns.
        text = tiny.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, chat_template=REWRITING_TEMPLATE
        )
        assert ids_of(tiny, text)[: len(transcript)] != transcript
        messages.append({"role": "assistant", "content": reply})


def test_edited_history_falls_back_to_the_longest_common_prefix(rewriting):
    messages = [{"role": "user", "content": "Hello world"}]
    reply = turn(rewriting, "edited", messages, 4)["choices"][0]["message"]["content"]
    edited = [*messages, {"role": "assistant", "content": reply + " (edited)"}, {"role": "user", "content": "Hi"}]
    body = turn(rewriting, "edited", edited, 4)
    assert 0 < body["usage"]["prompt_tokens_details"]["cached_tokens"] < body["usage"]["prompt_tokens"] - 10

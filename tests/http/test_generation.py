"""JSON and SSE shapes, session continuation over HTTP, honest cached_tokens."""

from __future__ import annotations

import json

from server.sessions.record import SessionKey
from tests.helpers import reference_greedy

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def sse_events(response) -> list:
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.read().decode()
    blocks = [b for b in raw.split("\n\n") if b.strip()]
    events = []
    for block in blocks:
        lines = [ln for ln in block.split("\n") if not ln.startswith(":")]
        if not lines:
            continue
        assert len(lines) == 1, block
        assert lines[0].startswith("data: "), block
        payload = lines[0][len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_completion_json_shape(client):
    r = client.post(COMPLETIONS, json={"model": "tiny", "prompt": "Hello world", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert set(choice) == {"index", "text", "finish_reason", "logprobs"}
    assert body["usage"]["completion_tokens"] <= 5
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_completion_accepts_token_ids(client, tiny):
    ids = tiny.tokenizer("Hello world")["input_ids"]
    by_ids = client.post(COMPLETIONS, json={"model": "tiny", "prompt": ids, "max_tokens": 5, "temperature": 0})
    by_text = client.post(
        COMPLETIONS, json={"model": "tiny", "prompt": "Hello world", "max_tokens": 5, "temperature": 0}
    )
    assert by_ids.json()["choices"][0]["text"] == by_text.json()["choices"][0]["text"]
    assert by_ids.json()["usage"]["prompt_tokens"] == len(ids)


def test_chat_stream_framing(client):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with client.stream("POST", CHAT, json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    first, *middle, finish, usage, _ = events
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["choices"][0]["finish_reason"] is None and "content" in e["choices"][0]["delta"] for e in middle)
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["choices"][0]["delta"] == {}
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 6
    assert len({e["id"] for e in events[:-1]}) == 1


def test_completion_stream_without_usage(client):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with client.stream("POST", COMPLETIONS, json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "text_completion" for e in events[:-1])


def chat_turn(client, session, messages, max_tokens=5, **extra):
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = client.post(CHAT, json={**body, **extra}, headers={"X-Session-ID": session} if session else {})
    assert r.status_code == 200, r.text
    return r


def fresh_text(tiny, messages, max_tokens=5) -> str:
    text = tiny.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tiny.tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids_text(tiny, ids, max_tokens)


def ids_text(tiny, ids, max_tokens=5) -> str:
    return tiny.tokenizer.decode(reference_greedy(tiny.model, ids, max_tokens), skip_special_tokens=True)


def continued(tiny, transcript: list[int], user: str) -> list[int]:
    """By hand, for this ChatML template: what a session adds after its transcript for one new user message."""
    tail = "\n" if transcript[-1] in tiny.eos_ids else "<|im_end|>\n"  # a reply cut by max_tokens lacks both
    new = f"{tail}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    return transcript + tiny.tokenizer(new, add_special_tokens=False)["input_ids"]


def test_chat_session_three_turns_and_edited_history(client, engine, tiny):
    store = client.app.state.host.store
    key = SessionKey("default", "chat3")
    messages = [{"role": "system", "content": "Be brief."}]
    cached = []
    for turn, user in enumerate(["Hello world", "Paris is", "The quick brown fox"]):
        transcript = store.transcript(key)
        messages.append({"role": "user", "content": user})
        before = engine.counter.num_prefill_tokens
        r = chat_turn(client, "chat3", messages)
        usage = r.json()["usage"]
        assert (
            engine.counter.num_prefill_tokens - before
            == usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        )
        content = r.json()["choices"][0]["message"]["content"]
        # The reference is a fresh run over the session's transcript plus the new turn, not a re-render.
        expected_ids = continued(tiny, transcript, user) if turn else None
        if turn:
            assert usage["prompt_tokens"] == len(expected_ids)
            # every transcript token but the last reply token, whose K/V only this turn computes
            assert usage["prompt_tokens_details"]["cached_tokens"] == len(transcript) - 1
            assert r.headers["X-Cache"] == "partial"
        assert content == (ids_text(tiny, expected_ids) if turn else fresh_text(tiny, messages)), f"turn {turn + 1}"
        assert r.headers["X-Session-ID"] == "chat3"
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        messages.append({"role": "assistant", "content": content})
    assert cached[0] < cached[1] < cached[2]  # turn 1 may share a few template tokens with other conversations
    edited = [*messages[:2], {"role": "assistant", "content": "something else"}, {"role": "user", "content": "Hi"}]
    r = chat_turn(client, "chat3", edited)
    reused = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < reused < cached[2]  # the edited history falls back to its longest common prefix
    assert r.json()["choices"][0]["message"]["content"] == fresh_text(tiny, edited)
    info = client.get("/v1/sessions/chat3").json()
    assert info["turns"] == 1  # the edit is in turn 1's reply: no earlier turn is still held, this one is turn 1
    assert info["cached_tokens"] > 0
    assert info["cache"]["device"]["bytes"] > 0


def test_session_via_body_and_header_are_the_same(client):
    messages = [{"role": "user", "content": "Hello there, body"}]
    first = chat_turn(client, None, messages, session_id="both")
    reply = first.json()["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the header?"}]
    second = chat_turn(client, "both", messages)
    assert first.headers["X-Session-ID"] == second.headers["X-Session-ID"] == "both"
    info = client.get("/v1/sessions/both").json()
    assert info["turns"] == 2  # one session: the body's id and the header's id are the same one
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == first.json()["usage"]["prompt_tokens"] + first.json()["usage"]["completion_tokens"] - 1


def test_stateless_requests_share_prefixes_unless_cache_prompt_is_false(client):
    messages = [{"role": "user", "content": "Numbers and symbols, stateless"}]
    for _ in range(2):  # the no-cache baseline: nothing reused, nothing published
        r = chat_turn(client, None, messages, cache_prompt=False)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert "X-Session-ID" not in r.headers
    chat_turn(client, None, messages)
    r = chat_turn(client, None, messages)  # no session, but the tenant's prefix cache is shared
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


def test_prompt_cache_key_bucket_records_turns_without_locking(client):
    messages = [{"role": "user", "content": "Caf\u00e9 cr\u00e8me"}]
    chat_turn(client, None, messages, prompt_cache_key="bucket")
    r = chat_turn(client, None, messages, prompt_cache_key="bucket")
    assert "X-Session-ID" not in r.headers  # a bucket is not a session
    bucket = client.app.state.host.store.view(SessionKey("default", "bucket", kind="bucket"))
    assert bucket.rev == 3  # made, then a turn recorded by each request (the second, a retry, is turn 1 again)
    assert bucket.num_turns == 1
    assert bucket.messages == []  # both requests used it; it keeps no prompt text
    assert client.get("/v1/sessions/bucket").status_code == 404


def test_an_identical_retry_is_a_hit_and_recomputes_one_token(client, engine):
    body = {"model": "tiny", "prompt": "Paris is the capital of France;", "max_tokens": 3, "session_id": "retry"}
    first = client.post(COMPLETIONS, json=body)
    before = engine.counter.num_prefill_tokens
    again = client.post(COMPLETIONS, json=body)
    assert first.headers["X-Cache"] == "miss"
    assert again.headers["X-Cache"] == "hit"
    assert engine.counter.num_prefill_tokens - before == 1
    usage = again.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


def test_logprobs_shapes(client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    r = client.post(CHAT, json={**body, "logprobs": True, "top_logprobs": 2, "ignore_eos": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert content[0]["token"] == content[0]["top_logprobs"][0]["token"]
    r = client.post(
        COMPLETIONS, json={"model": "tiny", "prompt": "Hi", "max_tokens": 3, "logprobs": 1, "ignore_eos": True}
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3


def test_streamed_completion_logprobs_offset_into_the_text_sent_before(client):
    """Each chunk's text_offset starts where the text of the chunks before it ends (OpenAI's legacy logprobs)."""
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 12, "logprobs": 1, "ignore_eos": True, "temperature": 0}
    with client.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
        events = sse_events(r)
    sent, num_tokens = 0, 0
    for choice in [e["choices"][0] for e in events[:-1]]:
        lp = choice["logprobs"]
        if lp is not None:
            assert lp["text_offset"][0] == sent, (choice, sent)
            num_tokens += len(lp["tokens"])
        sent += len(choice["text"])
    assert num_tokens == 12
    assert sent > 0


def test_models_health_ready(client):
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == ["tiny", "tiny-twin"]
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json()["status"] == "ready"


def test_one_model_object_says_dtype_context_and_kv_size(client):
    tiny = client.get("/v1/models/tiny").json()
    assert tiny["id"] == "tiny"
    assert tiny["status"] == "ready"
    assert tiny["max_model_len"] == 4096
    assert tiny["dtype"] == "float64"
    assert tiny["dtype_reason"] == "configured in models.toml"
    config = client.app.state.host.engines["tiny"].loaded.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert tiny["kv_bytes_per_token"] == 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 8
    engine = client.app.state.host.engines["tiny"]
    assert tiny["kv_fingerprint"] == engine.fingerprint  # what every block address of this model holds
    assert tiny["kv_layout"] == f"layers=2,kv_heads=2,head_dim={head_dim},dtype=float64"
    assert tiny["weights_digest"] == engine.loaded.digests.weights
    assert tiny["other_replicas"] is None  # no shared store: no other replica to compare with
    assert (tiny["compiled"], tiny["compile_detail"]) == (False, "not asked (--compile false)")
    backend = engine.runner.backend  # float64: the decode kernel's pools (SDPA where no compiler built it)
    assert tiny["attention"] == {"backend": backend.name, "detail": backend.detail}
    assert tiny["attention"]["backend"] in ("kernel", "sdpa")
    held = tiny["resident_bytes"]  # what the model holds, by part (float64: nothing packed, no bf16_gemv copies)
    parts = ("weights", "packed_weights", "gemv_weights", "kv_pool", "head_layouts", "host_tier")
    assert set(held) == {*parts, "total", "kv_pool_touched", "process_rss"}
    assert held["total"] == sum(held[part] for part in parts)
    assert held["weights"] == engine.runner.weights.dense > 0
    assert (held["packed_weights"], held["gemv_weights"]) == (0, 0)
    assert held["kv_pool"] == engine.runner.pool.nbytes
    assert 0 <= held["kv_pool_touched"] <= held["kv_pool"]
    assert held["process_rss"] > held["weights"]
    assert all(value >= 0 for value in held.values())
    missing = client.get("/v1/models/no-such")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def test_delete_session(client):
    chat_turn(client, "gone", [{"role": "user", "content": "Hello"}])
    assert client.delete("/v1/sessions/gone").json()["deleted"] is True
    assert client.get("/v1/sessions/gone").status_code == 404

"""Anthropic's message threads on kvserve's sessions, through the official `anthropic` SDK and raw HTTP.

`thread: {"type": "create"}` keeps the turn as a node of the store keyed by the answer's id; `{"type":
"continue", "previous_message_id": ...}` sends only the new messages and resumes token-exactly from the node's
K/V. Unknown and foreign ids are 404 thread_not_found; each message is continued once.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import anthropic
import httpx
import pytest

from server.serving.threads import THREAD_KIND
from server.sessions.record import SessionKey
from server.settings import Settings
from tests.helpers import DEADLINE_S, wait_until
from tests.http.conftest import serve_live
from tests.http.test_tools import WEATHER

ALICE, BOB = "sk-threads-alice-0001", "sk-threads-bob-00001"
BETA = "message-threads-2026-08-12"
GREEDY = {"temperature": 0}
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER["function"]["parameters"],
}
TIMEOUT = 300.0


@pytest.fixture(scope="module")
def served(tiny_spec, tmp_path_factory):
    twin = dataclasses.replace(tiny_spec, id="tiny-twin")
    settings = Settings(api_keys=f"{ALICE}:alice,{BOB}:bob", state_dir=tmp_path_factory.mktemp("threads-state"))
    with serve_live([tiny_spec, twin], settings) as (base, engine):
        yield base, engine


def sdk(base: str, key: str = ALICE) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)


def create(client: anthropic.Anthropic, messages: list, **fields):
    return client.beta.messages.create(
        model=fields.pop("model", "tiny"), max_tokens=fields.pop("max_tokens", 6), messages=messages,
        betas=[BETA], extra_body=GREEDY, **fields,
    )  # fmt: skip


def node(engine, tenant: str, message_id: str):
    return engine.store.view(SessionKey(tenant, message_id, THREAD_KIND))


def test_a_continue_sends_only_the_new_turn_and_resumes_token_exactly(served):
    base, engine = served
    client = sdk(base)
    first = create(client, [{"role": "user", "content": "Hello there"}], system="Be brief.", thread={"type": "create"})
    held = node(engine, "alice", first.id)
    assert held.extras["status"] == "completed"
    assert first.usage.cache_read_input_tokens == 0
    before = engine.counter.num_prefill_tokens
    second = create(
        client,
        [{"role": "user", "content": "And again?"}],
        thread={"type": "continue", "previous_message_id": first.id},
    )
    computed = engine.counter.num_prefill_tokens - before
    # Everything the thread held but its last token (computed again for its logits) was read from the cache.
    assert second.usage.cache_read_input_tokens == len(held.transcript_ids) - 1
    assert second.usage.input_tokens == computed
    continued = node(engine, "alice", second.id)
    assert continued.parent == first.id
    assert continued.transcript_ids[: len(held.transcript_ids)] == held.transcript_ids  # token-exact
    assert [m["role"] for m in continued.messages] == ["system", "user", "assistant", "user", "assistant"]
    # The very answer those ids give computed afresh (fp32, greedy): the cache changed nothing.
    prompt_ids = continued.transcript_ids[: second.usage.input_tokens + second.usage.cache_read_input_tokens]
    fresh = httpx.post(
        base + "/v1/completions",
        json={"model": "tiny", "prompt": prompt_ids, "max_tokens": 6, "temperature": 0, "cache_prompt": False},
        headers={"Authorization": f"Bearer {ALICE}"},
        timeout=TIMEOUT,
    ).json()
    assert second.content[0].text == fresh["choices"][0]["text"]


def test_unknown_and_foreign_messages_are_thread_not_found(served):
    base, _ = served
    mine = create(sdk(base), [{"role": "user", "content": "Hi"}], thread={"type": "create"})
    for client, previous in ((sdk(base), "msg_" + "0" * 32), (sdk(base), "not-an-id"), (sdk(base, BOB), mine.id)):
        with pytest.raises(anthropic.NotFoundError) as err:
            create(
                client,
                [{"role": "user", "content": "more"}],
                thread={"type": "continue", "previous_message_id": previous},
            )
        assert err.value.error_code == "thread_not_found"  # the SDK replays the conversation as a new thread on it
        assert err.value.body["error"]["details"] == {"error_code": "thread_not_found"}


def test_a_message_is_continued_once_then_the_sdk_is_told_so(served):
    base, _ = served
    client = sdk(base)
    first = create(client, [{"role": "user", "content": "Hi"}], thread={"type": "create"})
    more = [{"role": "user", "content": "more"}]
    create(client, more, thread={"type": "continue", "previous_message_id": first.id})
    with pytest.raises(anthropic.BadRequestError) as err:
        create(client, more, thread={"type": "continue", "previous_message_id": first.id})
    assert err.value.error_code == "thread_already_continued"


def test_a_continue_keeps_the_threads_system_and_tools(served):
    base, engine = served
    client = sdk(base)
    call = create(
        client, [{"role": "user", "content": "Weather in Paris?"}], system="Use tools.", tools=[TOOL],
        tool_choice={"type": "any"}, max_tokens=150, thread={"type": "create"},
    )  # fmt: skip
    assert call.stop_reason == "tool_use"
    use = next(block for block in call.content if block.type == "tool_use")
    result = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    answer = create(client, result, thread={"type": "continue", "previous_message_id": call.id}, max_tokens=4)
    held = node(engine, "alice", call.id)
    assert answer.usage.cache_read_input_tokens == len(held.transcript_ids) - 1  # its tools rendered as before
    assert node(engine, "alice", answer.id).tools == held.tools
    headers = {"x-api-key": ALICE, "anthropic-beta": BETA}
    for name, value in (("system", "Other."), ("tools", [TOOL])):
        body = {
            "model": "tiny", "max_tokens": 2, "messages": result, name: value,
            "thread": {"type": "continue", "previous_message_id": answer.id},
        }  # fmt: skip
        r = httpx.post(base + "/v1/messages", json=body, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 400, r.text
        assert name in r.json()["error"]["message"]


def test_a_thread_is_its_models_and_no_session(served):
    base, _ = served
    client = sdk(base)
    first = create(client, [{"role": "user", "content": "Hi"}], thread={"type": "create"})
    more = [{"role": "user", "content": "more"}]
    with pytest.raises(anthropic.BadRequestError) as err:
        create(client, more, model="tiny-twin", thread={"type": "continue", "previous_message_id": first.id})
    assert err.value.error_code == "thread_fingerprint_mismatch"
    with pytest.raises(anthropic.BadRequestError) as err:
        create(client, more, thread={"type": "create"}, extra_headers={"X-Session-ID": "s1"})
    assert "thread" in err.value.message
    create(client, more, thread={"type": "continue", "previous_message_id": first.id})  # the refusals took nothing


def test_a_turn_that_did_not_complete_leaves_no_node_and_frees_its_parent(served):
    base, engine = served
    client = sdk(base)
    first = create(client, [{"role": "user", "content": "Hi"}], thread={"type": "create"})
    body = {
        "model": "tiny", "max_tokens": 4000, "stream": True, "messages": [{"role": "user", "content": "Go on"}],
        "temperature": 0, "thread": {"type": "continue", "previous_message_id": first.id},
    }  # fmt: skip
    headers = {"x-api-key": ALICE}
    with httpx.stream("POST", base + "/v1/messages", json=body, headers=headers, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        started = next(line for line in lines if line.startswith("data:") and "message_start" in line)
    gone = json.loads(started.removeprefix("data:"))["message"]["id"]  # the client left after it: cancelled
    wait_until(lambda: node(engine, "alice", gone) is None, DEADLINE_S, "the unfinished node to go")
    again = create(
        client, [{"role": "user", "content": "Go on"}], thread={"type": "continue", "previous_message_id": first.id}
    )
    assert node(engine, "alice", again.id).parent == first.id


def test_nodes_survive_a_restart(tiny_spec, tmp_path):
    settings = Settings(state_dir=tmp_path)
    with serve_live([tiny_spec], settings) as (base, _):
        first = create(sdk(base), [{"role": "user", "content": "Remember me"}], thread={"type": "create"})
    with serve_live([tiny_spec], settings) as (base, engine):
        second = create(
            sdk(base),
            [{"role": "user", "content": "Still?"}],
            thread={"type": "continue", "previous_message_id": first.id},
        )
        held = node(engine, "default", first.id)
    assert second.usage.cache_read_input_tokens == len(held.transcript_ids) - 1  # its K/V came back from disk


def test_the_sdks_tool_runner_loops_on_a_thread_on_the_default_model(default_model):
    """`client.beta.messages.tool_runner`, unmodified: it threads by default (create, then continue with only the
    tool results), and from its second step on the thread's K/V is read, not computed."""
    base, model = default_model
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    cities: list[str] = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """The current weather in a city.

        Args:
            city: the city's name, e.g. Paris
        """
        cities.append(city)
        return f"It is sunny in {city} and 22 degrees."

    runner = client.beta.messages.tool_runner(
        model=model, max_tokens=64, tools=[get_weather], tool_choice={"type": "any"}, max_iterations=3,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}], extra_body=GREEDY,
    )  # fmt: skip
    steps = list(runner)
    assert len(steps) == 3
    assert len(cities) == 3  # each step's call ran, its result went back
    for before, step in itertools.pairwise(steps):
        assert step.usage.cache_read_input_tokens > before.usage.cache_read_input_tokens  # the thread, read
        assert step.usage.input_tokens < step.usage.cache_read_input_tokens  # only the new turn computed

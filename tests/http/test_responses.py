"""/v1/responses: stored responses as nodes of a session tree, exact continuation, stream events, the openai client."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseCompletedEvent, ResponseIncompleteEvent

from server.app import create_app
from server.sessions.record import SessionKey
from server.settings import Settings
from tests.helpers import DEADLINE_S, reference_greedy, wait_until, wait_until_async
from tests.http.conftest import wait_ready
from tests.http.test_tools import PERSON

RESPONSES = "/v1/responses"
# A grammar the reply must end in: the response completes (the tiny model alone runs to max_output_tokens)
ENDING = {"text": {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}}


def create(client, **body):
    r = client.post(RESPONSES, json={"model": "tiny", "temperature": 0, "max_output_tokens": 6, **body})
    assert r.status_code == 200, r.text
    return r


def output_text(body: dict) -> str:
    return "".join(part["text"] for item in body["output"] for part in item["content"])


def test_create_get_and_continue_from_the_stored_node(client, tiny):
    first = create(client, input="Hello world", instructions="Be brief.").json()
    assert first["object"] == "response"
    assert first["status"] in ("completed", "incomplete")
    assert first["output"][0]["role"] == "assistant"
    assert first["instructions"] == "Be brief."
    assert client.get(f"{RESPONSES}/{first['id']}").json() == first
    store = client.app.state.host.store
    transcript = store.transcript(SessionKey("default", first["id"], "response"))
    assert len(transcript) == first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    r = create(client, input="Paris is", previous_response_id=first["id"], instructions="Be brief.")
    second = r.json()
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached == len(transcript) - 1
    assert r.headers["X-Cache"] == "partial"  # all of the parent's K/V reused
    prompt = store.transcript(SessionKey("default", second["id"], "response"))[: second["usage"]["input_tokens"]]
    assert prompt[: len(transcript)] == transcript  # token-exact: the parent's ids, then the new input's
    expected = reference_greedy(tiny.model, prompt, second["usage"]["output_tokens"])
    assert output_text(second) == tiny.tokenizer.decode(expected, skip_special_tokens=True)
    assert second["previous_response_id"] == first["id"]


def test_a_retry_branches_from_the_same_parent(client):
    parent = create(client, input="Hello world").json()
    store = client.app.state.host.store
    before = store.transcript(SessionKey("default", parent["id"], "response"))
    a = create(client, input="Paris is", previous_response_id=parent["id"]).json()
    b = create(client, input="Paris is", previous_response_id=parent["id"]).json()
    assert a["id"] != b["id"]
    assert output_text(a) == output_text(b)
    assert a["usage"]["input_tokens"] == b["usage"]["input_tokens"]  # the same prompt: nothing appended twice
    assert b["usage"]["input_tokens_details"]["cached_tokens"] == b["usage"]["input_tokens"] - 1  # a's blocks
    assert store.transcript(SessionKey("default", parent["id"], "response")) == before  # the parent never changes


def test_store_false_is_not_kept_and_unknown_parents_are_404(client):
    r = create(client, input="Hello", store=False).json()
    assert client.get(f"{RESPONSES}/{r['id']}").status_code == 404
    missing = client.post(RESPONSES, json={"model": "tiny", "input": "x", "previous_response_id": r["id"]})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "response_not_found"
    for never_ours in ("resp_nope", "r1", "resp_" + "A" * 32):  # not even a response id: unknown all the same
        for method, path in (("GET", ""), ("GET", "/input_items"), ("DELETE", "")):
            r = client.request(method, f"{RESPONSES}/{never_ours}{path}")
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["error"]["code"] == "response_not_found"
    assert client.get(f"{RESPONSES}/{'r' * 300}").status_code == 400  # bounded in length


@pytest.mark.parametrize("unknown", ["resp_" + "0" * 32, "resp_nope", "r1", "resp_" + "A" * 32, "../etc", " "])
def test_any_previous_response_id_not_stored_is_404_like_openai(client, unknown):
    r = client.post(RESPONSES, json={"model": "tiny", "input": "x", "previous_response_id": unknown})
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": f"no stored response {unknown!r}",
        "type": "not_found_error",
        "param": "previous_response_id",
        "code": "response_not_found",
    }


def test_a_huge_previous_response_id_is_still_refused_by_length(client):
    r = client.post(RESPONSES, json={"model": "tiny", "input": "x", "previous_response_id": "r" * 10_000})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "previous_response_id"
    assert len(r.text) < 2_000  # the id is not echoed back whole


def test_the_openai_client_raises_not_found_for_an_unknown_previous_id(live):
    base, _engine = live
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    for unknown in ("resp_" + "0" * 32, "resp_made_up_by_a_client"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.responses.create(model="tiny", input="x", previous_response_id=unknown, max_output_tokens=2)
        assert caught.value.code == "response_not_found"
        assert caught.value.param == "previous_response_id"


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"tools": [{"type": "web_search"}]}, "tools"), ({"background": True}, "background"), ({"n": 2}, "n")],
)
def test_unimplemented_fields_are_400s_naming_them(client, extra, param):
    r = client.post(RESPONSES, json={"model": "tiny", "input": "x", **extra})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_delete_and_retention(client):
    r = create(client, input="Hello").json()
    assert client.delete(f"{RESPONSES}/{r['id']}").json()["deleted"] is True
    assert client.get(f"{RESPONSES}/{r['id']}").status_code == 404


def test_stored_responses_expire_after_their_retention(tiny_spec):
    with TestClient(create_app(Settings(response_retention_s=0.2), specs=[tiny_spec])) as short:
        wait_ready(short)
        old = create(short, input="Hello again").json()
        assert short.get(f"{RESPONSES}/{old['id']}").status_code == 200
        wait_until(lambda: short.get(f"{RESPONSES}/{old['id']}").status_code == 404, what="the response to expire")


def usage_of(response: Response) -> tuple[int, int, int]:
    """(input, cached, cache_write) tokens, read through the openai SDK's own model of the usage."""
    assert response.usage is not None
    details = response.usage.input_tokens_details
    return response.usage.input_tokens, details.cached_tokens, details.cache_write_tokens


def test_completed_and_incomplete_responses_fit_the_openai_sdks_models(client):
    done = create(client, input="Who is it?", seed=0, temperature=1.0, max_output_tokens=80, **ENDING).json()
    cut = create(client, input="Count the usage", max_output_tokens=1).json()
    assert (done["status"], cut["status"]) == ("completed", "incomplete")
    for body in (done, cut):
        stored = client.get(f"{RESPONSES}/{body['id']}").json()
        for response in (Response.model_validate(body), Response.model_validate(stored)):
            num_input, num_cached, num_written = usage_of(response)
            assert num_written == num_input - num_cached > 0  # computed here, and kept for the next request
    child = Response.model_validate(create(client, input="And then?", previous_response_id=cut["id"]).json())
    num_input, num_cached, num_written = usage_of(child)
    assert num_cached > 0
    assert num_written == num_input - num_cached  # only the new input's tokens were computed (and kept)


def test_a_response_that_keeps_nothing_reports_no_cache_writes(client, tiny_spec):
    body = create(client, input="Not kept anywhere", cache_prompt=False).json()
    assert usage_of(Response.model_validate(body))[1:] == (0, 0)
    with TestClient(create_app(Settings(prefix_caching=False), specs=[tiny_spec])) as uncached:
        wait_ready(uncached)
        for _ in range(2):  # the second would reuse the first's blocks if any were kept
            body = create(uncached, input="Not kept either").json()
            assert usage_of(Response.model_validate(body))[1:] == (0, 0)


@pytest.mark.parametrize(
    ("fields", "final", "model"),
    [
        ({"seed": 0, "temperature": 1.0, "max_output_tokens": 80, **ENDING}, "completed", ResponseCompletedEvent),
        ({"max_output_tokens": 1}, "incomplete", ResponseIncompleteEvent),
    ],
)
def test_the_streams_last_event_fits_the_openai_sdks_model(client, fields, final, model):
    body = {"model": "tiny", "input": f"Streamed to its end: {final}", "stream": True, "temperature": 0, **fields}
    with client.stream("POST", RESPONSES, json=body) as r:
        kind, data = sse(r)[-1]
    assert kind == f"response.{final}"
    response = model.model_validate(data).response
    assert response.status == final
    num_input, num_cached, num_written = usage_of(response)
    assert num_written == num_input - num_cached > 0
    assert Response.model_validate(client.get(f"{RESPONSES}/{response.id}").json()).usage == response.usage


def sse(response) -> list[tuple[str, dict]]:
    events = []
    for block in response.read().decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if line and not line.startswith(":"))
        if lines:
            events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_stream_sends_the_full_event_sequence(client):
    parent = create(client, input="Hello world").json()
    body = {
        "model": "tiny",
        "input": "Paris",
        "stream": True,
        "max_output_tokens": 5,
        "previous_response_id": parent["id"],
    }
    with client.stream("POST", RESPONSES, json=body) as r:
        assert r.headers["X-Cache"] == "partial"
        events = sse(r)
    kinds = [kind for kind, _ in events]
    deltas = [data for kind, data in events if kind == "response.output_text.delta"]
    final = kinds[-1]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final,
    ]
    assert final in ("response.completed", "response.incomplete")
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(kind == data["type"] for kind, data in events)
    done = events[-1][1]["response"]
    assert output_text(done) == "".join(d["delta"] for d in deltas)
    assert done["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert client.get(f"{RESPONSES}/{done['id']}").json()["output"] == done["output"]


def test_official_client_create_and_stream(live):
    base, _engine = live
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    first = client.responses.create(model="tiny", input="Hello world", max_output_tokens=6, temperature=0)
    assert first.output_text
    assert first.usage.input_tokens > 0
    again = client.responses.create(
        model="tiny", input="Paris is", previous_response_id=first.id, max_output_tokens=6, temperature=0
    )
    assert again.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert client.responses.retrieve(again.id).output_text == again.output_text
    seen, text = [], ""
    with client.responses.stream(
        model="tiny", input="More", previous_response_id=again.id, max_output_tokens=40, temperature=0
    ) as stream:
        for event in stream:
            seen.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
    assert seen[0] == "response.created"
    assert seen[-1] in ("response.completed", "response.incomplete")
    # The last event's response, either way (the SDK's get_final_response() only takes response.completed)
    assert event.response.status == seen[-1].removeprefix("response.")
    assert event.response.output_text == text
    if seen[-1] == "response.completed":
        assert stream.get_final_response().output_text == text
    assert client.responses.retrieve(again.id).id == again.id


def wait_idle(engine) -> None:
    wait_until(lambda: engine.num_active == 0, what="generation to stop after the client left")


async def test_a_client_that_leaves_stops_its_response(live):
    base, engine = live
    body = {"model": "tiny", "input": "Paris is", "max_output_tokens": 3000, "temperature": 0}  # no early end
    before = engine.counter.num_decode_tokens
    async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S) as client:
        sent = asyncio.create_task(client.post(RESPONSES, json=body))
        await wait_until_async(lambda: engine.counter.num_decode_tokens > before, what="decoding to start")
        sent.cancel()  # the client leaves mid-generation
        with contextlib.suppress(asyncio.CancelledError):
            await sent
    await asyncio.to_thread(wait_idle, engine)
    assert engine.counter.num_decode_tokens - before < 3000  # stopped, not run to its end
    with httpx.stream("POST", base + RESPONSES, json=body | {"stream": True}, timeout=DEADLINE_S) as r:
        lines = r.iter_lines()
        created = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
    wait_idle(engine)
    # An abandoned response is not kept: nothing could continue from it.
    assert httpx.get(f"{base}{RESPONSES}/{created['response']['id']}").status_code == 404

"""/openapi.json says what the server does, and /docs works offline from a package's files."""

from __future__ import annotations

import re

import pytest
from openapi_spec_validator import OpenAPIV31SpecValidator


@pytest.fixture(scope="module")
def document(client) -> dict:
    return client.get("/openapi.json").json()


def test_the_document_is_valid_openapi_3_1(document):
    assert document["openapi"].startswith("3.1.")
    problems = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in OpenAPIV31SpecValidator(document).iter_errors()
    ]
    assert not problems, "\n".join(problems)


def test_errors_are_400s_in_the_envelope_never_422(document):
    text = str(document)
    assert "'422'" not in text
    assert "HTTPValidationError" not in document["components"]["schemas"]
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    for status in ("400", "401", "404", "409", "413", "429", "503"):
        assert chat[status]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    assert "Retry-After" in chat["429"]["headers"]
    error = document["components"]["schemas"]["Error"]["properties"]["error"]
    assert error["required"] == ["message", "type", "param", "code"]
    models = document["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    assert "404" in models
    assert "409" not in models  # only what the route can answer


def test_streams_sessions_and_keys_are_documented(document):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        operation = document["paths"][path]["post"]
        events = operation["responses"]["200"]["content"]["text/event-stream"]
        assert "with stream: true" in events["schema"]["description"]  # the event format, where 3.1 allows it
        assert any(p["name"] == "X-Session-ID" and p["in"] == "header" for p in operation["parameters"])
        assert "X-Session-ID" in operation["responses"]["200"]["headers"]
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "an API key (KVSERVE_API_KEYS)",
    }
    assert document["paths"]["/health"]["get"]["security"] == []


def test_no_field_is_listed_that_the_server_refuses(document, client):
    chat = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for refused in ("n", "functions", "audio", "modalities", "prediction", "store", "metadata", "best_of"):
        assert refused not in chat, refused
    for accepted in ("tools", "tool_choice", "response_format", "session_id", "prompt_cache_key"):
        assert accepted in chat, accepted
    responses = document["components"]["schemas"]["ResponseRequest"]["properties"]
    assert "background" not in responses
    assert "tools" in responses
    completions = document["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "tools" not in completions
    assert "response_format" in completions


def test_previous_response_id_promises_what_the_server_answers(document):
    """Any id not stored is a 404 (listed), so the document holds no id pattern that would promise a 400."""
    field = document["components"]["schemas"]["ResponseRequest"]["properties"]["previous_response_id"]
    (text,) = [option for option in field["anyOf"] if option.get("type") == "string"]
    assert "pattern" not in text
    assert text["maxLength"] == 256  # a longer one is still refused (400)
    assert "404" in field["description"]
    responses = document["paths"]["/v1/responses"]["post"]["responses"]
    assert "response_not_found" in responses["404"]["description"]


def test_docs_load_their_files_from_this_server(client):
    page = client.get("/docs").text
    sources = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert sources
    assert not [s for s in sources if s.startswith(("http:", "https:", "//"))]  # no CDN: it works offline
    for source in sources:
        assert client.get(source).status_code == 200, source
    script = client.get("/docs/static/swagger-ui-bundle.js")
    assert "SwaggerUIBundle" in script.text[:2000]


def test_a_refused_request_counts_as_a_failure_and_latency_buckets_reach_minutes(client):
    before = _failures(client, "invalid_parameter")
    assert (
        client.post("/v1/chat/completions", json={"model": "tiny", "messages": [], "max_tokens": 1}).status_code == 400
    )
    assert _failures(client, "invalid_parameter") == before + 1
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=ok).status_code == 200
    metrics = client.get("/metrics").text
    assert 'kvserve:e2e_request_latency_seconds_bucket{le="1800.0",model="tiny"}' in metrics


def _failures(client, code: str) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("kvserve:request_failure_total{") and f'code="{code}"' in line:
            total += float(line.split()[-1])
    return total

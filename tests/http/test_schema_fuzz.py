"""Schemathesis against /openapi.json: every operation, positive and negative inputs, on the tiny model.

No answer may be a 5xx except the documented 503 states, and every error keeps the OpenAI
envelope. max_tokens is capped in the schema (KVSERVE_MAX_TOKENS_LIMIT) so generated
requests stay short.
"""

from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode

from server.settings import Settings
from tests.http.conftest import serve_live

DOCUMENTED_503 = {"not_ready", "shutting_down", "out_of_memory"}
EXAMPLES_PER_OPERATION = 25


@pytest.fixture(scope="module")
def api_schema(tiny_spec):
    settings = Settings(default_max_tokens=4, max_tokens_limit=8, request_timeout_s=30)
    with serve_live([tiny_spec], settings) as (base, _engine):
        yield schemathesis.openapi.from_url(base + "/openapi.json")


def operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_no_undocumented_server_errors(api_schema, mode):
    # Driven by hand with Hypothesis (schemathesis' pytest plugin does not load with this pytest).
    checked = []
    for operation in operations(api_schema):

        @hypothesis.settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(hypothesis.HealthCheck),
        )
        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        def check(case) -> None:
            response = case.call(timeout=60)
            if response.status_code < 400:
                return
            body = response.json()
            if case.path.startswith("/v1/messages"):  # Anthropic's envelope, for Anthropic's clients
                assert body["type"] == "error", (case.method, case.path, body)
                assert set(body["error"]) == {"message", "type", "code"}, (case.method, case.path, body)
            else:
                assert set(body["error"]) == {"message", "type", "param", "code"}, (case.method, case.path, body)
            assert len(body["error"]["message"]) <= 512
            if response.status_code >= 500:
                documented = response.status_code == 503 and body["error"]["code"] in DOCUMENTED_503
                assert documented, (case.method, case.path, case.body, body)

        try:
            check()
        except hypothesis.errors.Unsatisfiable:
            assert mode == GenerationMode.NEGATIVE  # an operation with no inputs has no invalid ones
        checked.append(f"{operation.method.upper()} {operation.path}")
    assert len(checked) >= 15, checked  # every operation of the API, not a subset

"""Every answer names the replica that gave it (X-Kvserve-Replica), errors and refusals included."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from server.app import create_app
from server.settings import Settings
from tests.http.conftest import wait_ready


def test_every_answer_names_its_replica(tiny_spec):
    app = create_app(Settings(replica_id="replica-7", api_keys="key-alice-1:alice"), specs=[tiny_spec])
    with TestClient(app) as client:
        wait_ready(client)
        key = {"Authorization": "Bearer key-alice-1"}
        body = {"model": tiny_spec.id, "prompt": "Paris is", "max_tokens": 2}
        answers = [
            client.get("/health"),
            client.post("/v1/completions", json=body, headers=key),
            client.post("/v1/completions", json=body),  # 401: no key
            client.get("/v1/sessions/nope", headers=key),  # 404
        ]
    assert [r.status_code for r in answers] == [200, 200, 401, 404]
    assert {r.headers.get("x-kvserve-replica") for r in answers} == {"replica-7"}


def test_the_replica_id_defaults_to_the_host_name_and_must_be_a_token():
    import socket

    assert Settings().replica_id == socket.gethostname()
    with pytest.raises(ValidationError):
        Settings(replica_id="two words")

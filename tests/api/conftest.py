from __future__ import annotations

import dataclasses
import time

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings


def wait_ready(client: TestClient, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, client.get("/ready").json()
        time.sleep(0.02)


@pytest.fixture(scope="module")
def client(tiny_spec):
    """An app serving the tiny model twice under two ids (for session_model_mismatch)."""
    twin = dataclasses.replace(tiny_spec, id="tiny-twin")
    app = create_app(Settings(default_max_tokens=16), specs=[tiny_spec, twin])
    with TestClient(app) as c:
        wait_ready(c)
        yield c


@pytest.fixture()
def engine(client):
    return client.app.state.host.engines["tiny"]

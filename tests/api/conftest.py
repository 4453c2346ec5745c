from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time

import httpx
import pytest
import uvicorn
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


@contextlib.contextmanager
def serve_live(specs, settings: Settings):
    """A real uvicorn server in a thread: real disconnects and real concurrency (TestClient has neither)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(settings, specs=specs)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(base + "/ready").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        yield base, app.state.host.engines[specs[0].id]
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def live(tiny_spec):
    with serve_live([tiny_spec], Settings()) as served:
        yield served

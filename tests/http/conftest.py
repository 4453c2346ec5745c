from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from server.app import create_app
from server.models.loader import read_specs
from server.settings import Settings
from tests.helpers import DEADLINE_S, wait_until

ROOT = Path(__file__).resolve().parents[2]


def wait_ready(client: TestClient, timeout_s: float = DEADLINE_S) -> None:
    wait_until(lambda: client.get("/ready").status_code == 200, timeout_s, "the app to be ready")


def is_ready(base: str) -> bool:
    try:
        return httpx.get(base + "/ready").status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def client(tiny_spec):
    """An app serving the tiny model twice under two ids (for session_model_mismatch)."""
    twin = dataclasses.replace(tiny_spec, id="tiny-twin")
    app = create_app(Settings(default_max_tokens=16), specs=[tiny_spec, twin])
    with TestClient(app) as c:
        wait_ready(c)
        yield c


@pytest.fixture
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
    wait_until(lambda: is_ready(base), DEADLINE_S, "the server to be ready")
    try:
        yield base, app.state.host.engines[specs[0].id]
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def live(tiny_spec):
    with serve_live([tiny_spec], Settings()) as served:
        yield served


@pytest.fixture(scope="session")
def default_model():
    """The default model (SmolLM2-135M-Instruct, converted once under models/cache by `make install`) on a live
    server, shared by the tests that need what a real model does: (base URL, model id)."""
    specs = read_specs(ROOT / "models" / "models.toml")
    with serve_live(specs, Settings(cache_dir=ROOT / "models" / "cache")) as (base, _engine):
        yield base, specs[0].id

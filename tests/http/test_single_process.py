"""Without KVSERVE_SHARED_URL nothing of the scale-out runs: a session's turns, listing, fork and delete
work as before and Redis is never even imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from fastapi.testclient import TestClient
    from server.app import create_app
    from server.settings import Settings
    from tests.helpers import wait_until
    from tests.tiny import save_tiny

    spec = save_tiny(Path(sys.argv[1]))
    app = create_app(Settings(state_dir=Path(sys.argv[1]) / "state"), specs=[spec])
    with TestClient(app) as client:
        wait_until(lambda: client.get("/ready").status_code == 200, what="the tiny model to load")
        messages = [{"role": "user", "content": "Hi"}]
        for _ in range(2):  # two turns: the second continues the first
            body = {"model": spec.id, "messages": messages, "max_tokens": 3}
            r = client.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "s"})
            assert r.status_code == 200
            reply = {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
            messages = [*messages, reply, {"role": "user", "content": "More"}]
        assert client.get("/v1/sessions/s").json()["turns"] == 2
        assert client.post("/v1/sessions/s/fork", json={}).status_code == 201
        assert client.delete("/v1/sessions/s").status_code == 200
        assert app.state.host.tiers.shared is None and app.state.host.store.shared is None
    print("redis" in sys.modules)
    """
)


def test_one_process_never_touches_redis(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False"

"""docker/scale/nginx.conf in front of real kvserve replicas (tiny model), nginx itself really running.

A session's requests stay on one replica (consistent hash of X-Session-ID); requests without the
header are spread round-robin; adding a replica moves only the sessions whose place on the ring it
takes, and each session it takes continues exactly there, its record and K/V read from Redis; a killed
replica is marked down and its requests (which never reached it) go to the next one. A POST already written
to a replica that then dies unanswered is sent to the next one too (never a 502), and a turn it had
committed is replaced, not repeated. No nginx master or worker outlives a test.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
import pytest

from server.__main__ import KEEP_ALIVE_S
from tests.e2e.cluster import ROOT, Nginx, Redis, queued_bytes, replica
from tests.e2e.server import Server, _kill_leftovers, end_all, group_members  # noqa: F401 - the fixture is autouse
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e
SESSIONS = [f"conv-{i}" for i in range(30)]


def post_chat(
    base: str, sid: str | None, messages: list[dict], model: str = "model", bias: dict | None = None
) -> httpx.Response:
    body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    body |= {"logit_bias": bias} if bias else {}
    headers = {"X-Session-ID": sid} if sid else {}
    return httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def chat(base: str, sid: str, messages: list[dict], model: str = "model", bias: dict | None = None) -> httpx.Response:
    r = post_chat(base, sid, messages, model, bias)
    assert r.status_code == 200, r.text
    return r


def text(r: httpx.Response) -> str:
    return r.json()["choices"][0]["message"]["content"]


def test_sessions_stick_to_a_replica_through_a_new_one_and_a_dead_one(model_dir, tmp_path):
    store = Redis(tmp_path)
    a, b = replica(model_dir, tmp_path, "a", store.url), replica(model_dir, tmp_path, "b", store.url)
    nginx = Nginx(tmp_path / "nginx", [a, b])

    home = {s: nginx.replica_of(s) for s in SESSIONS}
    assert {s: nginx.replica_of(s) for s in SESSIONS} == home  # the same replica every time
    assert set(home.values()) == {"a", "b"}
    spread = [nginx.replica_of(None) for _ in range(6)]
    assert sorted(spread) == ["a", "a", "a", "b", "b", "b"]  # round-robin without the header

    # A real streamed turn through the proxy: tokens arrive as separate events, from the session's home.
    body = {"model": "model", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}
    body |= {"stream": True, "ignore_eos": True, "temperature": 0}
    with httpx.stream(
        "POST", nginx.base + "/v1/chat/completions", json=body, headers={"X-Session-ID": SESSIONS[0]}, timeout=60
    ) as r:
        assert r.status_code == 200
        assert r.headers["x-kvserve-replica"] == home[SESSIONS[0]]
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert len(events) >= 6
    assert events[-1] == "data: [DONE]"

    first = {s: [{"role": "user", "content": f"Hello {s}"}] for s in SESSIONS}
    replies = {s: text(chat(nginx.base, s, first[s])) for s in SESSIONS}  # turn 1, each on its home replica

    c = replica(model_dir, tmp_path, "c", store.url)
    nginx.reload([a, b, c])
    nginx.wait(lambda: "c" in {nginx.replica_of(None) for _ in range(3)}, "the new replica to take requests")
    moved = {s: nginx.replica_of(s) for s in SESSIONS}
    changed = [s for s in SESSIONS if moved[s] != home[s]]
    assert all(moved[s] == "c" for s in changed)  # only sessions whose place the new replica took
    assert 0 < len(changed) < len(SESSIONS) * 2 / 3

    # Each moved session continues exactly on c, from Redis: the reply a session run wholly on a gives.
    for s in changed:
        second = [*first[s], {"role": "assistant", "content": replies[s]}, {"role": "user", "content": "More"}]
        r = chat(nginx.base, s, second)
        assert (r.headers["x-kvserve-replica"], r.headers["x-cache-source"]) == ("c", "shared")
        chat(a.base, f"ref-{s}", first[s])
        assert text(r) == text(chat(a.base, f"ref-{s}", second))

    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(30)
    # The very next request, a turn of a session b held, while nginx still kept idle connections to b:
    # answered by the next replica on the ring.
    orphan = next(s for s in SESSIONS if moved[s] == "b")
    second = [*first[orphan], {"role": "assistant", "content": replies[orphan]}, {"role": "user", "content": "On"}]
    assert chat(nginx.base, orphan, second).headers["x-kvserve-replica"] in {"a", "c"}
    assert {nginx.replica_of(None) for _ in range(9)} <= {"a", "c"}  # every request answered, none by b
    after = {s: nginx.replica_of(s) for s in SESSIONS}
    assert all(after[s] == moved[s] for s in SESSIONS if moved[s] != "b")  # the others stay home
    assert {after[s] for s in SESSIONS if moved[s] == "b"} <= {"a", "c"}


def session_of(base: str, sid: str) -> dict:
    r = httpx.get(f"{base}/v1/sessions/{sid}", headers={"X-Session-ID": sid}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def ascii_only(model_dir: Path) -> dict[str, int]:
    """A logit bias that keeps the tiny model to tokens of printable ASCII text: its replies then survive a render as
    text and back token for token, as a real model's do (its random bytes otherwise split characters)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    return {str(i): -100 for i, t in texts.items() if not (t.isascii() and t.isprintable())}


def test_a_post_written_to_a_replica_that_dies_unanswered_goes_to_the_next_one(model_dir, tmp_path):
    """Requests nginx has already written to b (b stopped, so they wait unread in its sockets: on the idle
    connections nginx keeps to it, or new ones) when b is SIGKILLed: each is sent to a, never answered 502.
    Two session turns (one b never ran; one b had committed before it died, its answer lost) and one without a
    session. Each session then holds its turn once: the conversation the client was answered."""
    store = Redis(tmp_path)
    bias = ascii_only(model_dir)
    a, b = (replica(model_dir, tmp_path, r, store.url) for r in "ab")
    nginx = Nginx(tmp_path / "nginx", [a, b])
    fresh, committed = [s for s in SESSIONS if nginx.replica_of(s) == "b"][:2]
    first = {s: [{"role": "user", "content": f"Say hello to {s}."}] for s in (fresh, committed)}
    second = {}
    for s in (fresh, committed):  # turn 1 on b, through nginx: it keeps the connection to b open, idle
        r = chat(nginx.base, s, first[s], bias=bias)
        assert r.headers["x-kvserve-replica"] == "b"
        second[s] = [*first[s], {"role": "assistant", "content": text(r)}, {"role": "user", "content": "And?"}]
    chat(b.base, committed, second[committed], bias=bias)  # committed on b; its client never hears the answer
    assert session_of(b.base, committed)["turns"] == 2
    wait_until(lambda: nginx.replica_of(None) == "a", 60, "round-robin to make b the next pick")
    assert nginx.replica_of(fresh) == "b"  # both pools have just used a connection to b, kept open idle

    b.proc.send_signal(signal.SIGSTOP)
    sends = {
        fresh: lambda: post_chat(nginx.base, fresh, second[fresh], bias=bias),
        committed: lambda: post_chat(nginx.base, committed, second[committed], bias=bias),
        "stateless": lambda: post_chat(nginx.base, None, first[fresh], bias=bias),
    }
    answers: dict[str, httpx.Response] = {}
    threads = [threading.Thread(target=lambda k=k, f=f: answers.__setitem__(k, f())) for k, f in sends.items()]
    for thread in threads:
        thread.start()
    wait_until(lambda: sum(n > 0 for n in queued_bytes(b.port)) == 3, 60, "nginx to write the 3 requests to b")
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(30)
    for thread in threads:
        thread.join(120)
    assert {k: (r.status_code, r.headers.get("x-kvserve-replica")) for k, r in answers.items()} == {
        k: (200, "a") for k in sends
    }, {k: r.text[:300] for k, r in answers.items()}

    for s in (fresh, committed):
        session = session_of(nginx.base, s)
        # The record's transcript is the prompt a answered and that answer: b's committed turn 2 is not kept
        # beside it. Its turns: 1 and 2.
        assert session["transcript_tokens"] == answers[s].json()["usage"]["total_tokens"]
        assert session["turns"] == 2
        third = [*second[s], {"role": "assistant", "content": text(answers[s])}, {"role": "user", "content": "Go."}]
        r = chat(nginx.base, s, third, bias=bias)  # continues that very transcript: all of it but its last token cached
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == session["transcript_tokens"] - 1
        assert session_of(nginx.base, s)["turns"] == session["turns"] + 1


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_no_nginx_process_outlives_the_cleanup(model_dir, tmp_path):
    """The fixture every e2e test ends with kills nginx's process group: master and workers (a SIGKILLed master
    alone leaves its workers running, still listening)."""
    nginx = Nginx(tmp_path / "nginx", [Server(model_dir, tmp_path / "a", tmp_path / "a.log")])
    processes = group_members(nginx.proc.pid)
    assert nginx.proc.pid in processes, processes
    assert len(processes) >= 2, processes  # the master and its worker
    end_all()
    assert [pid for pid in processes if running(pid)] == []
    with pytest.raises(httpx.TransportError):
        httpx.get(nginx.base + "/health", timeout=10)


def test_nginx_lets_idle_connections_go_before_the_replicas_do():
    """nginx must never write a request into a connection the replica is closing as idle: its upstream
    keepalive_timeout stays below the replicas' own (server/__main__.py)."""
    config = (ROOT / "docker" / "scale" / "upstreams.conf").read_text()
    blocks = config.split("upstream ")[1:]
    assert len(blocks) == 2
    for block in blocks:
        timeouts = [line.split()[1] for line in block.splitlines() if line.strip().startswith("keepalive_timeout")]
        assert len(timeouts) == 1, block
        assert timeouts[0].endswith("s;"), block
        assert float(timeouts[0].removesuffix("s;")) < KEEP_ALIVE_S

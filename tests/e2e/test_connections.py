"""No one can freeze the server, key or no key: slow sockets beyond the descriptor limit, slow headers, slow bodies.

A real server process under a low open-files limit (256: the server keeps at most 128 connections), so the
flood fits in a test.
"""

from __future__ import annotations

import contextlib
import resource
import socket

import httpx
import pytest

from tests.e2e.server import Server, _kill_leftovers  # noqa: F401 - the fixture is autouse
from tests.helpers import DEADLINE_S, wait_until

pytestmark = pytest.mark.faults


PARTIAL_HEADER = b"GET /health HTTP/1.1\r\nHost: slow\r\nX-Slow: "  # never finished


def slow_socket(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(PARTIAL_HEADER)
    return sock


def is_closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1024) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_more_slow_sockets_than_descriptors_never_freeze_the_server(model_dir, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))  # this test holds 400 sockets
    server = Server(model_dir, tmp_path / "state", tmp_path / "log.txt", {"KVSERVE_HEADER_TIMEOUT_S": "600"}, 256)
    sockets = []
    try:
        for _ in range(400):  # more than the server could ever hold open (256 descriptors)
            sockets.append(slow_socket(server.port))
        # Answered long before the header deadline (600 s) of the connections it waits behind: the oldest
        # waiting connections made room (the client's timeout is the bound, and it is far below that deadline).
        r = httpx.get(server.base + "/health", timeout=DEADLINE_S)
        assert r.status_code == 200
        body = {"model": "model", "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(server.base + "/v1/completions", json=body, timeout=30).status_code == 200
        assert is_closed_by_peer(sockets[0], 10)  # the oldest slow socket was closed to make room
    finally:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
        server.stop(15)
    log = (tmp_path / "log.txt").read_text()
    assert "at most 128 open connections" in log
    assert log.count("out of system resource") <= 3  # never the flood of one line per failed accept()


def test_slow_headers_are_closed_and_slow_bodies_answered_408(model_dir, tmp_path):
    env = {"KVSERVE_HEADER_TIMEOUT_S": "1", "KVSERVE_BODY_TIMEOUT_S": "1"}
    server = Server(model_dir, tmp_path / "state", tmp_path / "log.txt", env)
    try:
        with slow_socket(server.port) as sock:
            assert is_closed_by_peer(sock, 15)  # a header that never ends: closed after its 1 s
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(head + b"Content-Length: 100\r\n\r\n" + b'{"model": ')  # and then nothing
            sock.settimeout(15)
            answer = b""
            while chunk := sock.recv(4096):  # the server closes the connection after its answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408")
            assert b'"body_timeout"' in answer
        wait_until(lambda: httpx.get(server.base + "/health").status_code == 200, 10, "the server to answer")
    finally:
        server.stop(15)


def sent_and_read(port: int, request: bytes, half_close: bool = False) -> bytes:
    """All the server sent back on a connection (b"" for nothing) until it closed it."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as sock:
        sock.sendall(request)
        if half_close:
            sock.shutdown(socket.SHUT_WR)  # the client is done sending: the body will never be whole
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(4096):
                answer += chunk
        return answer


def test_the_log_and_metrics_record_the_status_the_client_was_sent(model_dir, tmp_path):
    """uvicorn answers a body it cannot read (malformed chunked framing) 400 itself, after the gate started on the
    request; a client that leaves before a body is whole is sent nothing. Neither is a 5xx in the access log or in
    /metrics: the status there is the one on the wire (499, nginx's, where nothing was sent)."""
    server = Server(model_dir, tmp_path / "state", tmp_path / "log.txt")
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-ID: {}\r\n{}\r\n"
    chunked = "Transfer-Encoding: chunked\r\n"
    cases = {  # request id: (request, half close, status on the wire)
        "bad-chunk-size": (head.format("bad-chunk-size", chunked).encode() + b"zz\r\n{}\r\n0\r\n\r\n", False, 400),
        "chunk-overrun": (head.format("chunk-overrun", chunked).encode() + b"2\r\n{}}\r\n0\r\n\r\n", False, 400),
        "short-body": (head.format("short-body", "Content-Length: 100\r\n").encode() + b'{"model": ', True, 499),
    }
    try:
        for request_id, (request, half_close, status) in cases.items():
            answer = sent_and_read(server.port, request, half_close)
            on_wire = int(answer.split(b" ", 2)[1]) if answer else 499
            assert on_wire == status, (request_id, answer[:200])
            line = f"request={request_id} "
            wait_until(lambda line=line: line in server.log_path.read_text(), what=f"the access log line of {line}")
            (logged,) = [row for row in server.log_path.read_text().splitlines() if line in row]
            assert f" POST unmatched {status} " in logged, logged
        metrics = httpx.get(server.base + "/metrics", timeout=DEADLINE_S).text
        assert 'kvserve:http_requests_total{route="unmatched",status="400"} 2.0' in metrics
        assert 'kvserve:http_requests_total{route="unmatched",status="499"} 1.0' in metrics
        assert 'route="unmatched",status="5' not in metrics  # no false 5xx alarm
    finally:
        server.stop(15)

"""Clients that hold connections or worker threads (found by a security review of ``serve``).

* uvicorn waited forever for a first request, for the rest of a head and for a declared
  body: a few thousand connections that sent nothing (from anyone who could reach the
  port, no token needed) used up the server's file descriptors, ``GET /health`` timed out
  and asyncio's accept errors flooded stderr. Now a request's head must arrive within
  ``AGENTFOLD_HTTP_HEAD_WAIT`` s (10) and its body within ``AGENTFOLD_HTTP_BODY_WAIT`` s (60)
  more, else the connection is closed; a request being answered (a long poll) is not.
* ``GET /health`` shared the 256 worker threads of every request: 300 long polls made a
  liveness probe wait 17 s. It has threads of its own now.
* ``serve`` warns about a short token and about plain HTTP on an address that is not loopback.
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
from pathlib import Path

import httpx

from tests.http_api.support import TOKEN, ApiServer, start_server
from tests.test_cli import ROOT, Ran, agentfold, ok

DEMO = ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json"
HEAD_WAIT = 1.0
BODY_WAIT = 2.0
DEADLINES = {"AGENTFOLD_HTTP_HEAD_WAIT": str(HEAD_WAIT), "AGENTFOLD_HTTP_BODY_WAIT": str(BODY_WAIT)}


def _connect(server: ApiServer) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def _closed_after(server: ApiServer, sent: bytes) -> float:
    """Connect, send ``sent``, then the seconds from the connection to the server closing it
    (it answers nothing)."""
    with _connect(server) as conn:
        started = time.monotonic()
        if sent:
            conn.sendall(sent)
        assert conn.recv(65536) == b"", "the server answered a request it had not received whole"
        return time.monotonic() - started


def _exchange(conn: socket.socket, request: bytes) -> bytes:
    """Send one request on ``conn`` and read its whole response (Content-Length framed)."""
    conn.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"the server closed the connection: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = conn.recv(65536)
        assert chunk, "the server closed the connection in a response"
        body += chunk
    return head


def test_connections_that_do_not_send_a_whole_request_in_time_are_closed_and_answered_ones_are_not(
    tmp_path: Path,
) -> None:
    server = start_server(f"sqlite:///{tmp_path / 'agentfold.db'}", tmp_path, env=DEADLINES)
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            waits = [
                pool.submit(_closed_after, server, b""),
                pool.submit(_closed_after, server, b"GET /health HTTP/1.1\r\nHost: te"),
                pool.submit(_closed_after, server, (
                    f"POST /runs HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {TOKEN}\r\n"
                    "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{").encode()),
            ]
            idle_s, head_s, body_s = (w.result(timeout=60) for w in waits)
        assert HEAD_WAIT * 0.8 <= idle_s < HEAD_WAIT + 4, idle_s
        assert HEAD_WAIT * 0.8 <= head_s < HEAD_WAIT + 4, head_s
        # The head came at once: the body had its own BODY_WAIT seconds more.
        assert HEAD_WAIT + BODY_WAIT * 0.8 <= body_s < HEAD_WAIT + BODY_WAIT + 4, body_s

        # A client that keeps its connection and sends whole requests is never cut, however long
        # it stays; neither is a request whose answer takes longer than the deadlines (a long poll).
        # One raw connection (an HTTP client library would reconnect behind our back).
        with _connect(server) as conn:
            get = f"GET /health HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
            started = time.monotonic()
            while time.monotonic() - started < HEAD_WAIT * 3:
                assert _exchange(conn, get).startswith(b"HTTP/1.1 200")
                time.sleep(HEAD_WAIT * 0.6)
            poll = (f"GET /runs?min_position={10**9}&wait={HEAD_WAIT + BODY_WAIT + 1:g} HTTP/1.1\r\nHost: test\r\n"
                    f"Authorization: Bearer {TOKEN}\r\n\r\n").encode()
            polled = time.monotonic()
            assert _exchange(conn, poll).startswith(b"HTTP/1.1 200")
            assert time.monotonic() - polled >= HEAD_WAIT + BODY_WAIT
            assert _exchange(conn, get).startswith(b"HTTP/1.1 200")  # the same connection, still open
    finally:
        server.stop()


def test_health_answers_at_once_while_long_polls_hold_every_worker_thread(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    server = start_server(store, tmp_path)
    polls = 300  # more than the 256 worker threads
    try:
        with concurrent.futures.ThreadPoolExecutor(polls) as pool:
            def long_poll(_: int) -> int:
                # Each waits (up to 60 s) for a first event that only comes once /health was timed.
                with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"},
                                  timeout=120) as c:
                    return c.get("/runs", params={"min_position": 1, "wait": 60}).status_code

            answered = pool.map(long_poll, range(polls))
            # Until every worker thread is taken, a cheap authenticated read answers at once.
            deadline = time.monotonic() + 30
            while True:
                try:
                    httpx.get(server.url + "/runs", params={"limit": 1}, timeout=1.0,
                              headers={"Authorization": f"Bearer {TOKEN}"})
                except httpx.TimeoutException:
                    break  # the worker threads are all waiting now
                assert time.monotonic() < deadline, "the long polls never took every worker thread"
                time.sleep(0.2)
            try:
                started = time.monotonic()
                health = httpx.get(server.url + "/health", timeout=30)
                took = time.monotonic() - started
            finally:
                # A first event (another process's run; the server's threads are all taken) ends
                # the long polls now rather than after their wait.
                first_event = agentfold("run", str(DEMO), "--start-id", "after-health", store=store)
            assert health.status_code == 200
            assert took < 3.0, f"/health took {took:.1f} s behind the long polls"
            ok(first_event)
            assert set(answered) == {200}
    finally:
        server.stop()


def _serve_stderr(tmp_path: Path, *args: str, token: str = TOKEN, env: dict[str, str] | None = None) -> str:
    server = start_server(f"sqlite:///{tmp_path / 'agentfold.db'}", tmp_path, *args,
                          env={"AGENTFOLD_API_TOKEN": token, **(env or {})})
    server.stop()
    return server.logs()


def test_serve_warns_about_a_short_token_and_plain_http_beyond_loopback_and_refuses_bad_deadlines(
    tmp_path: Path,
) -> None:
    quiet = _serve_stderr(tmp_path)
    assert "warning" not in quiet, quiet
    short = _serve_stderr(tmp_path, token="12345")
    assert "warning: AGENTFOLD_API_TOKEN is 5 characters long" in short
    everywhere = _serve_stderr(tmp_path, "--host", "0.0.0.0")
    assert "warning: serving plain HTTP on 0.0.0.0" in everywhere
    for token in ("tökén-" + "x" * 20, "two words and more", " padded-token-0123456789 "):
        ran = agentfold("serve", "--port", "0", store=f"sqlite:///{tmp_path / 'agentfold.db'}",
                        env={"AGENTFOLD_API_TOKEN": token}, timeout=60)
        assert ran.code == 2 and "http.token_invalid" in ran.stderr, (ran.code, ran.stderr)
    for name, value in (("AGENTFOLD_HTTP_HEAD_WAIT", "soon"), ("AGENTFOLD_HTTP_BODY_WAIT", "0")):
        ran: Ran = agentfold("serve", "--port", "0", store=f"sqlite:///{tmp_path / 'agentfold.db'}",
                             env={"AGENTFOLD_API_TOKEN": TOKEN, name: value}, timeout=60)
        assert ran.code == 2 and ran.stdout == "", (ran.code, ran.stdout, ran.stderr)
        assert f"http.setting_invalid: {name}=" in ran.stderr

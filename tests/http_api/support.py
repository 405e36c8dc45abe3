"""A real ``agentfold serve`` process and a real HTTP client for the HTTP API tests.

The server runs as a child process (``python -m agentfold.adapters.cli serve --port 0 --json``);
its first stdout line says where it listens. Tests talk to it with httpx only and
stop it with SIGTERM, which must end it cleanly (exit status 0).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "token-" + uuid.uuid4().hex
PROBLEM_JSON = "application/problem+json"


@dataclass
class ApiServer:
    proc: subprocess.Popen[str]
    url: str
    store: str
    log: Path
    started: dict[str, Any]
    clients: list[httpx.Client] = field(default_factory=list)

    def client(self, token: str | None = TOKEN, **headers: str) -> httpx.Client:
        auth = {"Authorization": f"Bearer {token}"} if token is not None else {}
        client = httpx.Client(base_url=self.url, headers={**auth, **headers}, timeout=60.0)
        self.clients.append(client)
        return client

    def stop(self) -> tuple[int, str]:
        """SIGTERM, then the exit status and what it printed last (its final JSON line)."""
        for client in self.clients:
            client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
                raise AssertionError(f"the server ignored SIGTERM for 30 s\n{self.log.read_text()}") from None
        rest = self.proc.stdout.read() if self.proc.stdout is not None else ""
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode, rest

    def logs(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


#: ``python -m`` what runs ``agentfold``: agentfold's own console script.
ENTRY = ("agentfold.adapters.cli",)


def serve_command(store: str, *args: str, side_effects: bool = True, entry: tuple[str, ...] = ENTRY) -> list[str]:
    # The tests' scenarios log their tool calls under the temporary folder (pytest's tmp_path).
    allow = [] if "--side-effect-dir" in args or not side_effects else ["--side-effect-dir", tempfile.gettempdir()]
    return [sys.executable, "-m", *entry, "serve", "--store", store, "--port", "0", "--json", *allow, *args]


def server_env(token: str | None = TOKEN) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTFOLD_STORE", "AGENTFOLD_API_TOKEN")}
    env["PYTHONPATH"] = str(ROOT)
    if token is not None:
        env["AGENTFOLD_API_TOKEN"] = token
    return env


def start_server(store: str, log_dir: Path, *args: str, timeout: float = 60.0,
                 env: dict[str, str] | None = None, side_effects: bool = True,
                 entry: tuple[str, ...] = ENTRY) -> ApiServer:
    """Start ``agentfold serve`` (``env``: more environment variables; ``entry``: the console
    script's module and arguments before ``serve``, a deployment's) and wait until ``/health`` answers."""
    log = log_dir / f"server-{uuid.uuid4().hex[:8]}.log"
    with log.open("w") as err:
        proc = subprocess.Popen(serve_command(store, *args, side_effects=side_effects, entry=entry), stdout=subprocess.PIPE,
                                stderr=err, text=True,
                                cwd=ROOT, env={**server_env(), **(env or {})})
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the server did not start (exit {proc.returncode})\n{log.read_text()}")
    started = json.loads(line)
    server = ApiServer(proc, started["listening"], store, log, started)
    while True:
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            server.stop()
            raise AssertionError(f"/health did not answer\n{log.read_text()}")
        time.sleep(0.05)


def problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """Assert an RFC 9457 problem with the agentfold code; return its members."""
    assert response.status_code == status, f"{response.status_code}: {response.text}"
    assert response.headers["content-type"].split(";")[0] == PROBLEM_JSON, response.headers
    body: dict[str, Any] = response.json()
    assert (body["code"], body["status"], body["type"]) == (code, status, f"urn:agentfold:problem:{code}"), body
    assert isinstance(body["title"], str) and body["title"]
    assert isinstance(body["detail"], str) and body["detail"]
    assert "Traceback" not in response.text
    return body


def ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, f"{response.status_code}: {response.text}"
    assert response.headers["content-type"].split(";")[0] == "application/json"
    return response.json()


def wait_until(predicate: Any, timeout: float = 20.0) -> Any:
    """Poll ``predicate`` until it returns something true; return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def send_at_once(server: ApiServer, requests: list[tuple[str, str]], within: float) -> list[tuple[str, int, float, str]]:
    """Send every ``(method, path)`` at once, each on its own connection (a POST with ``{}``);
    the answers that came within ``within`` seconds: ``(request, status, seconds, body)``."""
    answers: list[tuple[str, int, float, str]] = []

    def send(method: str, path: str) -> None:
        began = time.monotonic()
        with server.client() as own:
            answer = own.request(method, path, json={} if method == "POST" else None, timeout=within + 30)
        answers.append((f"{method} {path}", answer.status_code, time.monotonic() - began, answer.text))

    deadline = time.monotonic() + within
    threads = [threading.Thread(target=send, args=r, daemon=True) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return list(answers)

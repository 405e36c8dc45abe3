"""A local HTTP server that speaks the OpenAI chat-completions protocol (for tests).

It answers ``POST /v1/chat/completions`` from a script of responses (OpenAI wire
format), records every request body, and can be told to fail with an HTTP status.
"""

from __future__ import annotations

import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeOpenAI:
    def __init__(self, script: list[dict[str, Any]], *, tls: ssl.SSLContext | None = None) -> None:
        """``tls``: a server context (its certificate loaded): the server speaks HTTPS."""
        self.script = list(script)
        self.tls = tls
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.fail_with: int | None = None
        self.fail_first = 0  # this many requests fail with ``fail_first_with``, then the script answers
        self.fail_first_with = 503
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                server.requests.append(body)
                server.headers.append(dict(self.headers))
                if self.path != "/v1/chat/completions":
                    self._send(404, {"error": {"message": "not found"}})
                    return
                if server.fail_with is not None:
                    self._send(server.fail_with, {"error": {"message": "injected failure"}})
                    return
                if server.fail_first:
                    server.fail_first -= 1
                    self._send(server.fail_first_with, {"error": {"message": "injected transient failure"}})
                    return
                if not server.script:
                    self._send(500, {"error": {"message": "script exhausted"}})
                    return
                self._send(200, server.script.pop(0))

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            # Each connection's handshake runs in its own handler thread (a failed one ends only it).
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host}:{port}/v1"

    def __enter__(self) -> FakeOpenAI:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def completion(content: str | None = None, tool_calls: list[dict[str, Any]] | None = None,
               finish_reason: str = "stop", usage: dict[str, int] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in tool_calls
        ]
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": usage or {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }

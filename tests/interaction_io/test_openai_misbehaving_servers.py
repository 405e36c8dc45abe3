"""`OpenAIChatModel` against real local HTTP servers that misbehave (found by a review of the
client with real servers and real process death).

* A redirect was followed to whatever host it named, the API key sent along, and the POST
  turned into a GET whose answer was recorded as the model's completion: never followed now,
  the call's outcome is unknown (``ModelError``) and the other host hears nothing.
* ``timeout`` bounded each read, not the call: a body sent a byte at a time held the call for
  as long as it lasted. It bounds the whole answer now.
* A body cut off by the server closing early was taken as the whole body (invalid JSON, not
  sent again) while a reset one was retried; both are retried now. A reply that is not HTTP, a
  message that is not an object, a finish reason or usage of the wrong type escaped as bare
  library errors; all are ``ModelError``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from agentfold.adapters.models import ModelError, ModelRequest, OpenAIChatModel

COMPLETION = {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
KEY = "sk-test-SECRET"


def request() -> ModelRequest:
    return ModelRequest(process_id="process:p", model_call_sequence=1, effect_id="effect:" + "0" * 64,  # type: ignore[arg-type]
                        attempt_id=None, messages=({"role": "user", "content": [{"type": "text", "text": "hi"}]},))


@contextmanager
def serving(answer: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[tuple[str, list[tuple[str, str, str]]]]:
    """A server whose every request is answered by ``answer``; yields its base URL and the
    requests it received (method, path, Authorization header)."""
    seen: list[tuple[str, str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def handle_one(self) -> None:
            seen.append((self.command, self.path, self.headers.get("Authorization", "")))
            length = int(self.headers.get("Content-Length", "0") or 0)
            if length:
                self.rfile.read(length)
            try:
                answer(self)
            except (BrokenPipeError, ConnectionResetError):
                pass

        do_GET = do_POST = handle_one

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def send_json(handler: BaseHTTPRequestHandler, body: Any, status: int = 200) -> None:
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_not_followed_and_the_key_goes_nowhere_else(status: int) -> None:
    with serving(lambda h: send_json(h, COMPLETION)) as (elsewhere, other_host):
        def redirect(handler: BaseHTTPRequestHandler) -> None:
            handler.send_response(status)
            handler.send_header("Location", f"{elsewhere}/chat/completions")
            handler.send_header("Content-Length", "0")
            handler.end_headers()

        with serving(redirect) as (url, seen):
            model = OpenAIChatModel(url, "m", api_key=KEY, timeout=5, max_retries=2, retry_wait=0)
            with pytest.raises(ModelError) as failed:
                model.call(request())
    assert f"HTTP {status}" in str(failed.value) and "not followed" in str(failed.value)
    assert KEY not in str(failed.value)
    assert len(seen) == 1  # a redirect is not sent again either
    assert other_host == []


def test_timeout_bounds_the_whole_answer_not_each_read() -> None:
    data = json.dumps(COMPLETION).encode()

    def drip(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        for i in range(len(data)):  # ~0.2 s a byte: about 20 s in all
            handler.wfile.write(data[i:i + 1])
            handler.wfile.flush()
            time.sleep(0.2)

    with serving(drip) as (url, seen):
        model = OpenAIChatModel(url, "m", timeout=1.0)
        started = time.monotonic()
        with pytest.raises(ModelError) as failed:
            model.call(request())
        took = time.monotonic() - started
    assert len(seen) == 1  # max_retries 0: sent once
    assert took < 5, took  # before: until the last byte (about 20 s)
    assert "within 1 s" in str(failed.value) and "may have received" in str(failed.value)


def test_a_body_cut_off_by_the_server_is_retried_like_a_reset_one() -> None:
    data = json.dumps(COMPLETION).encode()

    def cut(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data[:10])
        handler.wfile.flush()
        handler.connection.shutdown(socket.SHUT_RDWR)

    with serving(cut) as (url, seen):
        model = OpenAIChatModel(url, "m", timeout=5, max_retries=2, retry_wait=0)
        with pytest.raises(ModelError) as failed:
            model.call(request())
    assert len(seen) == 3, seen
    assert "cut off" in str(failed.value) and "after 3 attempts" in str(failed.value)


@pytest.mark.parametrize("body", [
    {"choices": [{"message": None}]},
    {"choices": [{"message": {"content": "x"}, "finish_reason": ["stop"]}]},
    {"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": "abc"}},
    {"choices": [{"message": {"tool_calls": [{"id": "c", "function": "f"}]}}]},
])
def test_a_completion_with_members_of_the_wrong_type_is_a_model_error(body: Any) -> None:
    with serving(lambda h: send_json(h, body)) as (url, seen):
        with pytest.raises(ModelError):
            OpenAIChatModel(url, "m", timeout=5).call(request())
    assert len(seen) == 1  # not sent again: the same body would come back


def test_content_given_as_text_parts_is_read_and_other_parts_are_a_model_error_saying_so() -> None:
    # Found by an app-builder review: a server answering with content parts ([{"type": "text", ...}],
    # as some OpenAI-compatible servers do) was mapped to a text part whose text was the list, and
    # the call was left unknown with "a part must be {\"type\": \"text\", \"text\": \"...\"}":
    # exactly the shape the server had sent.
    parts = {"choices": [{"message": {"role": "assistant", "content": [
        {"type": "text", "text": "Sunny, "}, {"type": "text", "text": "24 C."}]}, "finish_reason": "stop"}]}
    with serving(lambda h: send_json(h, parts)) as (url, _):
        response = OpenAIChatModel(url, "m", timeout=5).call(request())
    assert response["message"]["content"] == [{"type": "text", "text": "Sunny, "}, {"type": "text", "text": "24 C."}]
    for content, words in (([{"type": "image_url", "image_url": {"url": "x"}}], "content part of type 'image_url'"),
                           ({"text": "x"}, "message.content is dict")):
        body = {"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}
        with serving(lambda h, b=body: send_json(h, b)) as (url, _):  # type: ignore[misc]
            with pytest.raises(ModelError) as failed:
                OpenAIChatModel(url, "m", timeout=5).call(request())
        assert words in str(failed.value), failed.value


def test_a_reply_that_is_not_http_is_a_model_error() -> None:
    def garbage(handler: BaseHTTPRequestHandler) -> None:
        handler.wfile.write(b"garbage\r\n\r\n")

    with serving(garbage) as (url, seen):
        with pytest.raises(ModelError) as failed:
            OpenAIChatModel(url, "m", timeout=5).call(request())
    assert len(seen) == 1
    assert "not HTTP" in str(failed.value)


def test_a_refused_connection_says_unreachable_and_a_timeout_says_the_server_may_have_it() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ModelError) as refused:
        OpenAIChatModel(f"http://127.0.0.1:{port}/v1", "m", timeout=5).call(request())
    assert "unreachable" in str(refused.value)

    def hold(handler: BaseHTTPRequestHandler) -> None:
        time.sleep(3)

    with serving(hold) as (url, seen):
        with pytest.raises(ModelError) as held:
            OpenAIChatModel(url, "m", timeout=0.5).call(request())
    assert len(seen) == 1
    assert "unreachable" not in str(held.value) and "may have received the request" in str(held.value)


def test_timeout_bounds_the_status_line_and_headers_too() -> None:
    # The deadline started with the body: headers sent a byte at a time (or "100 Continue"
    # replies, which http.client skips without a limit) held the call for as long as they came.
    def slow_headers(handler: BaseHTTPRequestHandler) -> None:
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"z" * 60 + b"\r\nContent-Length: 2\r\n\r\n{}":
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
            time.sleep(0.1)

    with serving(slow_headers) as (url, seen):
        started = time.monotonic()
        with pytest.raises(ModelError) as failed:
            OpenAIChatModel(url, "m", timeout=1.0).call(request())
        took = time.monotonic() - started
    assert len(seen) == 1
    assert took < 4, took  # before: until the last byte (about 9 s)
    assert "within 1 s" in str(failed.value)


def test_an_error_body_that_does_not_come_is_still_an_error_that_is_retried() -> None:
    # The error body was read inside the exception handler: a stalled or reset one escaped as a
    # bare TimeoutError/ConnectionResetError, and the call was not sent again.
    def stalled(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(503)
        handler.send_header("Content-Length", "100")
        handler.end_headers()
        handler.wfile.write(b"busy")
        handler.wfile.flush()
        time.sleep(3)

    with serving(stalled) as (url, seen):
        with pytest.raises(ModelError) as failed:
            OpenAIChatModel(url, "m", timeout=1.0, max_retries=1, retry_wait=0).call(request())
    assert len(seen) == 2, seen
    assert "HTTP 503" in str(failed.value) and "after 2 attempts" in str(failed.value)


@pytest.mark.parametrize("raw", [b"\xe9t\xe9 <html>", b"[" * 200_000])
def test_a_body_that_is_not_utf8_json_is_a_model_error(raw: bytes) -> None:
    def send(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(raw)))
        handler.end_headers()
        handler.wfile.write(raw)

    with serving(send) as (url, seen):
        with pytest.raises(ModelError) as failed:
            OpenAIChatModel(url, "m", timeout=5).call(request())
    assert len(seen) == 1
    assert "invalid JSON" in str(failed.value)

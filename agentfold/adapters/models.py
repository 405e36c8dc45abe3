"""Chat models: a scripted model and an OpenAI-compatible chat-completions client.

A model receives a :class:`ModelRequest` (messages, options, tool definitions, the
call's attribution) and returns a response in agentfold's canonical shape
(``{"message", "finish_reason", "usage"?}``). Raising anything means the outcome of
the call is unknown: the runtime records it and a host must settle it.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from agentfold.adapters.dispatch import CancelFlag
from agentfold.domain.canonical import JSON
from agentfold.domain.errors import InvalidInput
from agentfold.domain.ids import EffectAttemptID, EffectID, ProcessID
from agentfold.domain.interaction.chat import FINISH_REASONS
from agentfold.domain.kernel import brief_repr


@dataclass(frozen=True, slots=True)
class ModelRequest:
    process_id: ProcessID
    model_call_sequence: int
    effect_id: EffectID
    attempt_id: EffectAttemptID | None
    messages: tuple[dict[str, Any], ...]
    options: dict[str, Any] = field(default_factory=dict)
    tools: tuple[dict[str, Any], ...] = ()
    applied_steer_signal_ids: tuple[str, ...] = ()
    #: Set when the run is canceled or its owner stops: a client stops waiting to retry then.
    cancelled: CancelFlag | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, JSON]:
        return {
            "process_id": self.process_id,
            "model_call_sequence": self.model_call_sequence,
            "effect_id": self.effect_id,
            "messages": list(self.messages),
            "options": self.options,
            "tools": list(self.tools),
            "applied_steer_signal_ids": list(self.applied_steer_signal_ids),
        }


class Model(Protocol):
    def call(self, request: ModelRequest) -> dict[str, Any]: ...


class ModelError(Exception):
    """The model call failed; its outcome is unknown."""


class ScriptedModel:
    """Returns scripted responses in order, per Interaction Process.

    The n-th model call of a Process (its model call sequence n) receives entry n-1, so
    a recovered or resolved run sees exactly the same script. An entry
    ``{"error": "..."}`` raises: that call's outcome is unknown.

    ``requests`` holds the most recent ``keep_requests`` requests it received, oldest first
    (for tests and debugging): a scenario's model serves every run of that scenario in a
    long-lived server, so an unbounded log grew with every run.
    """

    def __init__(self, responses: Sequence[dict[str, Any]], *, keep_requests: int = 256) -> None:
        self.responses = list(responses)
        self.keep_requests = keep_requests
        self.requests: list[ModelRequest] = []

    def call(self, request: ModelRequest) -> dict[str, Any]:
        self.requests.append(request)
        if len(self.requests) > self.keep_requests:
            del self.requests[: len(self.requests) - self.keep_requests]
        index = request.model_call_sequence - 1
        if index >= len(self.responses):
            raise ModelError(f"the script has {len(self.responses)} responses; call {request.model_call_sequence} has none")
        entry = self.responses[index]
        if "error" in entry:
            raise ModelError(str(entry["error"]))
        return dict(entry)


# ---------------------------------------------------------------------------
# OpenAI-compatible chat completions


def to_openai_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        text = "".join(p.get("text", "") for p in m.get("content", []))
        role = m["role"]
        if role == "tool":
            for r in m.get("tool_results", []):
                output = r.get("output") or {}
                content = "".join(p.get("text", "") for p in output.get("content", []))
                if output.get("details") is not None:
                    details = json.dumps(output["details"], sort_keys=True)
                    content = f"{content}\n{details}" if content else details
                if r.get("is_error") and not (content.startswith("error: ") or content == "error"):
                    # Chat completions have no error flag on a tool message: a failed or rejected
                    # result (a ToolFailure, a host's failed/rejected resolution) says so in its text.
                    content = f"error: {content}" if content else "error"
                out.append({"role": "tool", "tool_call_id": r["id"], "content": content})
            continue
        entry: dict[str, Any] = {"role": role, "content": text if text or role != "assistant" else None}
        if role == "assistant" and m.get("tool_calls"):
            entry["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", "")}}
                for c in m["tool_calls"]
            ]
        out.append(entry)
    return out


#: Finish reasons of OpenAI-compatible servers (and the providers behind their proxies) that
#: have a portable equivalent; any other becomes ``other``.
PROVIDER_FINISH_REASONS = {
    "function_call": "tool_calls", "tool_use": "tool_calls",
    "max_tokens": "length", "model_length": "length",
    "end_turn": "stop", "stop_sequence": "stop", "eos": "stop",
}


def portable_finish_reason(reason: Any) -> str:
    """A provider's finish reason in the portable vocabulary (``FINISH_REASONS``): missing is
    ``stop``, a known provider name its equivalent (``PROVIDER_FINISH_REASONS``: truncation
    stays ``length``, so a cut-off answer is never taken for a finished one), any other ``other``."""
    if not reason:
        return "stop"
    if reason in FINISH_REASONS:
        return str(reason)
    return PROVIDER_FINISH_REASONS.get(reason, "other")


def from_openai_response(body: Any) -> dict[str, Any]:
    """Map an OpenAI chat-completions response to agentfold's response shape (``ModelError``
    for a body that is not one: a member of the wrong type too)."""
    try:
        choice = body["choices"][0]
        message = choice["message"]
        if not isinstance(message, dict):
            raise TypeError(f"choices[0].message is {type(message).__name__}")
    except (KeyError, IndexError, TypeError) as exc:
        raise ModelError(f"the response has no choices[0].message: {str(body)[:200]}") from exc
    try:
        return _mapped(body, choice, message)
    except (AttributeError, TypeError, ValueError, OverflowError) as exc:
        raise ModelError(f"the response is not a chat completion the client can read ({exc}): "
                         f"{str(body)[:200]}") from exc


def _mapped(body: Any, choice: Any, message: dict[str, Any]) -> dict[str, Any]:
    result_message: dict[str, Any] = {"role": "assistant"}
    content = message.get("content")
    if isinstance(content, list):
        # Content parts, as some OpenAI-compatible servers answer (and OpenAI's own API accepts):
        # their text parts, as they are; a part of another type is no answer this client reads.
        parts = []
        for index, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ModelError(f"message.content[{index}] is a content part of type {str(kind)[:40]!r}: only text "
                                 "parts are read (a string content, or parts {\"type\": \"text\", \"text\": ...})")
            if part["text"]:
                parts.append({"type": "text", "text": part["text"]})
        if parts:
            result_message["content"] = parts
    elif content:
        if not isinstance(content, str):
            raise ModelError(f"message.content is {type(content).__name__}: a string or a list of text parts is read")
        result_message["content"] = [{"type": "text", "text": content}]
    if message.get("function_call") and not message.get("tool_calls"):
        # The legacy single function call (no call id): not mapped, so the call is unknown
        # rather than a silent final answer without the call the model asked for.
        raise ModelError("the response holds a legacy function_call, not tool_calls: send tools, not functions")
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        if not isinstance(fn, dict):
            raise TypeError(f"a tool call's function is {type(fn).__name__}")
        calls.append({"id": call.get("id", ""), "name": fn.get("name", ""), "arguments": fn.get("arguments") or ""})
    if calls:
        result_message["tool_calls"] = calls
    response: dict[str, Any] = {"message": result_message, "finish_reason": portable_finish_reason(choice.get("finish_reason"))}
    usage = body.get("usage")
    if isinstance(usage, dict):
        response["usage"] = {name: _token_count(usage, name) for name in ("prompt_tokens", "completion_tokens",
                                                                           "total_tokens")}
    return response


def _token_count(usage: dict[str, Any], name: str) -> int:
    """A usage count as the server sent it: a whole number (missing or null: 0). Anything else
    (true, 2.9, "7") is not coerced into one: the response is not a chat completion."""
    value = usage.get(name)
    if value is None:
        return 0
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"usage.{name} is {value!r}, not a whole number of tokens")
    return value


class ModelSettingInvalid(InvalidInput, ValueError):
    """A setting of a model client that can never work (also a ValueError, as it was)."""


def _refuse(message: str) -> NoReturn:
    raise ModelSettingInvalid("interaction.definition.invalid", message, hint="fix the model's settings")


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class OpenAIChatModel:
    """A client of an OpenAI-compatible ``POST {base_url}/chat/completions`` endpoint.

    Tools are sent as function definitions with ``tool_choice`` ``"auto"`` when the
    bound ToolSet or Delegates offer any. Transport errors, HTTP errors (a redirect too:
    never followed), an answer not complete within ``timeout`` and malformed bodies raise
    :class:`ModelError` (the effect becomes unknown).
    """

    def __init__(
        self, base_url: str, model: str, api_key: str = "", timeout: float = 60.0, *,
        max_retries: int = 0, retry_wait: float = 1.0,
    ) -> None:
        """``max_retries``: how many more times one model call is sent when no completion came
        back: the connection was refused, reset or timed out, the answer was cut off before its
        end (or is not HTTP), or the server answered 408, 409,
        429, 500, 502, 503 or 504 (0, the default: never; the call's outcome is then unknown at
        once). A name that does not resolve or a certificate that does not verify is not
        retried. Waits ``retry_wait`` seconds, doubled after each attempt, at most
        ``MAX_RETRY_WAIT``; a ``Retry-After`` in seconds is honoured up to that bound; a run
        canceled (or its owner closing: ``Runtime.close``, not ``drain``, which lets the call
        finish) meanwhile ends the waiting. Only the response that
        comes back is recorded: a model call has no effect outside the response it returns, so
        sending it again cannot do anything twice (unlike a tool call, never retried); a
        completion lost on its way back (a reset while reading it) is paid for twice."""
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            _refuse(f"base_url must be an http:// or https:// URL, not {brief_repr(base_url)}")
        if not isinstance(model, str) or not model:
            _refuse(f"model must be a model name (text), not {brief_repr(model)}")
        if not isinstance(api_key, str):
            _refuse("api_key must be text (empty: no Authorization header)")
        if not _seconds(timeout) or timeout <= 0:
            # Checked at the first call, it made every model call unknown though none was sent.
            _refuse(f"timeout must be a number of seconds above 0, not {brief_repr(timeout)}")
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or not 0 <= max_retries <= 10:
            _refuse("max_retries must be an integer from 0 to 10")
        if not _seconds(retry_wait) or not 0 <= retry_wait <= MAX_RETRY_WAIT:
            _refuse(f"retry_wait must be from 0 to {MAX_RETRY_WAIT:g} seconds")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self.retry_wait = retry_wait
        self.sleep: Callable[[float, CancelFlag | None], object] = _pause  # replaceable in tests that count waits
        self._opener: Any = None  # urllib's, without redirects (built at the first call)

    def payload(self, request: ModelRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": to_openai_messages(request.messages)}
        for key, value in request.options.items():
            if key not in ("messages", "tools", "tool_choice", "model"):
                body[key] = value
        if request.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t["name"], "description": t.get("description", ""), "parameters": t["parameters"]},
                }
                for t in request.tools
            ]
            body["tool_choice"] = "auto"
        return body

    def call(self, request: ModelRequest) -> dict[str, Any]:
        # Imported here: urllib.request brings http.client, ssl and email (~20 ms), which every
        # command line would pay for a model it never calls.
        import http.client
        import urllib.error
        import urllib.request

        if self._opener is None:
            self._opener = _no_redirect_opener()
        data = json.dumps(self.payload(request)).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        wait = self.retry_wait
        for attempt in range(1, self.max_retries + 2):
            retry_after: float | None = None
            sent = urllib.request.Request(f"{self.base_url}/chat/completions", data=data, headers=headers, method="POST")
            # ``timeout`` bounds the whole answer (status line, headers, every chunk and trailer),
            # not each receive: at the deadline the watch shuts the connection down.
            watch = _Watch(sent, self.timeout)
            try:
                try:
                    with self._opener.open(sent, timeout=self.timeout) as response:
                        raw = _read_whole(response)
                    if watch.expired:
                        raise TimeoutError("the deadline passed")
                except urllib.error.HTTPError as exc:
                    if 300 <= exc.code < 400:
                        # Never followed: urllib would send the key to the new host and turn the POST
                        # into a GET whose answer is no completion of this request.
                        raise ModelError(
                            f"HTTP {exc.code} from the model server: a redirect (to "
                            f"{str(exc.headers.get('Location', '?') if exc.headers else '?')[:200]}) is not "
                            "followed; set base_url to where the server answers"
                        ) from exc
                    failure = ModelError(f"HTTP {exc.code} from the model server: {_error_body(exc)!r}")
                    if exc.code not in RETRY_STATUSES:
                        raise failure from exc
                    retry_after = _retry_after(exc.headers.get("Retry-After") if exc.headers else None)
                    cause: Exception = exc
                except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
                    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                    if watch.expired or isinstance(reason, TimeoutError):
                        failure = ModelError(f"no complete answer from the model server within {self.timeout:g} s "
                                             "(it may have received the request)")
                    elif isinstance(reason, ConnectionRefusedError):
                        failure = ModelError(f"the model server is unreachable: {reason}")
                    elif isinstance(reason, http.client.HTTPException):  # cut off, or not HTTP
                        failure = ModelError(f"the model server's answer was cut off or is not HTTP: {reason!r}")
                    elif isinstance(reason, (ConnectionError, ssl_eof_errors())):
                        failure = ModelError(f"the connection to the model server failed (it may have received "
                                             f"the request): {reason}")
                    else:  # DNS, TLS, a bad URL: it would fail again
                        raise ModelError(f"the model server is unreachable: {exc}") from exc
                    cause = exc
                else:
                    try:
                        body = json.loads(raw)
                    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested beyond the parser
                        raise ModelError(f"the model server returned invalid JSON: {str(exc)[:200]}") from exc
                    return from_openai_response(body)
            finally:
                watch.cancel()
            if attempt > self.max_retries:
                if attempt > 1:
                    failure = ModelError(f"{failure} (after {attempt} attempts)")
                raise failure from cause
            delay = min(MAX_RETRY_WAIT, retry_after if retry_after is not None else wait)
            self.sleep(delay, request.cancelled)  # returns at once when the run is stopping
            if request.cancelled is not None and request.cancelled.is_set():
                raise ModelError(f"{failure} (not sent again: the run is stopping)") from cause
            wait = min(MAX_RETRY_WAIT, wait * 2)
        raise AssertionError("unreachable")  # pragma: no cover


#: HTTP statuses after which ``OpenAIChatModel`` may send a model call again (with ``max_retries``).
RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
#: The longest wait between two attempts of one model call (seconds).
MAX_RETRY_WAIT = 30.0


#: The largest answer body read (its completion is bounded far below by the payload limits).
MAX_RESPONSE_BYTES = 64 * 1024 * 1024


def _read_whole(response: Any) -> bytes:
    """The whole body, at most ``MAX_RESPONSE_BYTES``; ``IncompleteRead`` when the server closed
    before the Content-Length it announced (cut off, as a reset is)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = response.read1(65536) if hasattr(response, "read1") else response.read(65536)
        if not chunk:
            missing = getattr(response, "length", None)
            if missing:
                import http.client

                raise http.client.IncompleteRead(b"".join(chunks), missing)
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise ModelError(f"the model server's answer is larger than {MAX_RESPONSE_BYTES} bytes")
        chunks.append(chunk)


def _error_body(exc: Any) -> bytes:
    """The first bytes of an HTTP error's body, for the diagnostic (nothing when it cannot be read)."""
    try:
        return bytes(exc.read(300))[:300]
    except Exception:  # noqa: BLE001 - the status is the error; its body only illustrates it
        return b""


def ssl_eof_errors() -> tuple[type[BaseException], ...]:
    """A TLS connection shut down under a read (the watch's deadline, the server going away)."""
    import ssl

    return (ssl.SSLEOFError, ssl.SSLZeroReturnError)


class _Watch:
    """Shuts the connection of one request down once ``timeout`` seconds have passed since it
    was made, so that no receive (of the status line, a header, a chunk size, a trailer)
    waits past it; ``expired`` says it did. The connection registers itself on the request
    (``_TrackedConnection``) once it is made: one made after the deadline is shut at once."""

    def __init__(self, request: Any, timeout: float) -> None:
        self.expired = False
        self._lock = threading.Lock()
        self._socket: Any = None
        request.agentfold_watch = self
        self._timer = threading.Timer(timeout, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def track(self, sock: Any) -> None:
        with self._lock:
            self._socket = sock
            if not self.expired:
                return
        _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sock = self._socket
        if sock is not None:
            _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _shut(sock: Any) -> None:
    import socket

    try:
        # The plain socket's shutdown, also under TLS: the reader then meets the end of the stream.
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def _no_redirect_opener() -> Any:
    """urllib's opener, refusing every redirect (the 3xx is then an ``HTTPError``), whose
    connections register with their request's ``_Watch``."""
    import http.client
    import urllib.request

    class NoRedirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
            return None

    def tracked(base: Any, req: Any) -> Any:
        class Tracked(base):  # type: ignore[misc]
            def connect(self) -> None:
                super().connect()
                watch = getattr(req, "agentfold_watch", None)
                if watch is not None:
                    watch.track(self.sock)

        return Tracked

    class HTTP(urllib.request.HTTPHandler):
        def http_open(self, req: Any) -> Any:
            return self.do_open(tracked(http.client.HTTPConnection, req), req)

    class HTTPS(urllib.request.HTTPSHandler):
        def https_open(self, req: Any) -> Any:
            return self.do_open(tracked(http.client.HTTPSConnection, req), req,
                                context=self._context)  # type: ignore[attr-defined]

    return urllib.request.build_opener(NoRedirects, HTTP, HTTPS)


def _pause(seconds: float, cancelled: CancelFlag | None) -> None:
    """Wait between two attempts; a cancellation ends the wait."""
    if cancelled is None:
        time.sleep(seconds)
    else:
        cancelled.wait(seconds)


def _retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` given in seconds (an HTTP date is ignored: the usual backoff applies)."""
    if value is None or not value.strip().isascii() or not value.strip().isdigit():
        return None
    return float(value.strip())

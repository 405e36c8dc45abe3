"""Mutation audit of the edges (model and tool adapters, scenarios, run/answer/steer): tests
that kill the mutants that survived the suite (report "edges", session 28). Each test names
the behaviour it proves; its docstring names the mutant it kills."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from agentfold.adapters.models import ModelError, ModelRequest, OpenAIChatModel


def _request() -> ModelRequest:
    return ModelRequest(process_id="process:p", model_call_sequence=1, effect_id="effect:" + "0" * 64,  # type: ignore[arg-type]
                        attempt_id=None, messages=({"role": "user", "content": [{"type": "text", "text": "hi"}]},))


@contextmanager
def _resetting_server() -> Iterator[tuple[str, list[bytes]]]:
    """A TCP server that reads each whole HTTP request, then resets the connection (RST, no
    answer): the model server went away after it received the call. Yields its base URL and
    the requests it received."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    received: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    body += chunk
                received.append(body)
                # SO_LINGER 0: close() sends a RST, so the client's read fails with ECONNRESET.
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1", received
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_a_model_call_whose_connection_is_reset_is_sent_again_and_stays_unknown_saying_it_may_have_arrived() -> None:
    """docs/interaction.md (OpenAIChatModel ``max_retries``): a call whose connection was reset
    is sent again; when every attempt is reset, the outcome is unknown (``ModelError``) and the
    diagnostic says the server may have received it, not that it is unreachable. Kills M06
    (ConnectionResetError classed with DNS/TLS failures: never retried, "unreachable")."""
    with _resetting_server() as (url, received):
        model = OpenAIChatModel(url, "m", timeout=5, max_retries=2, retry_wait=0)
        with pytest.raises(ModelError) as failed:
            model.call(_request())
    assert len(received) == 3, received
    assert all(json.loads(body)["model"] == "m" for body in received)
    message = str(failed.value)
    assert "may have received the request" in message and "unreachable" not in message, message
    assert "(after 3 attempts)" in message, message


@contextmanager
def _scripted_http(
    answers: list[tuple[int, dict[str, str], object]], delays: tuple[float, ...] = (),
) -> Iterator[tuple[str, list[dict]]]:
    """An HTTP server answering its n-th POST with ``answers[n]`` (status, headers, JSON body),
    after ``delays[n]`` seconds (none when not given); yields its base URL and the request
    bodies it received."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[dict] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            with lock:
                seen.append(body)
                status, headers, payload = answers[min(len(seen), len(answers)) - 1]
                delay = delays[len(seen) - 1] if len(seen) <= len(delays) else 0.0
            time.sleep(delay)
            data = json.dumps(payload).encode()
            self.send_response(status)
            for name, value in {"Content-Type": "application/json", **headers}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    class Quiet(ThreadingHTTPServer):
        def handle_error(self, request: object, client_address: object) -> None:
            pass  # a late answer to a client that gave up (broken pipe) is expected here

    httpd = Quiet(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", seen
    finally:
        httpd.shutdown()
        httpd.server_close()


COMPLETION = {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}


def test_a_retry_after_in_seconds_sets_the_wait_before_the_model_call_is_sent_again() -> None:
    """docs (OpenAIChatModel ``max_retries``): a ``Retry-After`` given in seconds is honoured
    (up to ``MAX_RETRY_WAIT``) instead of the ``retry_wait`` backoff. Kills M08 (Retry-After
    ignored: a rate-limited server is hit again after the short backoff)."""
    busy = {"error": {"message": "rate limited"}}
    answers = [(429, {"Retry-After": "7"}, busy), (503, {"Retry-After": "120"}, busy), (200, {}, COMPLETION)]
    with _scripted_http(answers) as (url, seen):
        model = OpenAIChatModel(url, "m", timeout=5, max_retries=2, retry_wait=0.25)
        waits: list[float] = []
        model.sleep = lambda seconds, cancelled: waits.append(seconds)
        response = model.call(_request())
    assert response["message"]["content"] == [{"type": "text", "text": "ok"}]
    assert len(seen) == 3
    assert waits == [7.0, 30.0]  # the server's 7 s; its 120 s bounded by MAX_RETRY_WAIT


def test_a_runs_options_reach_the_model_server_but_never_replace_its_model_or_messages() -> None:
    """A run's input ``options`` (docs/interaction.md: ``{"messages", "options"?}``) are sent
    with the call (``temperature``), but the model, messages and tools are the client's and
    the run's: an input cannot switch a host's model (cost, data sent elsewhere) or replace
    the conversation. Kills M12 (every option copied over the body)."""
    tool = {"name": "lookup", "description": "Looks up.", "parameters": {"type": "object"}}
    request = ModelRequest(
        process_id="process:p", model_call_sequence=1, effect_id="effect:" + "0" * 64,  # type: ignore[arg-type]
        attempt_id=None, messages=({"role": "user", "content": [{"type": "text", "text": "hi"}]},),
        options={"temperature": 0.2, "model": "gpt-expensive", "messages": [{"role": "user", "content": "other"}],
                 "tools": [], "tool_choice": "none"},
        tools=(tool,),
    )
    with _scripted_http([(200, {}, COMPLETION)]) as (url, seen):
        OpenAIChatModel(url, "gpt-host", timeout=5).call(request)
    [sent] = seen
    assert sent["temperature"] == 0.2
    assert sent["model"] == "gpt-host"
    assert sent["messages"] == [{"role": "user", "content": "hi"}]
    assert [t["function"]["name"] for t in sent["tools"]] == ["lookup"] and sent["tool_choice"] == "auto"


def test_a_model_call_that_times_out_is_sent_again_and_the_answer_that_comes_back_is_used() -> None:
    """docs (OpenAIChatModel ``max_retries``): a call with no complete answer within
    ``timeout`` is sent again (it has no effect outside its response); the second attempt's
    completion is the call's response. Kills M13 (a timeout raised at once, never retried: the
    call is left unknown for a host though a retry would have answered it)."""
    with _scripted_http([(200, {}, COMPLETION)], delays=(3.0,)) as (url, seen):
        model = OpenAIChatModel(url, "m", timeout=0.5, max_retries=1, retry_wait=0)
        started = time.monotonic()
        response = model.call(_request())
        took = time.monotonic() - started
    assert response["message"]["content"] == [{"type": "text", "text": "ok"}]
    assert len(seen) == 2
    assert took < 2.5, took  # the first attempt was given up at its deadline, not waited out


def test_usage_counts_a_server_leaves_out_or_sends_as_null_are_read_as_zero() -> None:
    """docs/interaction.md (finish-reason gate): "a missing or null count is 0": servers that
    report only some counts still answer the call. Kills M14 (a missing count read as not a
    whole number: every call to such a server left unknown for a host)."""
    body = {**COMPLETION, "usage": {"prompt_tokens": 12, "completion_tokens": None}}
    with _scripted_http([(200, {}, body)]) as (url, seen):
        response = OpenAIChatModel(url, "m", timeout=5).call(_request())
    assert len(seen) == 1
    assert response["usage"] == {"prompt_tokens": 12, "completion_tokens": 0, "total_tokens": 0}
    assert response["finish_reason"] == "stop"


# ---------------------------------------------------------------------------
# Scenario files (docs/scenarios.md)

SIMPLE_MODEL = {"responses": [{"finish_reason": "stop", "message": {"content": "done"}}]}


@pytest.mark.parametrize("member", ["max_model_calls", "max_concurrent_tool_calls"])
def test_a_scenario_limit_given_as_a_boolean_is_refused_with_its_path(tmp_path, member: str) -> None:
    """docs/scenarios.md: ``limits`` members are integers (``max_model_calls`` >= 1,
    ``max_concurrent_tool_calls`` >= 0); ``true`` is not read as 1 (JSON has booleans: a
    generated file that wrote ``true`` meant something else). Refused when loaded, with the
    stable code and the member's path. Kills S02 (booleans accepted as integers)."""
    from agentfold.adapters.scenario import load_scenario_file
    from agentfold.domain.errors import AgentfoldError

    doc = {"name": "limits", "model": SIMPLE_MODEL, "limits": {member: True},
           "tools": [{"name": "t", "description": "T.", "result": {"output": "x"}}]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(AgentfoldError) as refused:
        load_scenario_file(path)
    assert refused.value.code == "scenario.invalid"
    assert refused.value.message.startswith(f"$.limits.{member}: "), refused.value.message


@pytest.mark.parametrize("named", ["plain", "nowhere"])
def test_a_scenario_tool_that_advertises_a_tool_that_is_not_deferred_is_refused_with_its_path(
    tmp_path, named: str,
) -> None:
    """docs/scenarios.md: ``advertises`` lists names of **deferred** tools; naming a tool that is
    always offered, or no tool at all, is refused when the file is loaded (``scenario.invalid``,
    the path of the name), not discovered at the call that advertises it. Kills S04 (the check
    that each advertised name is a deferred tool removed)."""
    from agentfold.adapters.scenario import load_scenario_file
    from agentfold.domain.errors import AgentfoldError

    doc = {"name": "advertising", "model": SIMPLE_MODEL, "tools": [
        {"name": "finder", "description": "Finds.", "result": {"output": "found"}, "advertises": ["later", named]},
        {"name": "later", "description": "Deferred.", "result": {"output": "x"}, "deferred": True},
        {"name": "plain", "description": "Always offered.", "result": {"output": "y"}},
    ]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(AgentfoldError) as refused:
        load_scenario_file(path)
    assert refused.value.code == "scenario.invalid"
    assert refused.value.message.startswith(f"$.tools[0].advertises[1]: '{named}' is not a deferred tool"), \
        refused.value.message


def test_a_scenario_round_of_direct_result_tools_ends_the_run_with_their_results_and_no_more_model_calls(
    tmp_path,
) -> None:
    """docs/scenarios.md ``direct_result``: a round whose calls all target direct-result tools
    and all succeed ends the run with the tool results, no further model call. Seen by an
    operator as ``agentfold run``'s output and ``show``. Kills S05 (the scenario tool's
    ``direct_result`` flag dropped: the model is called again, its second scripted answer
    becomes the output)."""
    from tests.test_cli import agentfold, ok, sqlite_url

    doc = {"name": "direct", "model": {"responses": [
        {"finish_reason": "tool_calls", "message": {"content": "", "tool_calls": [
            {"id": "c1", "name": "quote", "arguments": '{"sym": "X"}'}]}},
        {"finish_reason": "stop", "message": {"content": "the model was called again"}},
    ]}, "tools": [{"name": "quote", "description": "A quote.", "direct_result": True, "result": {"output": "X is 42"}}]}
    path = tmp_path / "direct.json"
    path.write_text(json.dumps(doc))
    store = sqlite_url(tmp_path)
    started = ok(agentfold("run", str(path), "--json", store=store)).json()
    assert started["status"] == "completed"
    root = ok(agentfold("show", started["tree_id"], "--json", store=store)).json()["processes"][0]
    output = root["output"]
    assert output["model_calls"] == 1, output
    assert "model_response" not in output
    [result] = output["direct_tool_results"]
    assert result["id"] == "c1" and result["output"]["content"] == [{"type": "text", "text": "X is 42"}], result


def test_a_case_whose_when_names_a_member_as_null_does_not_match_a_call_without_that_member(tmp_path) -> None:
    """docs/scenarios.md ``cases``: the first case whose ``when`` members all **equal** the
    call's arguments; a member the call does not have equals nothing, not even ``null``. The
    tool's result shows in the next model request (``agentfold unknown --json``). Kills S06
    (a missing member read as null: the ``{"approver": null}`` case taken for a call that
    named no approver)."""
    from tests.test_cli import agentfold, ok, sqlite_url
    from tests.test_cli_interaction import model_call, unknowns

    doc = {"name": "cases", "model": {"responses": [
        {"finish_reason": "tool_calls", "message": {"content": "", "tool_calls": [
            {"id": "c1", "name": "route", "arguments": '{"amount": 5}'},
            {"id": "c2", "name": "route", "arguments": '{"amount": 5, "approver": null}'}]}},
        {"error": "left to the host"},
    ]}, "limits": {"max_concurrent_tool_calls": 1},
        "tools": [{"name": "route", "description": "Routes.", "result": {
            "cases": [{"when": {"approver": None}, "result": {"output": "explicitly unapproved"}}],
            "otherwise": {"output": "routed"}}}]}
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(doc))
    store = sqlite_url(tmp_path)
    ok(agentfold("run", str(path), "--json", store=store))
    [entry] = unknowns(store)
    tool_message = model_call(entry)["request"]["messages"][-1]
    assert tool_message["role"] == "tool"
    assert [(r["id"], r["output"]["content"][0]["text"]) for r in tool_message["tool_results"]] == [
        ("c1", "routed"), ("c2", "explicitly unapproved")]


# ---------------------------------------------------------------------------
# Tool outcomes (docs/interaction.md, "Tool calls": the outcome precedence)


class _CleanupFails:
    """A tool whose own refusal is followed by a failing cleanup: the error that escapes is a
    RuntimeError raised *while handling* the ToolFailure (implicit context, no ``from``)."""

    name = "transfer"
    description = "Moves money."
    parameters = {"type": "object"}

    def __init__(self) -> None:
        self.calls = 0

    def call(self, invocation, arguments):
        from agentfold.adapters.tools import ToolFailure

        self.calls += 1
        try:
            raise ToolFailure("rejected", "limit exceeded")
        except ToolFailure:
            # The rollback failed: whether the transfer happened is not known any more.
            raise RuntimeError("rollback failed: the ledger connection dropped")  # noqa: B904 - on purpose


def test_an_error_raised_while_handling_a_tool_failure_leaves_the_call_unknown_not_rejected() -> None:
    """docs/interaction.md: a ToolFailure counts "anywhere in the error chain: the explicit cause
    chain and the members of an ExceptionGroup"; implicit context (an error raised while
    handling it) does not: such a call's outcome is **unknown** for a host to settle, never
    guessed from an earlier refusal. Kills T09 (``__context__`` followed too: the call
    recorded as a definite rejected result and the run went on)."""
    from agentfold.adapters.interaction import InteractionConfig, compile_interaction
    from agentfold.adapters.models import ScriptedModel

    model = ScriptedModel([
        {"message": {"role": "assistant", "content": None,
                     "tool_calls": [{"id": "t1", "name": "transfer", "arguments": "{}"}]}, "finish_reason": "tool_calls"},
        {"message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"},
    ])
    tool = _CleanupFails()
    program = compile_interaction(InteractionConfig(name="edges.cleanup", model=model, tools=[tool]))
    unknown, status = unknown_calls_and_status(program, "pay")
    assert tool.calls == 1
    assert [(u["kind"], u["diagnostic"]["message"]) for u in unknown] == [
        ("tool", "RuntimeError: rollback failed: the ledger connection dropped")], unknown
    assert status == "waiting"  # for a host to settle the call
    assert len(model.requests) == 1  # the model never saw a guessed result


def unknown_calls_and_status(program: Any, text: str) -> tuple[list[dict[str, Any]], str]:
    """Run an Interaction ``program`` on the user message ``text`` (memory store) until nothing
    more happens without a host: its unknown calls as ``Host.unknown`` lists them, and its status."""
    from agentfold.adapters.catalog import Catalog
    from agentfold.adapters.eventstore import EventStore
    from agentfold.adapters.host import Host
    from agentfold.adapters.runtime import Runtime

    store = EventStore("memory:")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            run = runtime.start(program, {"messages": [{"role": "user", "content": text}]})
            runtime.wait_idle(run.tree_id, timeout=30)
            host = Host(runtime)
            return host.unknown(run.tree_id), host.run(run.tree_id)["status"]
    finally:
        store.close()

"""Mutation audit of the model and tool adapters (report "models", session 31): tests that kill
the mutants that survived the suite. Each test names the behaviour it proves; its docstring
names the mutant it kills. The model server is a real local HTTP server (never a mock of HTTP)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ModelError, OpenAIChatModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.tools import ToolOutput
from tests.interaction_io.fake_openai import FakeOpenAI, completion
from tests.interaction_io.test_openai_misbehaving_servers import COMPLETION, request, send_json, serving


class _Recorder:
    """A tool that records the arguments of every call it runs, in the order it runs them."""

    description = "Records what it is asked."
    parameters = {"type": "object", "required": ["step"], "properties": {"step": {"type": "string"}}}

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name = name
        self.log = log

    def call(self, invocation: Any, arguments: Any) -> ToolOutput:
        self.log.append((self.name, arguments["step"]))
        return ToolOutput.text(f"{self.name} did {arguments['step']}")


def _run(server: FakeOpenAI, name: str, messages: list[dict[str, Any]], tools: Sequence[Any] = ()) -> Any:
    model = OpenAIChatModel(server.base_url, model="gpt-test", timeout=5)
    program = compile_interaction(InteractionConfig(name=name, model=model, tools=list(tools)))
    store = EventStore("memory:")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            return runtime.start(program, {"messages": messages}).result(30)
    finally:
        store.close()


def test_the_given_system_message_and_every_text_part_of_a_message_reach_the_model_server() -> None:
    """docs/interaction.md (input ``{"messages"}``): the model receives the given messages; a
    message's content may be a list of text parts; tools are sent (with ``tool_choice``) only
    "when the bound ToolSet or Delegates offer any". Kills N08 (only the first text part of a
    message sent: the rest of the user's question silently dropped) and N59 (``"tools": []``
    and ``"tool_choice": "auto"`` sent for a run without tools: OpenAI's API refuses an empty
    ``tools`` with HTTP 400, so every such call was left unknown)."""
    with FakeOpenAI([completion("ok")]) as server:
        result = _run(server, "models.parts", [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": [{"type": "text", "text": "Capital of Norway? "},
                                         {"type": "text", "text": "Not Sweden."}]},
        ])
    assert result.status == "completed"
    assert server.requests[0]["messages"] == [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of Norway? Not Sweden."},
    ]
    assert set(server.requests[0]) == {"model", "messages"}, server.requests[0]


def test_tool_calls_run_in_the_order_the_server_sent_them_and_go_back_with_the_text_beside_them() -> None:
    """docs/interaction.md (rounds): calls advance "call by call from its cursor" and the model
    receives the results "in original call order"; the assistant message is appended as the
    model answered it. Kills N01 (the client read a response's tool calls in reverse: the
    second call ran first) and N10 (the text a model sends beside its tool calls dropped, so
    the next request showed an assistant turn without it)."""
    log: list[tuple[str, str]] = []
    script = [
        completion("First create it, then write to it.", finish_reason="tool_calls", tool_calls=[
            {"id": "call_a", "name": "create", "arguments": '{"step": "create notes.txt"}'},
            {"id": "call_b", "name": "write", "arguments": '{"step": "write hello"}'},
        ]),
        completion("Done."),
    ]
    with FakeOpenAI(script) as server:
        result = _run(server, "models.order", [{"role": "user", "content": "make notes"}],
                      [_Recorder("create", log), _Recorder("write", log)])
    assert result.status == "completed"
    assert log == [("create", "create notes.txt"), ("write", "write hello")]
    assistant, tool_a, tool_b = server.requests[1]["messages"][1:]
    assert assistant == {"role": "assistant", "content": "First create it, then write to it.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "create", "arguments": '{"step": "create notes.txt"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "write", "arguments": '{"step": "write hello"}'}},
    ]}
    assert [(m["role"], m["tool_call_id"], m["content"]) for m in (tool_a, tool_b)] == [
        ("tool", "call_a", "create did create notes.txt"), ("tool", "call_b", "write did write hello")]


def test_a_model_call_answered_with_a_transient_status_is_sent_again() -> None:
    """docs/python.md (``max_retries``): the same call is sent again after "HTTP 408, 409, 429,
    500, 502, 503 or 504". Kills N05 (only 408, 409, 429 and 503 retried: a 500, 502 or 504
    left the call unknown at once, for a host to settle, though the next attempt answered)."""
    statuses = [500, 502, 504, 408, 409]
    answers = [code for status in statuses for code in (status, 200)]

    def answer(handler: BaseHTTPRequestHandler) -> None:
        code = answers.pop(0)
        send_json(handler, COMPLETION if code == 200 else {"error": {"message": "busy"}}, code)

    with serving(answer) as (url, seen):
        model = OpenAIChatModel(url, "m", timeout=5, max_retries=1, retry_wait=0)
        for status in statuses:
            response = model.call(request())
            assert response["message"]["content"] == [{"type": "text", "text": "ok"}], status
    assert len(seen) == 2 * len(statuses)


def test_usage_counts_sent_as_whole_floats_are_read_as_those_counts() -> None:
    """docs/interaction.md (finish-reason gate): only a usage count that is "not a whole number"
    (true, 2.9, "7") leaves the call unknown; 40.0 is the whole number 40 (servers that
    serialize through floats send it so). Kills N12 (a whole float refused: every call to such
    a server left unknown for a host)."""
    body = {**COMPLETION, "usage": {"prompt_tokens": 40.0, "completion_tokens": 7.0, "total_tokens": 47}}
    with serving(lambda h: send_json(h, body)) as (url, _):
        response = OpenAIChatModel(url, "m", timeout=5).call(request())
    assert response["usage"] == {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47}
    assert all(type(count) is int for count in response["usage"].values())


def test_a_timeout_in_the_middle_of_a_body_sent_until_close_is_a_timeout_and_is_retried() -> None:
    """docs/python.md: ``timeout`` bounds each attempt's whole answer, and a call with no complete
    answer within it is sent again (``max_retries``), its diagnostic saying the server may have
    it. A body without Content-Length ends when the server closes: the client's deadline shuts
    the connection, and what was read by then is not the whole body. Kills N03 (the check of the
    deadline after the read removed: half a body read as the answer, "invalid JSON", never sent
    again) and N70 (the deadline set at twice ``timeout``)."""
    data = json.dumps(COMPLETION).encode()

    def half_then_drip(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Connection", "close")  # no Content-Length: the body ends at the close
        handler.end_headers()
        handler.wfile.write(data[: len(data) // 2])
        handler.wfile.flush()
        for _ in range(25):  # a byte each 0.1 s for 2.5 s: no single read waits as long as ``timeout``
            time.sleep(0.1)
            handler.wfile.write(b" ")
            handler.wfile.flush()

    with serving(half_then_drip) as (url, seen):
        model = OpenAIChatModel(url, "m", timeout=0.5, max_retries=1, retry_wait=0)
        started = time.monotonic()
        with pytest.raises(ModelError) as failed:
            model.call(request())
        took = time.monotonic() - started
    assert len(seen) == 2, seen
    # Two attempts of 0.5 s each (the server would drip each for 2.5 s); with twice the deadline
    # they take 2 s at least. The margin is for a loaded machine.
    assert took < 1.7, took
    message = str(failed.value)
    assert "within 0.5 s" in message and "may have received the request" in message, message
    assert "invalid JSON" not in message and "(after 2 attempts)" in message, message


def test_a_model_adapter_answering_usage_counts_as_booleans_leaves_its_call_unknown() -> None:
    """docs/interaction.md (finish-reason gate): a usage count that is not a whole number
    (``true``) leaves the model call unknown for a host, whichever model client answered (a
    host's resolution with one is refused the same way). Kills N25 (the model dispatcher read a
    new answer as it reads a history: ``"prompt_tokens": true`` recorded as the run's usage)."""
    from agentfold.adapters.models import ScriptedModel
    from tests.test_mutants_edges import unknown_calls_and_status

    model = ScriptedModel([{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop",
                            "usage": {"prompt_tokens": True, "completion_tokens": 1, "total_tokens": 2}}])
    program = compile_interaction(InteractionConfig(name="models.usage", model=model))
    unknown, status = unknown_calls_and_status(program, "hi")
    assert [(u["kind"], u["diagnostic"]["code"]) for u in unknown] == [("model", "engine.dispatch.failed")], unknown
    assert "usage" in unknown[0]["diagnostic"]["message"], unknown[0]["diagnostic"]
    assert status == "running"  # parked on the unknown call: nothing recorded as its answer


def test_a_providers_own_finish_reasons_are_read_as_their_portable_equivalents() -> None:
    """docs/interaction.md (finish-reason gate): ``OpenAIChatModel`` maps ``function_call`` and
    ``tool_use`` to ``tool_calls``, ``max_tokens``/``model_length`` to ``length``,
    ``end_turn``/``stop_sequence``/``eos`` to ``stop``. Kills N37 (``tool_use`` dropped: a proxy's
    tool-call answer read as ``other``, so the Interaction failed with
    ``tool_calls_not_completed`` and no tool ran) and N38 (``end_turn`` dropped: a finished
    answer reported as ``other``)."""
    reasons = {"tool_use": "tool_calls", "function_call": "tool_calls", "end_turn": "stop", "stop_sequence": "stop",
               "eos": "stop", "max_tokens": "length", "model_length": "length", "length": "length", "whatever": "other"}
    bodies = [{"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": reason}]}
              for reason in reasons]
    with serving(lambda h: send_json(h, bodies.pop(0))) as (url, _):
        model = OpenAIChatModel(url, "m", timeout=5)
        read = {reason: model.call(request())["finish_reason"] for reason in reasons}
    assert read == reasons


class _Lenient:
    """A tool whose every argument is optional: any object passes its schema."""

    name = "send_report"
    description = "Sends the report (to the default list when no address is given)."
    parameters = {"type": "object", "properties": {"to": {"type": "string"}}}

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def call(self, invocation: Any, arguments: Any) -> ToolOutput:
        self.calls.append(arguments)
        return ToolOutput.text("sent")


def test_a_tool_call_whose_arguments_are_not_json_never_runs_and_the_model_is_told_why() -> None:
    """docs/interaction.md (Tool children): arguments that are not JSON get a *rejected* result
    ``error: invalid arguments: ...`` before the tool runs. A model's cut-off JSON is not "no
    arguments": a tool whose arguments are all optional would run with its defaults (here: the
    report sent to everyone). Kills U22 (the tool dispatcher read arguments that do not parse as
    ``{}`` and ran the tool)."""
    tool = _Lenient()
    script = [
        completion(finish_reason="tool_calls", tool_calls=[
            {"id": "call_1", "name": "send_report", "arguments": '{"to": "boss@example.com"'}]),
        completion("I could not send it."),
    ]
    with FakeOpenAI(script) as server:
        result = _run(server, "models.broken_arguments", [{"role": "user", "content": "send it to my boss"}], [tool])
    assert result.status == "completed"
    assert tool.calls == []
    [tool_message] = [m for m in server.requests[1]["messages"] if m["role"] == "tool"]
    assert tool_message["tool_call_id"] == "call_1"
    assert tool_message["content"].startswith("error: invalid arguments: arguments are not valid JSON"), tool_message

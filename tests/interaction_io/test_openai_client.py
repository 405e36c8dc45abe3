"""The OpenAI-compatible client through a real local HTTP server (issue 3, acceptance 6)."""

from __future__ import annotations

import json
from contextlib import contextmanager

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import OpenAIChatModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.tools import ToolOutput
from agentfold.domain.errors import AgentfoldError
from agentfold.domain.interaction.settle import settle_model_result
from agentfold.domain.requests import effect_request
from agentfold.projections.host_views import unknown_effects
from tests.interaction_io.fake_openai import FakeOpenAI, completion


class Weather:
    name = "weather"
    description = "Current weather for a city."
    parameters = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def call(self, invocation, arguments):
        self.calls.append(arguments)
        return ToolOutput.text(f"sunny in {arguments['city']}", {"celsius": 21})


def _program(server: FakeOpenAI, tool: Weather):
    model = OpenAIChatModel(server.base_url, model="gpt-test", api_key="sk-test", timeout=5)
    return compile_interaction(InteractionConfig(name="test.openai", model=model, tools=[tool]))


def test_tool_calls_arguments_and_results_pass_through_the_openai_protocol(tmp_path) -> None:
    script = [
        completion(tool_calls=[{"id": "call_1", "name": "weather", "arguments": '{"city": "Oslo"}'}],
                   finish_reason="tool_calls"),
        completion(content="It is sunny in Oslo.", usage={"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47}),
    ]
    tool = Weather()
    with FakeOpenAI(script) as server:
        program = _program(server, tool)
        store = EventStore(f"sqlite:///{tmp_path / 'a.db'}")
        with Runtime(store, Catalog([program])) as runtime:
            result = runtime.start(program, {"messages": [{"role": "user", "content": "weather in Oslo?"}]}).result(30)
    assert result.status == "completed"
    response = result.output["model_response"]
    assert response["message"]["content"][0]["text"] == "It is sunny in Oslo."
    assert response["usage"] == {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47}
    assert tool.calls == [{"city": "Oslo"}]
    first, second = server.requests
    assert server.headers[0]["Authorization"] == "Bearer sk-test"
    assert first["model"] == "gpt-test"
    assert first["tool_choice"] == "auto"
    assert first["tools"] == [{"type": "function", "function": {
        "name": "weather", "description": "Current weather for a city.", "parameters": Weather.parameters}}]
    assert first["messages"] == [{"role": "user", "content": "weather in Oslo?"}]
    assistant, tool_msg = second["messages"][1], second["messages"][2]
    assert assistant["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    ]
    assert tool_msg["role"] == "tool" and tool_msg["tool_call_id"] == "call_1"
    assert "sunny in Oslo" in tool_msg["content"] and json.loads(tool_msg["content"].split("\n", 1)[1]) == {"celsius": 21}


def test_a_server_error_leaves_the_model_effect_unknown_until_a_host_resolves_it(tmp_path) -> None:
    tool = Weather()
    with FakeOpenAI([]) as server:
        server.fail_with = 500
        program = _program(server, tool)
        store = EventStore(f"sqlite:///{tmp_path / 'b.db'}")
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {"messages": [{"role": "user", "content": "hello"}]})
            tree = runtime.wait_idle(handle.tree_id)
            unknown = unknown_effects(tree, runtime.catalog.resolve)
            assert len(unknown) == 1 and unknown[0]["kind"] == "model"
            assert unknown[0]["diagnostic"]["code"] == "engine.dispatch.failed"
            assert "HTTP 500" in unknown[0]["diagnostic"]["message"]
            assert tree.root.status == "running" and tree.classification() == "parked"
            assert len(server.requests) == 1  # never retried on its own
            request = effect_request(tree, handle.root_process_id, unknown[0]["effect_id"], program)
            settlement = settle_model_result(
                program, request, {"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
            )
            runtime.resolve_unknown_effect(unknown[0]["effect_id"], settlement)
            result = handle.result(30)
    assert result.status == "completed"
    assert result.output["model_response"]["message"]["content"][0]["text"] == "hi"
    assert len(server.requests) == 1


def _retrying(server_url: str, retries: int) -> tuple[OpenAIChatModel, list[float]]:
    model = OpenAIChatModel(server_url, model="gpt-test", timeout=5, max_retries=retries, retry_wait=0.25)
    waits: list[float] = []
    model.sleep = lambda seconds, cancelled: waits.append(seconds)  # the waits it would take, without taking them
    return model, waits


def test_with_max_retries_a_transient_server_error_is_sent_again_and_only_the_answer_is_recorded(tmp_path) -> None:
    with FakeOpenAI([completion("hello")]) as server:
        server.fail_first, server.fail_first_with = 2, 503
        model, waits = _retrying(server.base_url, 2)
        program = compile_interaction(InteractionConfig(name="test.openai.retry", model=model))
        store = EventStore(f"sqlite:///{tmp_path / 'r.db'}")
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {"messages": [{"role": "user", "content": "hi"}]})
            result = handle.result(30)
            events = [r.event for r in store.read(handle.tree_id)]
        store.close()
    assert result.status == "completed"
    assert result.output["model_response"]["message"]["content"][0]["text"] == "hello"
    assert len(server.requests) == 3 and server.requests[0] == server.requests[2]  # the same call, sent again
    assert waits == [0.25, 0.5]
    settled = [e for e in events if type(e).__name__ == "EffectSettled"]
    assert len(settled) == 1 and settled[0].status == "succeeded"  # one model Effect, one settlement


def _parked_unknown(model: OpenAIChatModel, name: str, path) -> dict:
    """Run a one-call Interaction with ``model`` until it parks; its one unknown Effect."""
    program = compile_interaction(InteractionConfig(name=name, model=model))
    store = EventStore(f"sqlite:///{path}")
    with Runtime(store, Catalog([program])) as runtime:
        handle = runtime.start(program, {"messages": [{"role": "user", "content": "hi"}]})
        [unknown] = unknown_effects(runtime.wait_idle(handle.tree_id), runtime.catalog.resolve)
    store.close()
    return unknown


def test_retries_stop_at_max_retries_and_never_follow_a_refusal(tmp_path) -> None:
    with FakeOpenAI([completion("hello")]) as server:
        server.fail_with = 400  # the request itself is wrong: sending it again cannot help
        model, waits = _retrying(server.base_url, 3)
        unknown = _parked_unknown(model, "test.openai.refused", tmp_path / "f.db")
    assert len(server.requests) == 1 and waits == []
    assert "HTTP 400" in unknown["diagnostic"]["message"]
    # Nothing listens: every attempt fails to connect; the call is unknown after 1 + 2 attempts.
    with FakeOpenAI([]) as gone:
        url = gone.base_url
    model, waits = _retrying(url, 2)
    unknown = _parked_unknown(model, "test.openai.unreachable", tmp_path / "u.db")
    assert unknown["kind"] == "model" and waits == [0.25, 0.5]
    assert "unreachable" in unknown["diagnostic"]["message"] and "(after 3 attempts)" in unknown["diagnostic"]["message"]


def test_max_retries_and_retry_wait_are_checked_when_the_model_is_made() -> None:
    for bad in ({"max_retries": -1}, {"max_retries": 11}, {"max_retries": True}, {"retry_wait": 31.0}):
        try:
            OpenAIChatModel("http://127.0.0.1:9/v1", "m", **bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} was accepted")
    # Found by a docs walkthrough: these were taken, and every model call of the run was then
    # recorded unknown (never sent); others raised a bare TypeError/AttributeError.
    bad_settings: list[tuple[tuple[object, ...], dict[str, object]]] = [
        (("http://127.0.0.1:9/v1", "m"), {"timeout": -1}), (("http://127.0.0.1:9/v1", "m"), {"timeout": "60"}),
        (("http://127.0.0.1:9/v1", "m"), {"timeout": float("nan")}), (("http://127.0.0.1:9/v1", "m"), {"timeout": 0}),
        (("http://127.0.0.1:9/v1", "m"), {"retry_wait": "1"}), ((None, "m"), {}), (("127.0.0.1:9/v1", "m"), {}),
        (("http://127.0.0.1:9/v1", ""), {}),
    ]
    for args, kwargs in bad_settings:
        try:
            OpenAIChatModel(*args, **kwargs)  # type: ignore[arg-type]
        except AgentfoldError as exc:
            assert exc.code == "interaction.definition.invalid", exc
            continue
        raise AssertionError(f"{args} {kwargs} was accepted")
    from agentfold.adapters.models import _retry_after

    assert _retry_after(" 7 ") == 7.0 and _retry_after("Wed, 21 Oct 2026 07:28:00 GMT") is None and _retry_after(None) is None


def test_a_canceled_run_stops_waiting_to_send_its_model_call_again(tmp_path) -> None:
    import time

    with FakeOpenAI([]) as server:
        server.fail_with = 503
        model = OpenAIChatModel(server.base_url, model="gpt-test", timeout=5, max_retries=5, retry_wait=20.0)
        program = compile_interaction(InteractionConfig(name="test.openai.cancel", model=model))
        store = EventStore(f"sqlite:///{tmp_path / 'c.db'}")
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {"messages": [{"role": "user", "content": "hi"}]})
            deadline = time.monotonic() + 10
            while not server.requests and time.monotonic() < deadline:
                time.sleep(0.01)
            started = time.monotonic()
            runtime.cancel(handle.root_process_id)
            result = handle.result(timeout=15)
            ended_in = time.monotonic() - started
        store.close()
    assert result.status == "canceled"
    assert ended_in < 5, ended_in  # not the 20 s wait, nor the runtime's 5 s cancellation grace
    assert len(server.requests) == 1  # the wait ended without sending it again


def test_a_model_server_name_that_does_not_resolve_is_not_retried() -> None:
    from agentfold.adapters.models import ModelError, ModelRequest

    model = OpenAIChatModel("http://agentfold-no-such-host.invalid/v1", "m", timeout=5, max_retries=3, retry_wait=0.1)
    waits: list[float] = []
    model.sleep = lambda seconds, cancelled: waits.append(seconds)
    request = ModelRequest(process_id="process:p", model_call_sequence=1, effect_id="effect:" + "0" * 64,  # type: ignore[arg-type]
                           attempt_id=None, messages=({"role": "user", "content": [{"type": "text", "text": "hi"}]},))
    try:
        model.call(request)
    except ModelError as exc:
        assert "unreachable" in str(exc) and "attempts" not in str(exc)
    else:
        raise AssertionError("the call succeeded")
    assert waits == []


class Lookup:
    name = "lookup"
    description = "Looks a thing up; fails for what it does not know."
    parameters = {"type": "object"}

    def call(self, invocation, arguments):
        from agentfold.adapters.tools import ToolFailure

        # Text that starts like the marker is marked too (a review saw "errors: ..." sent unmarked).
        raise ToolFailure("failed", ToolOutput.text("errors: 3 found in the file"))


def test_a_failed_tool_result_reaches_the_model_marked_as_an_error(tmp_path) -> None:
    # Found by a review: a ToolFailure (and a host's failed/rejected resolution) reached an
    # OpenAI model as plain text, indistinguishable from a success, while the docs promise the
    # model sees an error result. Chat completions have no flag for it: the text says so.
    script = [
        completion(tool_calls=[{"id": "call_1", "name": "lookup", "arguments": "{}"},
                               {"id": "call_2", "name": "weather", "arguments": '{"city": "Oslo"}'}],
                   finish_reason="tool_calls"),
        completion(content="Could not look it up."),
    ]
    with FakeOpenAI(script) as server:
        model = OpenAIChatModel(server.base_url, model="gpt-test", api_key="sk-test", timeout=5)
        program = compile_interaction(InteractionConfig(name="test.openai.error", model=model,
                                                        tools=[Lookup(), Weather()]))
        store = EventStore(f"sqlite:///{tmp_path / 'e.db'}")
        with Runtime(store, Catalog([program])) as runtime:
            result = runtime.start(program, {"messages": [{"role": "user", "content": "look it up"}]}).result(30)
    assert result.status == "completed"
    tool_messages = {m["tool_call_id"]: m["content"] for m in server.requests[1]["messages"] if m["role"] == "tool"}
    assert tool_messages["call_1"] == "error: errors: 3 found in the file"
    assert tool_messages["call_2"].startswith("sunny in Oslo")  # a success is sent as it is


@contextmanager
def _unknown_model_call(program, tmp_path):
    """A run of ``program`` on a SQLite store whose first model call is unknown: (runtime, its
    handle, the idle tree, the unknown effect as hosts list it)."""
    store = EventStore(f"sqlite:///{tmp_path / 'u.db'}")
    with Runtime(store, Catalog([program])) as runtime:
        handle = runtime.start(program, {"messages": [{"role": "user", "content": "hello"}]})
        tree = runtime.wait_idle(handle.tree_id)
        [unknown] = unknown_effects(tree, runtime.catalog.resolve)
        yield runtime, handle, tree, unknown


def test_usage_counts_given_as_booleans_are_refused_when_a_host_resolves_a_model_call(tmp_path) -> None:
    # Found by a review: `"usage": {"prompt_tokens": true}` passed and was recorded as `true`
    # (1.5 and -1 were refused). A history that already holds such a response still folds.
    import pytest

    from agentfold.domain.errors import InvalidInput
    from agentfold.domain.interaction.chat import parse_response

    with FakeOpenAI([]) as server:
        server.fail_with = 500
        program = _program(server, Weather())
        with _unknown_model_call(program, tmp_path) as (runtime, handle, tree, unknown):
            request = effect_request(tree, handle.root_process_id, unknown["effect_id"], program)
            response = {"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
            for counts in ({"prompt_tokens": True}, {"completion_tokens": False}, {"total_tokens": 1.5}):
                with pytest.raises(InvalidInput) as refused:
                    settle_model_result(program, request, {**response, "usage": counts})
                assert "usage holds non-negative" in refused.value.message
            settlement = settle_model_result(program, request, {**response, "usage": {"prompt_tokens": 3}})
            runtime.resolve_unknown_effect(unknown["effect_id"], settlement)
            assert handle.result(30).status == "completed"
    recorded = {**response, "usage": {"prompt_tokens": True, "completion_tokens": 0, "total_tokens": 0}}
    assert parse_response(recorded)["usage"] == recorded["usage"]  # read back from a history: as recorded
    with pytest.raises(InvalidInput):
        parse_response(recorded, admitting=True)


def test_usage_counts_that_are_not_whole_numbers_leave_the_call_unknown(tmp_path) -> None:
    # Found by a review: the client coerced a server's usage (true, 2.9, "7") into 1, 2, 7 and
    # recorded it, where a host giving the same response is refused.
    with FakeOpenAI([completion("hi", usage={"prompt_tokens": True, "completion_tokens": 2.9, "total_tokens": "7"})]) as server:
        program = _program(server, Weather())
        with _unknown_model_call(program, tmp_path) as (_, _, _, unknown):
            assert "usage.prompt_tokens is True" in unknown["diagnostic"]["message"], unknown["diagnostic"]
    assert len(server.requests) == 1

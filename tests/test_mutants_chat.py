"""Chat values and the recovery helpers (agentfold.domain.interaction.chat, .settle): behaviour the
mutation audit of 2026-12-05 ("chat") found undefended. Each test failed with its mutant and
passes without it.

chat.py's canonical shapes: tool results only (and always) on tool messages; a content part is
``{"type": "text", "text": ...}`` and nothing else; members with empty values are omitted (a tool
call without arguments has no ``arguments``). docs/interaction.md#recovery: the helpers validate
the request against the exact Program that made it, and the outcome against the rules live
dispatch follows (usage counts are non-negative whole numbers, the finish reason is portable).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.tools import ToolInvocation, ToolOutput
from agentfold.domain.errors import InvalidInput
from agentfold.domain.ids import TreeID
from agentfold.domain.interaction.settle import settle_model_result
from agentfold.domain.program import Program
from agentfold.domain.requests import Settlement
from tests.interaction.support import request_of
from tests.test_host_python import Book  # its reply is lost

DONE = {"message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}
LOST = {"error": "the connection dropped mid-response"}


class Ping:
    name = "ping"
    description = "Answers pong."
    parameters = {"type": "object"}

    def call(self, invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        return ToolOutput.text("pong")


def program(name: str, *responses: dict[str, Any]) -> tuple[Program, ScriptedModel]:
    model = ScriptedModel(list(responses))
    return compile_interaction(InteractionConfig(name=name, model=model, tools=[Ping()])), model


def stored(store: EventStore, start_id: str) -> list[str]:
    return [type(r.event).__name__ for r in store.read(TreeID.for_start(start_id))]


def refused_start(store: EventStore, name: str, run_input: dict[str, Any], start_id: str) -> str:
    """Start a chat Program ``name`` with ``run_input``: refused (``InvalidInput``) with nothing
    stored and no model call made; the refusal's message."""
    agent, model = program(name, DONE)
    with Runtime(store, Catalog([agent])) as runtime:
        with pytest.raises(InvalidInput) as refused:
            runtime.start(agent, run_input, start_id=start_id)
    assert stored(store, start_id) == [] and model.requests == []
    return refused.value.message


@contextlib.contextmanager
def parked_model_call(store: EventStore, start_id: str) -> Iterator[tuple[Runtime, Host, Any, dict[str, Any]]]:
    """A run whose first model call was lost (unknown): (runtime, host, program, the unknown entry)."""
    agent, _ = program("chat.lost", LOST, DONE)
    with Runtime(store, Catalog([agent])) as runtime:
        run = runtime.start(agent, {"messages": [{"role": "user", "content": "Ping it."}]}, start_id=start_id)
        runtime.wait_idle(run.tree_id)
        host = Host(runtime)
        [unknown] = host.unknown(start_id)
        assert unknown["kind"] == "model"
        yield runtime, host, agent, unknown


@pytest.mark.parametrize("message", [
    pytest.param({"role": "user", "content": "hi", "tool_results": [{"id": "c1", "name": "ping", "output": {}}]},
                 id="user"),
    pytest.param({"role": "assistant", "content": "hi",
                  "tool_results": [{"id": "c1", "name": "ping", "output": {"content": "pong"}}]}, id="assistant"),
])
def test_a_message_carrying_tool_results_on_a_role_other_than_tool_is_refused_at_start(
    store: EventStore, message: dict[str, Any]
) -> None:
    refusal = refused_start(store, "chat.input", {"messages": [message]}, "results-on-user")
    assert "only tool messages carry tool results" in refusal


@pytest.mark.parametrize("role", ["user", "system"])
def test_a_message_carrying_tool_calls_on_a_role_other_than_assistant_is_refused_at_start(
    store: EventStore, role: str
) -> None:
    """Read as given, the model would be sent a conversation in which the user (or the system)
    called a tool: one no provider accepts, whose round the Interaction never ran."""
    message = {"role": role, "content": "hi", "tool_calls": [{"id": "c1", "name": "ping", "arguments": "{}"}]}
    refusal = refused_start(store, "chat.calls", {"messages": [message]}, "calls-on-user")
    assert "only assistant messages carry tool calls" in refusal


def test_a_tool_message_without_tool_results_is_refused_at_start(store: EventStore) -> None:
    given = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "pong"}]
    refusal = refused_start(store, "chat.empty-tool", {"messages": given}, "empty-tool")
    assert "input.messages[1].tool_results" in refusal


def test_tool_choice_in_the_input_options_is_refused_at_start(store: EventStore) -> None:
    """Tools and tool_choice come from the Program (its digest covers them), never from an input."""
    given = {"messages": [{"role": "user", "content": "hi"}], "options": {"tool_choice": "none"}}
    assert "tools and tool_choice come from the program" in refused_start(store, "chat.tool-choice", given, "tool-choice")


def test_a_content_part_of_another_type_is_refused_never_read_as_text(store: EventStore) -> None:
    """An image part that also has a ``text`` member (a caption) is not a text part: read as
    one, the model would be sent the caption as if the user had typed it."""
    image = {"role": "user", "content": [{"type": "image", "text": "a cat"}]}
    refusal = refused_start(store, "chat.parts", {"messages": [image]}, "image-part")
    assert "input.messages[0].content[0]" in refusal


def test_a_tool_call_without_arguments_goes_back_to_the_model_without_an_arguments_member(store: EventStore) -> None:
    """The canonical shape omits empty members: a call the model sent with ``"arguments": ""``
    and the same call sent without ``arguments`` are one message (one digest, one history)."""
    for start_id, call in (("empty-args", {"id": "c1", "name": "ping", "arguments": ""}),
                           ("no-args", {"id": "c1", "name": "ping"})):
        agent, model = program(f"chat.{start_id}", {"message": {"role": "assistant", "tool_calls": [call]},
                                                      "finish_reason": "tool_calls"}, DONE)
        with Runtime(store, Catalog([agent])) as runtime:
            run = runtime.start(agent, {"messages": [{"role": "user", "content": "Ping."}]}, start_id=start_id)
            assert run.result(10).status == "completed"
        assert list(model.requests[1].messages[1:]) == [
            {"role": "assistant", "tool_calls": [{"id": "c1", "name": "ping"}]},
            {"role": "tool", "tool_results": [{"id": "c1", "name": "ping",
                                               "output": {"content": [{"type": "text", "text": "pong"}]}}]},
        ]


@pytest.mark.parametrize("usage", [
    pytest.param({"prompt_tokens": -3, "completion_tokens": 2, "total_tokens": 5}, id="negative"),
    pytest.param({"prompt_tokens": 2.5, "completion_tokens": 2, "total_tokens": 5}, id="fraction"),
])
def test_a_model_response_with_a_usage_count_that_is_not_a_whole_non_negative_number_is_refused_at_resolution(
    store: EventStore, usage: dict[str, Any]
) -> None:
    with parked_model_call(store, "bad-usage") as (_runtime, host, _, unknown):
        before = stored(store, "bad-usage")
        with pytest.raises(InvalidInput) as refused:
            host.resolve(unknown["effect_id"], model_response={**DONE, "usage": usage})
        assert "usage holds non-negative prompt_tokens" in refused.value.message
        assert stored(store, "bad-usage") == before
        # The true answer still completes the run, its counts recorded as given.
        good = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        settled = host.resolve(unknown["effect_id"], model_response={**DONE, "usage": good})
        assert settled.payload["model_result"]["response"]["usage"] == good  # type: ignore[index]


def test_tool_calls_ending_with_a_finish_reason_outside_the_portable_set_are_refused_at_resolution(
    store: EventStore,
) -> None:
    """The model dispatcher leaves such an answer unknown; a host's resolution in that
    vocabulary is refused (with tool calls too: no final-answer rule applies to them)."""
    response = {"message": {"role": "assistant", "tool_calls": [{"id": "c1", "name": "ping", "arguments": "{}"}]},
                "finish_reason": "function_call"}
    with parked_model_call(store, "bad-reason") as (_runtime, host, _, unknown):
        before = stored(store, "bad-reason")
        with pytest.raises(InvalidInput) as refused:
            host.resolve(unknown["effect_id"], model_response=response)
        assert "unknown finish reason 'function_call'" in refused.value.message
        assert stored(store, "bad-reason") == before
        assert [u["effect_id"] for u in host.unknown("bad-reason")] == [unknown["effect_id"]]


@pytest.mark.parametrize("reason", ["stop", "content_filter"])
def test_tool_calls_with_a_finish_reason_that_does_not_complete_them_are_refused_at_resolution(
    store: EventStore, reason: str
) -> None:
    """docs/cli.md (resolve): a model response the Interaction would reject is refused. Tool calls
    that end with another reason than ``tool_calls``/``length`` fail the run for good
    (``interaction.model.tool_calls_not_completed``): the resolution was recorded and the run
    failed at once, leaving the host no way to say what the model really answered."""
    response = {"message": {"role": "assistant", "tool_calls": [{"id": "c1", "name": "ping", "arguments": "{}"}]},
                "finish_reason": reason}
    with parked_model_call(store, "not-completed") as (runtime, host, _, unknown):
        before = stored(store, "not-completed")
        with pytest.raises(InvalidInput) as refused:
            host.resolve(unknown["effect_id"], model_response=response)
        assert refused.value.code == "interaction.settlement.invalid"
        assert f'model output ended with "{reason}"; tool calls were not executed' in refused.value.message
        assert stored(store, "not-completed") == before
        host.resolve(unknown["effect_id"], model_response={**response, "finish_reason": "tool_calls"})
        assert runtime.result(TreeID.for_start("not-completed"), 10).status == "completed"


def test_the_model_helper_refuses_a_request_made_by_another_version_of_the_program(store: EventStore) -> None:
    """Same name, another tool set: another ProgramRef. The helper validates against the exact
    Program that made the request, never against rules the run did not follow."""
    with parked_model_call(store, "other-program") as (runtime, _host, agent, unknown):
        tree = runtime.wait_idle(TreeID.for_start("other-program"))
        request = request_of(runtime, tree, unknown["process_id"], unknown["effect_id"])
        assert settle_model_result(agent, request, DONE).payload["model_result"]["response"] == {  # type: ignore[index]
            **DONE, "message": {"role": "assistant", "content": [{"type": "text", "text": "done"}]}}
        other = compile_interaction(InteractionConfig(name="chat.lost", model=ScriptedModel([DONE])))
        assert other.ref.name == agent.ref.name and other.ref != agent.ref
        with pytest.raises(InvalidInput) as refused:
            settle_model_result(other, request, DONE)
        assert refused.value.code == "interaction.settlement.invalid"
        assert "not by this program" in refused.value.message


@pytest.mark.parametrize("disposition", ["cancelled", "ok"])
def test_a_tool_outcome_with_a_disposition_outside_succeeded_failed_rejected_is_refused_and_appends_nothing(
    store: EventStore, disposition: str
) -> None:
    """A settlement built by hand (``Runtime.resolve_unknown_effect``) with another disposition is
    not one live dispatch returns: refused before it is recorded, the call stays unknown."""
    model = ScriptedModel([{"message": {"role": "assistant", "tool_calls": [{"id": "c1", "name": "book"}]},
                            "finish_reason": "tool_calls"}, DONE])
    agent = compile_interaction(InteractionConfig(name="chat.lost-tool", model=model, tools=[Book()]))
    with Runtime(store, Catalog([agent])) as runtime:
        run = runtime.start(agent, {"messages": [{"role": "user", "content": "Go."}]}, start_id="lost-tool")
        runtime.wait_idle(run.tree_id)
        host = Host(runtime)
        [unknown] = host.unknown("lost-tool")
        assert unknown["kind"] == "tool"
        before = stored(store, "lost-tool")
        output = {"content": [{"type": "text", "text": "gone"}]}
        forged = Settlement.succeeded({"tool_result": {"completion": {"disposition": disposition, "output": output}}})
        with pytest.raises(InvalidInput) as refused:
            runtime.resolve_unknown_effect(unknown["effect_id"], forged)
        assert refused.value.code == "interaction.settlement.invalid"
        assert "disposition must be one of" in refused.value.message
        assert stored(store, "lost-tool") == before
        assert [u["effect_id"] for u in host.unknown("lost-tool")] == [unknown["effect_id"]]

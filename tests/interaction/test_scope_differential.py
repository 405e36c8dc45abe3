"""Interaction behaviours the §11 scenarios leave open, pinned to Scope's source.

A differential probe of agentfold against Scope (``Tangerg/scope``, ``agent/interaction``)
found these: each test names the Go function whose behaviour it follows.
Real stores (memory and SQLite), real tools, the scripted model or a local server that
speaks the OpenAI protocol.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.interaction import Delegate, InteractionConfig, compile_interaction
from agentfold.adapters.models import OpenAIChatModel, ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.scenario import ScenarioError, validate_scenario
from agentfold.adapters.tools import ToolFailure, ToolInvocation, ToolOutput
from agentfold.domain.errors import ClassifiedError, FailureKind
from agentfold.domain.interaction.interaction import CompletionCandidate, CompletionDecision
from agentfold.domain.program import Program
from tests.interaction.support import open_runtime, unknown_of
from tests.interaction.tools import WAIT, CallLog, ProbeTool, call, chat_input, final, text_of, tool_round, user
from tests.interaction_io.fake_openai import FakeOpenAI, completion


def interaction(model: Any, tools: list[Any] = (), name: str = "test.interaction", **options: Any) -> Program:  # type: ignore[assignment]
    return compile_interaction(InteractionConfig(name=name, model=model, tools=list(tools), **options))


def tool_results(request: Any) -> list[tuple[str, str, bool | None]]:
    [message] = [m for m in request.messages if m["role"] == "tool"][-1:]
    return [(r["id"], text_of(r["output"]), r.get("is_error")) for r in message["tool_results"]]


# -- final responses ---------------------------------------------------------------------------


@pytest.mark.parametrize("reason", ["length", "content_filter", "refusal", "other", "tool_calls"])
def test_a_final_answer_completes_whatever_portable_reason_it_ended_with(local_store_url: str, reason: str) -> None:
    """``execution.go`` acceptFinalModelResponse: a final response (no tool calls) needs a
    message and a finish reason, nothing more; the Output carries the reason, so the host
    sees that the answer was cut short or filtered."""
    model = ScriptedModel([final("partial answ", reason=reason)])
    program = interaction(model)
    with open_runtime(local_store_url, program) as runtime:
        result = runtime.start(program, chat_input("answer")).result(WAIT)
    assert result.status == "completed", result
    assert result.output["model_calls"] == 1
    assert result.output["model_response"]["finish_reason"] == reason
    assert text_of(result.output["model_response"]["message"]) == "partial answ"


def test_duplicate_tool_call_ids_fail_the_run_as_an_invalid_model_response(local_store_url: str) -> None:
    """``state.go`` validatedToolCalls: the model dispatcher records the response; the
    Interaction refuses it (external ``interaction.model.invalid_response``), so the run
    fails instead of parking on a host with an unknown model call. No tool runs."""
    log = CallLog()
    model = ScriptedModel([tool_round(call("same", "alpha"), call("same", "alpha")), final("never")])
    program = interaction(model, [ProbeTool("alpha", log)])
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("go"))
        result = handle.result(WAIT)
        tree = runtime.capture(handle.tree_id)
        assert unknown_of(runtime, tree) == []
    assert result.status == "failed"
    failure = result.termination["failure"]
    assert (failure["kind"], failure["code"]) == ("external", "interaction.model.invalid_response")
    assert "unique" in failure["message"]
    assert log.count() == 0 and len(model.requests) == 1


@pytest.mark.parametrize("reason", ["banana", "error", "eos"])
def test_a_finish_reason_outside_the_portable_set_leaves_the_model_call_unknown(local_store_url: str, reason: str) -> None:
    """``dispatcher.go``: an invalid response is a dispatcher error, so the call's outcome is
    unknown (spec 2.8); the run neither completes on it nor fails. A host settles it."""
    model = ScriptedModel([final("odd", reason=reason)])
    program = interaction(model)
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("answer"))
        tree = runtime.wait_idle(handle.tree_id)
        [unknown] = unknown_of(runtime, tree)
        assert unknown["kind"] == "model"
        assert reason in unknown["diagnostic"]["message"], unknown
        assert tree.root.status == "running"


def test_a_scenario_with_a_finish_reason_outside_the_portable_set_is_refused_with_its_path() -> None:
    doc = {"name": "odd", "input": {"messages": [user("hi")]},
           "model": {"responses": [{"finish_reason": "stop", "message": {"content": "ok"}},
                                   {"finish_reason": "eos", "message": {"content": "odd"}}]}}
    with pytest.raises(ScenarioError) as refused:
        validate_scenario(doc)
    assert refused.value.code == "scenario.invalid"
    assert refused.value.message.startswith("$.model.responses[1].finish_reason: 'eos' is not one of stop, length")


def test_an_openai_compatible_servers_own_finish_reasons_are_mapped_onto_the_portable_set(tmp_path: Path) -> None:
    """Scope's model adapters map native reasons onto ``chat.FinishReason``: ``function_call``
    with tool calls runs them, truncation stays ``length`` (a cut-off answer is never taken
    for a finished one), an unknown reason is ``other``; a legacy ``function_call`` message
    (no tool calls) leaves the call unknown instead of completing without it."""
    script = [
        completion(tool_calls=[{"id": "c1", "name": "alpha", "arguments": "{}"}], finish_reason="function_call"),
        completion(content="cut o", finish_reason="max_tokens"),
    ]
    log = CallLog()
    store = EventStore(f"sqlite:///{tmp_path / 'a.db'}")
    with FakeOpenAI(script) as server:
        program = interaction(OpenAIChatModel(server.base_url, model="m", timeout=5), [ProbeTool("alpha", log)])
        with Runtime(store, Catalog([program])) as runtime:
            result = runtime.start(program, chat_input("go")).result(WAIT)
    assert result.status == "completed", result
    assert log.count("alpha") == 1
    assert result.output["model_response"]["finish_reason"] == "length"

    odd = completion(content="done", finish_reason="weird_reason")
    legacy = completion(content=None, finish_reason="function_call")
    legacy["choices"][0]["message"]["function_call"] = {"name": "alpha", "arguments": "{}"}
    with FakeOpenAI([odd, legacy]) as server:
        program = interaction(OpenAIChatModel(server.base_url, model="m", timeout=5), [ProbeTool("alpha", log)])
        with Runtime(store, Catalog([program])) as runtime:
            assert runtime.start(program, chat_input("go")).result(WAIT).output["model_response"]["finish_reason"] == "other"
            handle = runtime.start(program, chat_input("again"))
            [unknown] = unknown_of(runtime, runtime.wait_idle(handle.tree_id))
            assert "legacy function_call" in unknown["diagnostic"]["message"], unknown
    store.close()
    assert log.count("alpha") == 1


# -- completion validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "kind", "code"),
    [
        ("classified_error", "execution", "interaction.completion.validator_failed"),
        ("lone_surrogate", "contract", "interaction.completion.decision_invalid"),
        ("feedback_not_text", "contract", "interaction.completion.decision_invalid"),
        ("accepted_not_bool", "contract", "interaction.completion.decision_invalid"),
    ],
)
def test_every_validator_error_and_every_invalid_decision_has_the_interactions_code(
    local_store_url: str, case: str, kind: str, code: str
) -> None:
    """``execution.go`` finishOrRetry: any validator error is ``validator_failed`` (a
    classified one too, whatever its own code); any invalid decision, including feedback
    that is not valid UTF-8 or not text, is ``decision_invalid``: never an unclassified
    step failure."""

    def validator(candidate: CompletionCandidate) -> CompletionDecision:
        if case == "classified_error":
            raise ClassifiedError(FailureKind.EXTERNAL, "checker.unavailable", "the checker's backend is down")
        if case == "lone_surrogate":
            return CompletionDecision(False, "cite \ud800 sources")
        if case == "feedback_not_text":
            return CompletionDecision(False, 42)  # type: ignore[arg-type]
        return CompletionDecision("yes", "")  # type: ignore[arg-type]

    model = ScriptedModel([final("candidate")])
    program = interaction(model, completion_validator=validator, max_model_calls=2)
    with open_runtime(local_store_url, program) as runtime:
        result = runtime.start(program, chat_input("answer")).result(WAIT)
    assert result.status == "failed"
    failure = result.termination["failure"]
    assert (failure["kind"], failure["code"]) == (kind, code), failure
    if case == "classified_error":
        assert "the checker's backend is down" in failure["message"]
    else:
        assert failure["message"].startswith("CompletionValidator returned an invalid decision")


def test_feedback_is_trimmed_as_go_trims_it(local_store_url: str) -> None:
    """``CompletionDecision.Valid`` uses Go's ``strings.TrimSpace``: a trailing U+001F is not
    white space there (Python's ``str.strip`` would take it), so the feedback is valid and
    reaches the model; a trailing U+00A0 is, so that feedback is invalid."""
    decisions = iter([CompletionDecision(False, "cite sources\x1f"), CompletionDecision(True)])
    model = ScriptedModel([final("one"), final("two")])
    program = interaction(model, completion_validator=lambda c: next(decisions), max_model_calls=2)
    with open_runtime(local_store_url, program) as runtime:
        result = runtime.start(program, chat_input("answer")).result(WAIT)
    assert result.status == "completed" and result.output["model_calls"] == 2
    assert text_of(model.requests[1].messages[-1]) == "cite sources\x1f"
    assert not CompletionDecision(False, "cite sources\xa0").valid()


def test_the_model_call_limit_failure_says_what_scope_says(local_store_url: str) -> None:
    model = ScriptedModel([tool_round(call("c1", "alpha")), final("never")])
    program = interaction(model, [ProbeTool("alpha", CallLog())], max_model_calls=1)
    with open_runtime(local_store_url, program) as runtime:
        result = runtime.start(program, chat_input("go")).result(WAIT)
    failure = result.termination["failure"]
    assert failure["code"] == "interaction.limit.model_calls"
    assert failure["message"] == "Interaction reached its configured model-call limit (1) before a final response"


# -- tools ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, 1])
def test_no_concurrency_classifier_runs_when_every_window_is_one_call(local_store_url: str, limit: int) -> None:
    """``execution.go`` startToolChildren: the window is classified only when
    ``MaxConcurrentToolCalls > 1``; with 0 or 1 a classifier that would raise never runs."""
    log = CallLog()

    def broken(call_: Any, arguments: Any) -> tuple[str, bool]:
        raise RuntimeError("the classifier is broken")

    model = ScriptedModel([tool_round(call("c1", "alpha"), call("c2", "alpha")), final("done")])
    program = interaction(model, [ProbeTool("alpha", log, concurrency=broken)], max_concurrent_tool_calls=limit)
    with open_runtime(local_store_url, program) as runtime:
        result = runtime.start(program, chat_input("go")).result(WAIT)
    assert result.status == "completed", result
    assert log.count("alpha") == 2


def test_deferred_tools_are_advertised_in_the_order_the_tool_named_them(local_store_url: str) -> None:
    """``advertisement.go``: names are kept in first-seen order (no sorting), and the next
    model request lists them after the initial tools in that order."""
    log = CallLog()
    finder = ProbeTool("finder", log, advertise=lambda invocation, output: ["zeta", "alpha", "zeta"])
    model = ScriptedModel([tool_round(call("c1", "finder")), final("done")])
    program = interaction(model, [finder], deferred_tools=[ProbeTool("alpha", log), ProbeTool("zeta", log)])
    with open_runtime(local_store_url, program) as runtime:
        result = runtime.start(program, chat_input("go")).result(WAIT)
    assert result.status == "completed"
    assert [t["name"] for t in model.requests[0].tools] == ["finder"]
    assert [t["name"] for t in model.requests[1].tools] == ["finder", "zeta", "alpha"]


def test_a_tool_failure_inside_an_exception_group_is_a_definite_result(local_store_url: str) -> None:
    """``model_tool_result.go``: ``errors.As`` walks joined errors, so a ``tool.Failure``
    among them is definite (rule 4 precedes rule 5, cancellation). An ExceptionGroup is
    Python's errors.Join."""
    log = CallLog()

    def grouped(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        raise ExceptionGroup("cleanup", [TimeoutError("slow"), ToolFailure("failed", "error: wrote 2 of 5 rows")])

    model = ScriptedModel([tool_round(call("c1", "grouped")), final("noted")])
    program = interaction(model, [ProbeTool("grouped", log, grouped)])
    with open_runtime(local_store_url, program) as runtime:
        result = runtime.start(program, chat_input("go")).result(WAIT)
    assert result.status == "completed"
    assert tool_results(model.requests[1]) == [("c1", "error: wrote 2 of 5 rows", True)]


# -- delegates -----------------------------------------------------------------------------------

TASK_SCHEMA = {"type": "object", "required": ["task"], "properties": {"task": {"type": "string"}},
               "additionalProperties": False}


def test_a_delegate_whose_input_cannot_be_built_gets_a_rejected_result_and_the_round_goes_on(local_store_url: str) -> None:
    """``delegate.go`` prepareInput (spec 4.1): every preparation problem of a Delegate call is
    a model-visible rejected result and no child Process; a raising ``build_input`` (ours)
    is one, so is one that returns something that is not JSON."""
    worker_model = ScriptedModel([final("did it")])
    worker = interaction(worker_model, name="test.worker")

    def build_input(arguments: Any) -> Any:
        if arguments["task"] == "explode":
            raise KeyError("no such template")
        if arguments["task"] == "set":
            return {"messages": {1, 2}}
        return {"messages": [user(f"task: {arguments['task']}")]}

    model = ScriptedModel([
        tool_round(call("d1", "helper", {"task": "explode"}), call("d2", "helper", {"task": "set"}),
                   call("d3", "helper", {"task": "fine"})),
        final("understood"),
    ])
    program = interaction(model, delegates=[Delegate("helper", "Helps.", worker, TASK_SCHEMA, build_input=build_input)])
    with open_runtime(local_store_url, program, worker) as runtime:
        handle = runtime.start(program, chat_input("go"))
        result = handle.result(WAIT)
        tree = runtime.capture(handle.tree_id)
    assert result.status == "completed", result
    assert len(tree.processes) == 2  # only d3's worker started
    [(i1, t1, e1), (i2, t2, e2), (i3, _, e3)] = tool_results(model.requests[1])
    assert (i1, e1) == ("d1", True)
    assert t1 == "error: preparing the delegated worker input failed: KeyError: 'no such template'"
    assert (i2, e2) == ("d2", True) and t2.startswith("error: preparing the delegated worker input failed: ")
    assert (i3, e3) == ("d3", None) and len(worker_model.requests) == 1


def test_a_hosts_settlement_keeps_the_advertised_names_in_the_order_given(local_store_url: str) -> None:
    """The same first-seen order when a host settles an unknown call with ``settle_tool_result``
    (it sorted them, so the next request's tool list depended on who settled the call)."""
    from agentfold.domain.interaction.settle import settle_tool_result
    from tests.interaction.support import request_of

    def lost(invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        raise TimeoutError("the index did not answer")

    log = CallLog()
    model = ScriptedModel([tool_round(call("c1", "finder")), final("done")])
    program = interaction(model, [ProbeTool("finder", log, lost)],
                          deferred_tools=[ProbeTool("alpha", log), ProbeTool("zeta", log)])
    with open_runtime(local_store_url, program) as runtime:
        handle = runtime.start(program, chat_input("go"))
        tree = runtime.wait_idle(handle.tree_id)
        [unknown] = unknown_of(runtime, tree)
        request = request_of(runtime, tree, unknown["process_id"], unknown["effect_id"])
        tools = program.strategy.definition.tool_program  # type: ignore[attr-defined]
        settlement = settle_tool_result(tools, request, "found", "succeeded", ["zeta", "alpha", "zeta"])
        assert settlement.payload["tool_result"]["completion"]["advertised_tool_names"] == ["zeta", "alpha"]
        runtime.resolve_unknown_effect(unknown["effect_id"], settlement)
        assert handle.result(WAIT).status == "completed"
    assert [t["name"] for t in model.requests[1].tools] == ["finder", "zeta", "alpha"]

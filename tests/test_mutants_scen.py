"""Scenario files do what the file says (docs/scenarios.md): mutation audit "scen".

Each test names a promise of docs/scenarios.md that a planted bug broke while the suite still
passed: a member read and then silently ignored (a limit, a tool's ``parameters``, a Delegate's
``input``), a fault accepted or a valid value refused, a relative side-effect log resolved
against the wrong folder, two documents sharing one Tool Program. In-process and fast: a
Runtime on a memory store, the loader on a file in ``tmp_path``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.scenario import (
    ScenarioError,
    confine_side_effect_logs,
    scenario_catalog,
    scenario_input,
    scenario_program,
    validate_scenario,
)
from agentfold.domain.tree import TreeState


def calls(*names: str, arguments: str = "{}") -> dict[str, Any]:
    tool_calls = [{"id": f"call_{i}", "name": name, "arguments": arguments} for i, name in enumerate(names)]
    return {"finish_reason": "tool_calls", "message": {"content": "", "tool_calls": tool_calls}}


def stop(text: str) -> dict[str, Any]:
    return {"finish_reason": "stop", "message": {"content": text}}


def run(doc: dict[str, Any], store: EventStore | None = None, start_id: str = "scen") -> TreeState:
    """Run a validated scenario until it ends; its tree."""
    doc = validate_scenario(doc)
    with Runtime(store or EventStore("memory:"), scenario_catalog()) as runtime:
        handle = runtime.start(scenario_program(doc), scenario_input(doc), start_id=start_id, configuration=doc)
        handle.result(timeout=30)
        return runtime.capture(handle.tree_id)


def parked_call(doc: dict[str, Any], start_id: str) -> dict[str, Any]:
    """Run a scenario whose script ends before the run does: the next model call is unknown
    and parks the run; that call's stored ``model_call`` request."""
    doc = validate_scenario(doc)
    with Runtime(EventStore("memory:"), scenario_catalog()) as runtime:
        handle = runtime.start(scenario_program(doc), scenario_input(doc), start_id=start_id, configuration=doc)
        tree = runtime.wait_idle(handle.tree_id, timeout=30)
    (unknown,) = tree.unknown_ids
    _, call = tree.find_effect(unknown)
    return dict(call.payload["model_call"])


def log_lines(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def refusal(doc: dict[str, Any]) -> ScenarioError:
    with pytest.raises(ScenarioError) as caught:
        validate_scenario(doc)
    assert caught.value.code == "scenario.invalid"
    return caught.value


# --- members that must not be silently ignored -------------------------------------------


def test_a_scenarios_max_model_calls_ends_the_run_at_that_many_model_calls(tmp_path: Path) -> None:
    log = tmp_path / "tools.jsonl"
    doc = {
        "name": "looping",
        "model": {"responses": [calls("t"), calls("t"), calls("t"), stop("never reached")]},
        "tools": [{"name": "t", "result": {"output": "ok"}}],
        "limits": {"max_model_calls": 2},
        "side_effect_log": str(log),
    }
    tree = run(doc)
    assert tree.root.status == "failed"
    assert tree.root.termination is not None and tree.root.termination.failure is not None
    assert tree.root.termination.failure.code == "interaction.limit.model_calls"
    assert len(log_lines(log)) == 2  # two model calls, two tool calls; the third was never asked


def test_a_scenarios_max_concurrent_tool_calls_above_the_default_widens_the_tree_limit() -> None:
    # docs/scenarios.md (limits): above the default 16, that many children of one Process may
    # be active at once; a round of 20 concurrent calls all run.
    n = 20
    doc = {
        "name": "wide",
        "model": {"responses": [calls(*["t"] * n), stop("done")]},
        "tools": [{"name": "t", "concurrency": {"key": "", "concurrent": True}, "result": {"output": "ok"}}],
        "limits": {"max_concurrent_tool_calls": n},
    }
    tree = run(doc)
    assert tree.root.status == "completed"
    assert tree.limits.max_active_children == n


def test_tool_calls_declared_concurrent_are_started_side_by_side_within_the_limit() -> None:
    # docs/scenarios.md (tools.concurrency): calls declared concurrent may run side by side (up
    # to max_concurrent_tool_calls); a tool without it runs alone. The stored history shows it:
    # both Tool children start before either ends.
    doc = validate_scenario({
        "name": "side-by-side",
        "model": {"responses": [calls("t", "t"), stop("done")]},
        "tools": [{"name": "t", "concurrency": {"key": "", "concurrent": True}, "result": {"output": "ok"}}],
        "limits": {"max_concurrent_tool_calls": 2},
    })
    store = EventStore("memory:")
    with Runtime(store, scenario_catalog()) as runtime:
        handle = runtime.start(scenario_program(doc), scenario_input(doc), start_id="wide", configuration=doc)
        assert handle.result(timeout=30).status == "completed"
    kinds = [type(e.event).__name__ for e in store.read(handle.tree_id)]
    children = [k for k in kinds if k in ("ProcessStarted", "ProcessTerminated")]
    assert children[:2] == ["ProcessStarted", "ProcessStarted"], children


def test_a_delegates_own_input_is_what_its_child_interaction_receives() -> None:
    fixed = {"messages": [{"role": "user", "content": "write the fixed brief"}]}
    nested = {"name": "writer", "input": fixed, "model": {"responses": [stop("written")]}}
    doc = {
        "name": "boss",
        "model": {"responses": [calls("writer", arguments='{"topic": "ignored"}'), stop("done")]},
        "delegates": [{"name": "writer", "input_schema": {"type": "object"}, "scenario": nested}],
    }
    tree = run(doc)
    (child,) = [p for p in tree.processes.values() if p.parent_id == tree.root.process_id]
    assert child.status == "completed"
    assert child.input == fixed


def test_two_documents_that_differ_only_in_their_side_effect_log_append_each_to_its_own(tmp_path: Path) -> None:
    # One long-lived runtime (serve, the Python API) running both: the Tool child Program must
    # be each document's own, or the second run appends to the first run's log.
    def doc(log: Path) -> dict[str, Any]:
        return {"name": "same", "model": {"responses": [calls("t"), stop("done")]},
                "tools": [{"name": "t", "result": {"output": "ok"}}], "side_effect_log": str(log)}

    first, second = validate_scenario(doc(tmp_path / "first.jsonl")), validate_scenario(doc(tmp_path / "second.jsonl"))
    with Runtime(EventStore("memory:"), scenario_catalog()) as runtime:
        for i, d in enumerate((first, second)):
            handle = runtime.start(scenario_program(d), scenario_input(d), start_id=f"s{i}", configuration=d)
            assert handle.result(timeout=30).status == "completed"
    assert len(log_lines(tmp_path / "first.jsonl")) == 1
    assert len(log_lines(tmp_path / "second.jsonl")) == 1


def test_a_scenario_without_input_asks_with_one_user_message_holding_its_name() -> None:
    doc = validate_scenario({"name": "plan a trip", "description": "free text", "model": {"responses": [stop("ok")]}})
    assert scenario_input(doc) == {"messages": [{"role": "user", "content": "plan a trip"}]}


def test_a_deferred_tool_is_shown_to_the_model_after_a_call_of_the_tool_that_advertises_it() -> None:
    # The script ends after the first round: the second model call is unknown and parks the
    # run, its request (what the model is sent) stored with the Effect.
    second_call = parked_call({
        "name": "discovery",
        "model": {"responses": [calls("finder")]},
        "tools": [{"name": "finder", "advertises": ["secret"], "result": {"output": "found it"}},
                  {"name": "secret", "deferred": True, "result": {"output": "ran"}}],
    }, "deferred")
    assert second_call["model_call_sequence"] == 2
    assert second_call["advertised_tool_names"] == ["secret"]


def test_a_server_refuses_a_delegates_side_effect_log_outside_its_folder_naming_where(tmp_path: Path) -> None:
    # What POST /runs checks before it starts a scenario (http_api: confine_side_effect_logs):
    # a nested scenario's log is the client's as much as the root's.
    (tmp_path / "allowed").mkdir()
    nested = {"name": "w", "model": {"responses": [stop("w")]}, "side_effect_log": str(tmp_path / "outside.jsonl")}
    doc = validate_scenario({"name": "d", "model": {"responses": [stop("ok")]},
                             "delegates": [{"name": "w", "input_schema": {"type": "object"}, "scenario": nested}]})
    with pytest.raises(ScenarioError) as caught:
        confine_side_effect_logs(doc, tmp_path / "allowed")
    assert caught.value.details["path"] == "$.delegates[0].scenario.side_effect_log"


# --- what is refused, and what is not -------------------------------------------------------


def test_a_max_concurrent_tool_calls_of_zero_is_accepted_as_one_call_at_a_time() -> None:
    doc = {"name": "z", "model": {"responses": [stop("ok")]}, "tools": [{"name": "t", "result": {"output": "x"}}],
           "limits": {"max_concurrent_tool_calls": 0}}
    assert validate_scenario(doc)["limits"] == {"max_concurrent_tool_calls": 0}


def test_a_max_concurrent_tool_calls_with_only_delegates_is_accepted() -> None:
    nested = {"name": "w", "model": {"responses": [stop("w")]}}
    doc = {"name": "d", "model": {"responses": [stop("ok")]}, "limits": {"max_concurrent_tool_calls": 2},
           "delegates": [{"name": "w", "input_schema": {"type": "object"}, "scenario": nested}]}
    assert validate_scenario(doc)["limits"] == {"max_concurrent_tool_calls": 2}


def test_a_max_model_calls_of_zero_is_refused_with_its_path() -> None:
    error = refusal({"name": "z", "model": {"responses": [stop("ok")]}, "limits": {"max_model_calls": 0}})
    assert error.details["path"] == "$.limits.max_model_calls"


def test_a_delegate_named_like_a_tool_is_refused_with_its_path() -> None:
    nested = {"name": "w", "model": {"responses": [stop("w")]}}
    error = refusal({"name": "d", "model": {"responses": [stop("ok")]},
                     "tools": [{"name": "lookup", "result": {"output": "x"}}],
                     "delegates": [{"name": "lookup", "input_schema": {"type": "object"}, "scenario": nested}]})
    assert error.details["path"] == "$.delegates[0].name"


def test_a_delegate_whose_input_schema_is_not_an_object_schema_is_refused_with_its_path() -> None:
    nested = {"name": "w", "model": {"responses": [stop("w")]}}
    error = refusal({"name": "d", "model": {"responses": [stop("ok")]},
                     "delegates": [{"name": "w", "input_schema": {"type": "string"}, "scenario": nested}]})
    assert error.details["path"] == "$.delegates[0].input_schema"


def test_an_unknown_member_of_a_tool_is_refused_with_its_path() -> None:
    error = refusal({"name": "d", "model": {"responses": [stop("ok")]},
                     "tools": [{"name": "t", "result": {"output": "x"}, "colour": "red"}]})
    assert error.details["path"] == "$.tools[0].colour"


def test_a_failure_result_of_a_kind_other_than_failed_or_rejected_is_refused_with_its_path() -> None:
    error = refusal({"name": "d", "model": {"responses": [stop("ok")]},
                     "tools": [{"name": "t", "result": {"failure": {"kind": "unknown", "output": "x"}}}]})
    assert error.details["path"] == "$.tools[0].result.failure.kind"

"""A Delegate's ``budget`` and a scenario's ``tool_budget`` (docs/scenarios.md).

Releases before 2026-12-01 accepted a Delegate's ``budget`` and ignored it: the Delegate's
child ran unlimited. Now the budget is granted to the child (and enforced by the kernel),
a grant the kernel would refuse at the first call (a Tool child or nested Delegate without
a finite budget under a finite one, or with more than it) is refused when the scenario is
loaded, and trees stored by earlier releases still load under the identity they were
stored with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.scenario import (
    ScenarioError,
    scenario_catalog,
    scenario_input,
    scenario_program,
    unbudgeted_scenario_program,
    validate_scenario,
)
from agentfold.domain.tree import TreeState
from tests.test_cli import agentfold, ok, refused, sqlite_url


def calls(*names: str) -> dict[str, Any]:
    tool_calls = [{"id": f"call_{i}", "name": name, "arguments": "{}"} for i, name in enumerate(names)]
    return {"finish_reason": "tool_calls", "message": {"content": "", "tool_calls": tool_calls}}


def stop(text: str) -> dict[str, Any]:
    return {"finish_reason": "stop", "message": {"content": text}}


LOOKUP = {"name": "lookup", "parameters": {"type": "object"}, "result": {"output": "found"}}


def inner(*, tools: bool = True, **members: Any) -> dict[str, Any]:
    """The Delegate's scenario: one tool round (when ``tools``), then an answer."""
    responses = [calls("lookup"), stop("written")] if tools else [stop("written")]
    return {"name": "writer", "model": {"responses": responses}, **({"tools": [LOOKUP]} if tools else {}), **members}


def boss(delegate_scenario: dict[str, Any], budget: Any = None) -> dict[str, Any]:
    delegate: dict[str, Any] = {"name": "writer", "input_schema": {"type": "object"}, "scenario": delegate_scenario}
    if budget is not None:
        delegate["budget"] = budget
    return {
        "name": "boss",
        "model": {"responses": [calls("writer"), stop("done")]},
        "delegates": [delegate],
    }


def run(doc: dict[str, Any], start_id: str = "budgets") -> TreeState:
    program = scenario_program(validate_scenario(doc))
    store = EventStore("memory:")
    with Runtime(store, scenario_catalog()) as runtime:
        handle = runtime.start(program, scenario_input(doc), start_id=start_id, configuration=validate_scenario(doc))
        assert handle.result(timeout=30).status == "completed"
        return runtime.capture(handle.tree_id)


def delegate_child(tree: TreeState) -> Any:
    (child,) = [p for p in tree.processes.values() if p.parent_id == tree.root.process_id]
    return child


def test_a_delegate_budget_is_granted_to_its_child_and_its_tool_budget_to_each_tool_child() -> None:
    limits = {"steps": {"maximum": 40}, "effects": {"maximum": 30}, "signals": {"maximum": 50}}
    tree = run(boss(inner(tool_budget={"steps": 4, "effects": 4, "signals": 8}), limits))
    child = delegate_child(tree)
    assert child.status == "completed"
    assert child.budget.to_json() == limits
    (tool,) = [p for p in tree.processes.values() if p.parent_id == child.process_id]
    assert tool.status == "completed"
    assert tool.budget.to_json() == {"steps": {"maximum": 4}, "effects": {"maximum": 4}, "signals": {"maximum": 8}}
    # The grant is debited from the Delegate's budget, permanently (kernel rule).
    assert child.allocated.to_json() == {"steps": 4, "effects": 4, "signals": 8}


def test_a_delegate_that_runs_out_of_its_budget_fails_and_the_model_sees_a_failed_result() -> None:
    # One Step: the Delegate's Interaction declares its model call, and has no Step left to
    # take in the answer.
    tree = run(boss(inner(tools=False), {"steps": 1}))
    child = delegate_child(tree)
    assert child.status == "failed"
    assert child.termination is not None and child.termination.failure is not None
    assert child.termination.failure.code == "engine.limit.steps", child.termination
    assert tree.root.status == "completed"  # the parent's model went on after the failed call


def test_an_unlimited_delegate_runs_as_before() -> None:
    tree = run(boss(inner()))
    child = delegate_child(tree)
    assert child.status == "completed"
    assert child.budget.to_json() == {"steps": {"maximum": None}, "effects": {"maximum": None}, "signals": {"maximum": None}}


FINITE = {"steps": 20, "effects": 20, "signals": 40}

# (scenario, the JSON path the refusal names, a phrase of its message)
REFUSALS: list[tuple[str, dict[str, Any], str, str]] = [
    ("negative-quota", boss(inner(), {"steps": -1}), "$.delegates[0].budget", "non-negative integer"),
    ("unknown-dimension", boss(inner(), {"tokens": 5}), "$.delegates[0].budget", "only steps, effects and signals"),
    ("not-an-object", boss(inner(), "lots"), "$.delegates[0].budget", "only steps, effects and signals"),
    ("tools-without-tool-budget", boss(inner(), FINITE), "$.delegates[0].scenario.tool_budget",
     "the parent's steps quota is finite, so the child's must be finite too"),
    ("tool-budget-above-the-delegate", boss(inner(tool_budget={"steps": 21, "effects": 1, "signals": 1}), FINITE),
     "$.delegates[0].scenario.tool_budget", "the child's steps quota 21 exceeds the parent's maximum 20"),
    ("tool-budget-without-tools", boss(inner(tools=False, tool_budget={"steps": 1})),
     "$.delegates[0].scenario.tool_budget", "give it only with tools"),
    ("nested-delegate-unlimited",
     boss(inner(tools=False, delegates=[{"name": "sub", "input_schema": {"type": "object"},
                                          "scenario": inner(tools=False)}]), FINITE),
     "$.delegates[0].scenario.delegates[0].budget", "must be finite too"),
]


@pytest.mark.parametrize(("doc", "where", "phrase"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_a_budget_the_kernel_would_refuse_is_refused_when_the_scenario_loads(
    doc: dict[str, Any], where: str, phrase: str
) -> None:
    with pytest.raises(ScenarioError) as caught:
        validate_scenario(doc)
    assert caught.value.code == "scenario.invalid"
    assert caught.value.message.startswith(f"{where}: "), caught.value.message
    assert phrase in caught.value.message, caught.value.message


def test_run_refuses_a_delegate_budget_fault_and_stores_nothing(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    path = tmp_path / "boss.json"
    path.write_text(json.dumps(boss(inner(), FINITE)))
    error = refused(agentfold("run", str(path), "--json", store=store)).error()
    assert error["code"] == "scenario.invalid"
    assert error["message"].startswith("$.delegates[0].scenario.tool_budget: ")
    assert not (tmp_path / "agentfold.db").exists() or ok(agentfold("trees", "--json", store=store)).json()[
        "trees"] == []


def test_a_tree_stored_when_delegate_budgets_were_ignored_still_loads(tmp_path: Path) -> None:
    doc = validate_scenario(boss(inner(tools=False), {"steps": 30, "effects": 30, "signals": 30}))
    earlier = unbudgeted_scenario_program(doc)
    assert earlier.ref != scenario_program(doc).ref
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    store = EventStore(url)
    with Runtime(store, Catalog([earlier])) as runtime:
        handle = runtime.start(earlier, scenario_input(doc), start_id="earlier", configuration=doc)
        assert handle.result(timeout=30).status == "completed"
    store.close()

    # This release: only the loaders, which rebuild the current identity first.
    store = EventStore(url)
    with Runtime(store, scenario_catalog()) as runtime:
        tree = runtime.capture(handle.tree_id)
    store.close()
    assert tree.root.program == earlier.ref
    assert delegate_child(tree).budget.to_json()["steps"] == {"maximum": None}

"""The collaboration's Decision rules (spec 8.2, "Validation of a Decision", 1-7) and its
state checks, observed as a user sees them: a run whose coordinator returns a bad Decision
fails ``collaboration.decision.invalid`` (contract) naming the broken rule, before any of the
Decision's actions is declared (no worker Process exists afterwards); a good multi-turn run
re-folds from its stored events to the same tree (``audit verify`` with the Programs bound)
and re-decides every Step the same way (``audit drift``).

Coordinators are transforms over module-level policies that read the Turn number, so one
policy per rule returns that rule's bad Decision at the chosen turn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.audit import drift, verify_tree
from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.sources import ProgramSources
from agentfold.adapters.team import (
    DECISION_SCHEMA,
    TURN_SCHEMA,
    InputGateConfig,
    TeamConfig,
    TeamMember,
    TransformConfig,
    compile_input_gate,
    compile_team,
    transform,
)
from agentfold.domain.errors import ClassifiedError
from agentfold.domain.team import CollaborationStrategy

WAIT = 20.0


def echo(value: Any) -> Any:
    return value


def upper(value: Any) -> Any:
    return str(value).upper()


ECHO = transform(TransformConfig("w.echo", echo))
UPPER = transform(TransformConfig("w.upper", upper, input_schema={"type": "string"}))
GATE = compile_input_gate(InputGateConfig("w.gate", answer_schema=True))

#: turn 1 of every bad-decision case starts one task that stays running (a gate nobody
#: answers), so controls have something to target and the concurrency count is exact
START = {"mode": "continue", "state": {}, "tasks": [{"key": "a", "worker": "w.gate", "input": "?"}]}

BAD: dict[str, tuple[dict[str, Any], str]] = {
    "state schema": ({"mode": "continue", "state": {"n": "x"}}, "state violates the state schema"),
    "output with a mode": ({"mode": "continue", "state": {}, "output": 1}, "takes no mode, tasks or controls"),
    "output with tasks": ({"mode": "", "state": {}, "output": 1, "tasks": [{"key": "b", "worker": "w.echo", "input": 1}]},
                          "takes no mode, tasks or controls"),
    "output schema": ({"mode": "", "state": {}, "output": "not a number"}, "output violates the output schema"),
    "undecided without output": ({"mode": "", "state": {}}, 'needs mode "continue" or "wait"'),
    "task limit": ({"mode": "continue", "state": {}, "tasks": [{"key": f"t{i}", "worker": "w.echo", "input": i}
                                                               for i in range(3)]}, "exceed the task limit"),
    "concurrency": ({"mode": "continue", "state": {}, "tasks": [{"key": "b", "worker": "w.echo", "input": 1},
                                                                {"key": "c", "worker": "w.echo", "input": 1}]},
                    "exceed the concurrent task limit"),
    "controls per turn": ({"mode": "continue", "state": {}, "controls": [{"task": "a", "cancel_reason": "x"},
                                                                         {"task": "a", "cancel_reason": "y"}]},
                          "controls exceed the per-turn limit"),
    "bad key": ({"mode": "continue", "state": {}, "tasks": [{"key": "no spaces", "worker": "w.echo", "input": 1}]},
                "invalid child key"),
    "reserved key": ({"mode": "continue", "state": {}, "tasks": [{"key": "collaboration.turn.9", "worker": "w.echo",
                                                                  "input": 1}]}, "reserved prefix"),
    "unknown worker": ({"mode": "continue", "state": {}, "tasks": [{"key": "b", "worker": "w.nobody", "input": 1}]},
                       "unknown worker 'w.nobody'"),
    "worker input": ({"mode": "continue", "state": {}, "tasks": [{"key": "b", "worker": "w.upper", "input": 5}]},
                     "violates worker 'w.upper'"),
    "used key": ({"mode": "continue", "state": {}, "tasks": [{"key": "a", "worker": "w.echo", "input": 1}]},
                 "key 'a' is already used"),
    "control target": ({"mode": "continue", "state": {}, "controls": [{"task": "zz", "cancel_reason": "x"}]},
                       "task 'zz' has no process"),
    "control neither": ({"mode": "continue", "state": {}, "controls": [{"task": "a"}]},
                        "exactly one of signal and cancel_reason"),
    "control both": ({"mode": "continue", "state": {}, "controls": [{"task": "a", "cancel_reason": "x",
                                                                     "signal": {"id": "s1", "payload": 1}}]},
                     "exactly one of signal and cancel_reason"),
    "engine signal id": ({"mode": "continue", "state": {}, "controls": [
        {"task": "a", "signal": {"id": "signal:engine:x", "payload": 1}}]}, "engine-owned"),
    "blank reason": ({"mode": "continue", "state": {}, "controls": [{"task": "a", "cancel_reason": "  "}]},
                     "a reason must be non-empty"),
}

_CASE: dict[str, Any] = {}


def bad_policy(turn: dict[str, Any]) -> dict[str, Any]:
    if turn["number"] == 1:
        return START
    return dict(_CASE["decision"])


def _team(**overrides: Any) -> Any:
    coordinator = transform(TransformConfig("c.bad", bad_policy, input_schema=TURN_SCHEMA, output_schema=DECISION_SCHEMA))
    config: dict[str, Any] = {
        "name": "t.rules", "coordinator": TeamMember(coordinator), "workers": [TeamMember(ECHO), TeamMember(UPPER), TeamMember(GATE)],
        "state_schema": {"type": "object", "properties": {"n": {"type": "integer"}}},
        "output_schema": {"type": "number"}, "max_tasks": 3, "max_concurrent_tasks": 2, "max_controls_per_turn": 1,
    }
    config.update(overrides)
    return compile_team(TeamConfig(**config))


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_decision_fails_the_collaboration_before_any_action(case: str) -> None:
    decision, fragment = BAD[case]
    _CASE["decision"] = decision
    team = _team()
    store = EventStore("memory:")
    runtime = Runtime(store, Catalog([team]))
    try:
        handle = runtime.start(team, {})
        result = handle.result(WAIT)
        tree = runtime.capture(handle.tree_id)
    finally:
        runtime.close()
        store.close()
    assert result.status == "failed"
    failure = result.termination["failure"]  # type: ignore[index]
    assert (failure["kind"], failure["code"]) == ("contract", "collaboration.decision.invalid")
    assert fragment in failure["message"], failure["message"]
    # Only turn 1's task and the two coordinators ever started: the bad batch declared nothing.
    keys = sorted(str(p.child_key) for p in tree.processes.values() if p.parent_id is not None)
    assert keys == ["a", "collaboration.turn.1", "collaboration.turn.2"]


def wait_forever_policy(turn: dict[str, Any]) -> dict[str, Any]:
    return {"mode": "wait", "state": {}}


def test_wait_with_nothing_outstanding_is_refused() -> None:
    coordinator = transform(TransformConfig("c.waits", wait_forever_policy, input_schema=TURN_SCHEMA,
                                            output_schema=DECISION_SCHEMA))
    team = compile_team(TeamConfig("t.waits", TeamMember(coordinator), [TeamMember(ECHO)]))
    store = EventStore("memory:")
    runtime = Runtime(store, Catalog([team]))
    try:
        result = runtime.start(team, {}).result(WAIT)
    finally:
        runtime.close()
        store.close()
    failure = result.termination["failure"]  # type: ignore[index]
    assert failure["code"] == "collaboration.decision.invalid"
    assert "would wait forever" in failure["message"]


def relay_policy(turn: dict[str, Any]) -> dict[str, Any]:
    """Turn 1 starts two tasks and continues; later turns wait until both drained, then
    start a follow-up carrying the first outputs, and complete with everything seen."""
    tasks = turn["tasks"]
    done = {t["request"]["key"]: t["outcome"]["result"]["output"] for t in tasks if "outcome" in t}
    if turn["number"] == 1:
        return {"mode": "continue", "state": {"seen": 0}, "tasks": [
            {"key": "a", "worker": "w.upper", "input": "x"}, {"key": "b", "worker": "w.echo", "input": [1, 2]}]}
    if "c" in done:
        return {"mode": "", "state": turn["state"], "output": done}
    if {"a", "b"} <= set(done) and all(t["request"]["key"] != "c" for t in tasks):
        return {"mode": "wait", "state": {"seen": len(done)},
                "tasks": [{"key": "c", "worker": "w.echo", "input": {"prior": [done["a"], done["b"]]}}]}
    return {"mode": "wait", "state": {"seen": len(done)}}


def test_a_multi_turn_run_refolds_and_redecides_identically(tmp_path: Path) -> None:
    coordinator = transform(TransformConfig("c.relay", relay_policy, input_schema=TURN_SCHEMA,
                                            output_schema=DECISION_SCHEMA))
    team = compile_team(TeamConfig("t.relay", TeamMember(coordinator), [TeamMember(UPPER), TeamMember(ECHO)]))
    url = f"sqlite:///{tmp_path / 'relay.db'}"
    store = EventStore(url)
    runtime = Runtime(store, Catalog([team]), snapshot_every=7)
    try:
        handle = runtime.start(team, {"seen": 0})
        result = handle.result(WAIT)
    finally:
        runtime.close()
    try:
        assert result.status == "completed", result.termination
        assert result.output == {"a": "X", "b": [1, 2], "c": {"prior": ["X", [1, 2]]}}
        check, _, _ = verify_tree(store, handle.tree_id, Catalog([team]))
        assert check.programs_bound and check.ok, check.to_json()
        report = drift(store, handle.tree_id, ProgramSources(programs=(team,)))
        assert report.drift is None and report.error is None and report.decisions > 5
    finally:
        store.close()


@pytest.mark.parametrize(
    "state",
    [
        None,
        {"phase": "dancing"},
        {"phase": "completed", "number": 3},
        {"phase": "ready", "number": 1, "initial": {}, "tasks": [], "controls": [], "waits": 0, "unseen": False},
        {"phase": "waiting", "number": 2, "initial": {}, "tasks": [], "controls": [], "waits": 1, "unseen": False,
         "coordinator": "process:x", "wait_id": "wait:x"},
        {"phase": "waiting", "number": 2, "tasks": [{"request": {"key": "a"}}, {"request": {"key": "a"}}],
         "controls": [], "waits": 1, "unseen": False, "coordinator": "process:x", "wait_id": "wait:x"},
        {"phase": "waiting", "number": 2, "tasks": [], "controls": [], "waits": 1, "unseen": False,
         "coordinator": None, "wait_id": "wait:x"},
    ],
)
def test_a_forged_state_is_refused_on_restore(state: Any) -> None:
    team = _team()
    strategy = team.strategy
    assert isinstance(strategy, CollaborationStrategy)
    with pytest.raises(ClassifiedError) as raised:
        strategy.decode_state(state)
    assert raised.value.failure.code == "collaboration.state.invalid"

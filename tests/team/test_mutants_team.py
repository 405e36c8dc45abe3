"""Team behaviour the mutation audit of 2026-12-05 ("team") found undefended.

Each test failed with a planted bug that the rest of the suite let through (the audit's
report lists them). Real runtimes on real SQLite files (in ``tmp_path``), real child
Programs: transforms of the module-level policies below as coordinators, transforms and
InputGates as workers and race candidates. What is asserted is what a host observes: the
run's result and output, the Turns the coordinator received (logged by the policies, see
tests/team/programs.py), and the tree a host captures (each child's status and the budget
it was granted, what the team's root was debited).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from agentfold.adapters.team import (
    FIRST_COMPLETED,
    FirstSuccessConfig,
    InputGateConfig,
    TeamConfig,
    TeamMember,
    TransformConfig,
    compile_first_success,
    compile_input_gate,
    compile_team,
    transform,
)
from agentfold.domain.budget import Budget
from agentfold.domain.ids import Digest
from tests.interaction.support import child_by_key, open_runtime
from tests.interaction.tools import WAIT, wait_until
from tests.team import programs as P
from tests.team.test_team_recovery import answer_gate

TEXT = {"type": "string"}


def sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'team.db'}"


def answer(runtime: Any, tree_id: Any, key: str, text: str) -> Any:
    """Answer the InputGate child ``key`` once it waits; returns that child."""
    return answer_gate(runtime, tree_id, key, f"signal:{key}", text)


def turn_keys(tree: Any) -> list[str]:
    return sorted(str(p.child_key) for p in tree.processes.values()
                  if p.child_key and str(p.child_key).startswith("collaboration.turn."))


# ---------------------------------------------------------------------------
# Collaboration: an unseen outcome is new to the next turn only


def wait_after_an_unseen_outcome(turn: dict[str, Any]) -> dict[str, Any]:
    """Turn 1 starts the gates ``input`` and ``other``; turn 2 is held while the test answers
    ``input`` (so its outcome arrives during the turn) and waits; turn 3 (started at once, it
    sees that outcome) waits for ``other``; the turn that sees ``other`` answered completes."""
    P.log("turn", turn)
    n = turn["number"]
    if n == 1:
        return {"mode": "continue", "state": turn["state"],
                "tasks": [P.task("input", "test.gate", "first"), P.task("other", "test.gate", "second")]}
    if n == 2:
        P.hold("turn 2")
        return {"mode": "wait", "state": turn["state"]}
    [other] = [t for t in turn["tasks"] if t["request"]["key"] == "other"]
    if "outcome" in other:
        return P.finish(turn, f"turn {n} saw other answered")
    return {"mode": "wait", "state": turn["state"]}


def test_a_wait_decision_after_the_turn_that_saw_an_unseen_outcome_waits_for_a_task(tmp_path: Path) -> None:
    """docs/team.md: an outcome that drained while a turn ran is *unseen*, new to the next
    turn, so a ``wait`` of that turn starts the next one at once. It is new to that one turn
    only: turn 3 saw it and decides ``wait`` with ``other`` running, so the team waits for
    ``other`` (no turn 4 until it is answered), and turn 4 sees it and completes."""
    program = P.team(wait_after_an_unseen_outcome, P.gate(), max_turns=6)
    with open_runtime(sqlite(tmp_path), program) as runtime:
        handle = runtime.start(program, "begin")
        wait_until(lambda: P.entries("entered") == ["turn 2"], "turn 2 to be held")
        gate = answer(runtime, handle.tree_id, "input", "during turn 2")

        def recorded() -> bool:  # input drained and the team recorded it: it waits again (for turn 2)
            tree = runtime.capture(handle.tree_id)
            return bool(child_by_key(tree, "input").terminal and tree.root.pending_count == 0 and tree.root.current_wait)

        wait_until(recorded, "the team to record the outcome of input while turn 2 runs")
        assert len(P.turns()) == 2  # turn 2 is still held
        P.release_file().touch()
        parked = runtime.wait_idle(handle.tree_id)
        assert not parked.root.terminal, "the team ran on instead of waiting for other"
        assert turn_keys(parked) == ["collaboration.turn.1", "collaboration.turn.2", "collaboration.turn.3"]
        answer(runtime, handle.tree_id, "other", "later")
        result = handle.result(WAIT)
    assert result.status == "completed", result.termination
    assert result.output == "turn 4 saw other answered"
    seen = [t["number"] for t in P.turns()]
    assert seen == [1, 2, 3, 4]
    assert P.turns()[2]["tasks"][0]["outcome"]["process_id"] == str(gate.process_id)


# ---------------------------------------------------------------------------
# Collaboration: a control is given once, by the Decision that names it


def cancel_one_per_turn(turn: dict[str, Any]) -> dict[str, Any]:
    """Turn 1 starts the gates a, b and c; turn 2 cancels a; turn 3 cancels b; turn 4 completes."""
    P.log("turn", turn)
    n = turn["number"]
    if n == 1:
        return {"mode": "continue", "state": turn["state"],
                "tasks": [P.task(key, "test.gate", key) for key in ("a", "b", "c")]}
    if n in (2, 3):
        key = "a" if n == 2 else "b"
        return {"mode": "continue", "state": turn["state"],
                "controls": [{"task": key, "cancel_reason": f"{key} is not needed"}]}
    return P.finish(turn, "done")


def test_a_control_is_given_once_and_each_turn_sees_only_the_previous_decisions_receipts(tmp_path: Path) -> None:
    """docs/team.md: a Turn's ``controls`` are the receipts of the **previous** Decision's
    controls. Turn 2 cancels ``a``, turn 3 cancels ``b``: turn 3 sees the one receipt of
    ``a``'s cancel, turn 4 the one of ``b``'s (not ``a``'s again, which no Decision gave
    again), and the team completes; ``c``, never controlled, ran until the completion."""
    program = P.team(cancel_one_per_turn, P.gate(), max_turns=6)
    with open_runtime(sqlite(tmp_path), program) as runtime:
        handle = runtime.start(program, "begin")
        result = handle.result(WAIT)
        tree = runtime.wait_idle(handle.tree_id)
    assert result.status == "completed", result.termination
    turns = P.turns()
    assert [t["number"] for t in turns] == [1, 2, 3, 4]
    assert [c["control"] for c in turns[2]["controls"]] == [{"task": "a", "cancel_reason": "a is not needed"}]
    assert [c["control"] for c in turns[3]["controls"]] == [{"task": "b", "cancel_reason": "b is not needed"}]
    assert all("failure" not in c["result"] for t in turns[2:] for c in t["controls"])
    assert {key: child_by_key(tree, key).status for key in "abc"} == {"a": "canceled", "b": "canceled", "c": "canceled"}


# ---------------------------------------------------------------------------
# Collaboration: budgets granted to members


COORDINATOR_GRANT = Budget.of(steps=30, effects=15, signals=31)
WORKER_GRANT = Budget.of(steps=20, effects=10, signals=21)


def one_task_then_finish(turn: dict[str, Any]) -> dict[str, Any]:
    P.log("turn", turn)
    if turn["number"] == 1:
        return {"mode": "wait", "state": turn["state"], "tasks": [P.task("job", "test.echo", "work")]}
    [job] = turn["tasks"]
    return P.finish(turn, P.output_of(job))


def test_each_task_is_granted_its_workers_budget_and_each_turn_the_coordinators(tmp_path: Path) -> None:
    """docs/team.md: a member's ``budget`` is granted to each child Process started for it
    (each turn of the coordinator, each task of a worker) and debited from the team root's
    budget for good. With different grants for the coordinator and the worker, the task runs
    under the worker's, both turns under the coordinator's, and the root was debited all three
    grants (also after the children ended: allocations are never refunded)."""
    program = compile_team(TeamConfig(
        "test.granting", coordinator=TeamMember(P.coordinator(one_task_then_finish), COORDINATOR_GRANT),
        workers=[TeamMember(P.echo(), WORKER_GRANT)], state_schema=TEXT, output_schema=TEXT, max_turns=4,
    ))
    with open_runtime(sqlite(tmp_path), program) as runtime:
        handle = runtime.start(program, "begin", budget=Budget.of(steps=500, effects=500, signals=500))
        result = handle.result(WAIT)
        tree = runtime.wait_idle(handle.tree_id)
    assert result.status == "completed" and result.output == "echo: work", result.termination
    assert child_by_key(tree, "job").budget == WORKER_GRANT
    assert [child_by_key(tree, key).budget for key in turn_keys(tree)] == [COORDINATOR_GRANT, COORDINATOR_GRANT]
    assert tree.root.allocated.to_json() == {"steps": 2 * 30 + 20, "effects": 2 * 15 + 10, "signals": 2 * 31 + 21}


# ---------------------------------------------------------------------------
# Collaboration: what the coordinator sees of a task left with an unknown outcome


class _Unreachable:
    """A worker dispatcher whose call raises: the Effect's outcome is unknown (not a failure)."""

    def dispatch(self, request: Any, context: Any) -> Any:
        raise ConnectionError("the worker service did not answer")


def judge_the_job(turn: dict[str, Any]) -> dict[str, Any]:
    P.log("turn", turn)
    if turn["number"] == 1:
        return {"mode": "wait", "state": turn["state"], "tasks": [P.task("job", "test.echo", "work")]}
    [job] = turn["tasks"]
    outcome = job["outcome"]
    return P.finish(turn, {"status": outcome["result"]["status"], "unresolved": outcome.get("subtree_unresolved_effects")})


def test_a_task_that_drained_with_an_unknown_effect_shows_that_effect_to_the_next_turn(tmp_path: Path) -> None:
    """docs/team.md (Crashes and recovery): a task that drained with an unknown Effect left
    unresolved is an outcome like any other, with its ``subtree_unresolved_effects`` in the
    next Turn for the coordinator to judge. The worker's call ends unknown; the host gives up
    and cancels the task; turn 2 sees it canceled with that Effect unresolved (never as done)."""
    unreachable = dataclasses.replace(P.echo(), dispatcher=_Unreachable(),
                                      implementation_digest=Digest.of(b"tests.team.mutants.unreachable"))
    program = P.team(judge_the_job, unreachable, output_schema=True, max_turns=4)
    with open_runtime(sqlite(tmp_path), program) as runtime:
        handle = runtime.start(program, "begin")
        tree = runtime.wait_idle(handle.tree_id)
        job = child_by_key(tree, "job")
        [record] = job.unknown_effects()
        assert not tree.root.terminal
        assert runtime.cancel(job.process_id, "giving up on the worker service")
        result = handle.result(WAIT)
    assert result.status == "completed", result.termination
    assert result.output == {"status": "canceled", "unresolved": [str(record.effect_id)]}


# ---------------------------------------------------------------------------
# FirstSuccess


def refuse(text: Any) -> Any:
    raise ValueError(f"cannot do {text}")


def race_of(*candidates: Any) -> Any:
    return compile_first_success(FirstSuccessConfig(name="test.mutants.race", candidates=list(candidates),
                                                    accept=FIRST_COMPLETED, max_candidates=4))


def text_gate(name: str) -> Any:
    return compile_input_gate(InputGateConfig(name, answer_schema=TEXT))


def test_a_candidate_that_failed_first_never_wins_even_under_first_completed(tmp_path: Path) -> None:
    """docs/team.md: "Failed and canceled candidates never win" (only a **completed** one is
    offered to ``accept``). The ``broken`` candidate fails at once; the race keeps waiting for
    the gate; answered, the gate wins (index 1) and ``broken`` is reported failed."""
    broken = transform(TransformConfig("test.mutants.broken", refuse, input_schema=TEXT))
    program = race_of(broken, text_gate("test.mutants.gate"))
    with open_runtime(sqlite(tmp_path), program) as runtime:
        handle = runtime.start(program, [{"key": "broken", "program": "test.mutants.broken", "input": "x"},
                                         {"key": "gate", "program": "test.mutants.gate", "input": "q"}])
        wait_until(lambda: child_by_key(runtime.capture(handle.tree_id), "broken").terminal, "broken to fail")
        parked = runtime.wait_idle(handle.tree_id)
        assert not parked.root.terminal, "the race ended on a failed candidate"
        answer(runtime, handle.tree_id, "gate", "yes")
        result = handle.result(WAIT)
    assert result.status == "completed", result.termination
    assert result.output["winner"] == 1
    first, second = result.output["candidates"]
    assert first["outcome"]["key"] == "broken" and first["outcome"]["result"]["status"] == "failed"
    assert second["outcome"]["key"] == "gate" and second["outcome"]["result"]["output"]["payload"] == "yes"


def test_each_candidate_is_granted_the_budget_its_request_names(tmp_path: Path) -> None:
    """docs/team.md: "Each candidate is granted its ``budget`` out of the race's own." Under a
    finite race budget, the candidate runs with exactly the grant its request names, and the
    race was debited that grant."""
    grant = Budget.of(steps=9, effects=4, signals=5)
    program = race_of(text_gate("test.mutants.gate"))
    with open_runtime(sqlite(tmp_path), program) as runtime:
        handle = runtime.start(program, [{"key": "gate", "program": "test.mutants.gate", "input": "q",
                                          "budget": grant.to_json()}],
                               budget=Budget.of(steps=50, effects=50, signals=50))
        started = runtime.wait_idle(handle.tree_id)  # the race waits for its one candidate
        gate = child_by_key(started, "gate")
        assert gate.budget == grant and not gate.terminal, gate.status
        answer(runtime, handle.tree_id, "gate", "yes")
        result = handle.result(WAIT)
        tree = runtime.wait_idle(handle.tree_id)
    assert result.status == "completed" and result.output["winner"] == 0, result.output
    assert tree.root.allocated.to_json() == {"steps": 9, "effects": 4, "signals": 5}


# ---------------------------------------------------------------------------
# Collaboration: as many tasks as max_concurrent_tasks, beside a running turn


def sixteen_then_finish(turn: dict[str, Any]) -> dict[str, Any]:
    P.log("turn", turn)
    if turn["number"] == 1:
        return {"mode": "continue", "state": turn["state"],
                "tasks": [P.task(f"t{i}", "test.gate", "wait") for i in range(16)]}
    running = sum(1 for t in turn["tasks"] if "process_id" in t.get("start", {}))
    return P.finish(turn, f"turn {turn['number']} beside {running} running tasks")


def test_the_coordinator_still_runs_its_turn_beside_max_concurrent_tasks_running_tasks(tmp_path: Path) -> None:
    """docs/team.md: ``max_concurrent_tasks`` is how many tasks may run at once; each turn of
    the coordinator is a child Process too. With 16 (the kernel's default
    ``max_active_children``), turn 1 starts 16 waiting tasks and ``continue``s: turn 2 starts
    beside them (a 17th live child, the team raises the tree's limit for it) and completes."""
    program = P.team(sixteen_then_finish, P.gate(), max_concurrent_tasks=16, max_turns=3)
    with open_runtime(sqlite(tmp_path), program) as runtime:
        result = runtime.start(program, "begin").result(WAIT)
    assert result.status == "completed", result.termination
    assert result.output == "turn 2 beside 16 running tasks"


def test_a_members_budget_and_capabilities_are_part_of_the_teams_identity() -> None:
    """docs/python.md "What to keep stable between deployments": a Runtime drives a run only
    with a Program of exactly its identity, "so a run is never continued by code that would
    decide differently". A team that grants a worker (or the coordinator) another budget or
    other capabilities starts its children differently: its ProgramRef differs."""

    def team(worker: TeamMember, coordinator_budget: Budget = COORDINATOR_GRANT) -> Any:
        return compile_team(TeamConfig("test.identity", coordinator=TeamMember(P.coordinator(one_task_then_finish),
                                                                                coordinator_budget),
                                       workers=[worker], state_schema=TEXT, output_schema=TEXT))

    base = team(TeamMember(P.echo(), WORKER_GRANT))
    assert team(TeamMember(P.echo(), WORKER_GRANT)).ref == base.ref
    assert team(TeamMember(P.echo(), Budget.of(steps=20, effects=10, signals=22))).ref != base.ref
    assert team(TeamMember(P.echo(), WORKER_GRANT), Budget.of(steps=30, effects=15, signals=32)).ref != base.ref
    assert team(TeamMember(P.echo(), WORKER_GRANT, frozenset({"net"}))).ref != base.ref

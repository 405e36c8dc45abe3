"""The collaboration across process death and restore: scenarios 31 and 33 of the reference
section 11, and a worker that dies inside its call while the coordinator's next turn is pending.

Real process death: ``python -m tests.team.programs`` (see ``programs.main``) runs the
collaboration in a child process that ends with ``os._exit(75)`` at a chosen point; this
process then recovers the tree from the store alone (a new Runtime, ``WriterActivated``).
Coordinator and worker calls are logged to a file by the module-level functions in
``tests/team/programs.py``, so calls made by the dead process are counted too. Transforms
never replay a call: a call cut by the death is an unknown Effect that the host resolves
(``resolve_unknown_effect``) with the outcome it established.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.domain.ids import TreeID
from agentfold.domain.program import SignalRequest
from agentfold.domain.requests import Settlement
from tests.interaction.support import child_by_key, open_runtime, recover
from tests.interaction.tools import WAIT, wait_until
from tests.team import programs as P

ROOT = Path(__file__).resolve().parents[2]
CRASH_EXIT = 75


def crash(store_url: str, name: str, start_id: str, input: Any, mode: str, **env: str) -> None:
    """Run the collaboration in a child process and require that it died on purpose (exit 75)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.team.programs", store_url, name, start_id, json.dumps(input), mode],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False, env={**os.environ, **env},
    )
    assert done.returncode == CRASH_EXIT, (
        f"the worker exited {done.returncode}, not {CRASH_EXIT}\nstdout: {done.stdout}\nstderr: {done.stderr}"
    )


def unknown(tree: Any) -> list[tuple[str, Any]]:
    """(child key of the Process, effect id) of every unknown Effect in the tree."""
    return [(str(p.child_key), r.effect_id) for p in tree.processes.values() for r in p.unknown_effects()]


# ---------------------------------------------------------------------------
# A worker dies inside its call while the coordinator's next turn waits for it


def test_a_worker_dying_inside_its_call_is_resolved_by_the_host_and_nothing_runs_twice(durable_store_url: str) -> None:
    """Turn 1 starts ``job`` and waits for it (the next turn is pending on it); the process dies
    inside the worker's function. Recovery in this process: the job's Effect is unknown (no
    call is made again behind the host's back); the host resolves it; the job completes with
    the resolved output, turn 2 sees it and completes the collaboration. The worker function
    ran once (in the dead process), each coordinator turn once."""
    program = P.build("crash-worker")
    crash(durable_store_url, "crash-worker", "start:team-worker-crash", "initial", "run", AGENTFOLD_TEAM_CRASH="worker")
    assert P.entries("crashing") == ["job"] and [t["number"] for t in P.turns()] == [1]
    tree_id = TreeID.for_start("start:team-worker-crash")  # type: ignore[arg-type]
    with open_runtime(durable_store_url, program) as runtime:
        recover(runtime, tree_id)
        tree = runtime.wait_idle(tree_id)
        [(key, effect_id)] = unknown(tree)
        assert key == "job"
        assert not tree.root.terminal and P.entries("crashing") == ["job"] and len(P.turns()) == 1
        runtime.resolve_unknown_effect(effect_id, Settlement.succeeded({"output": "resolved"}))
        result = runtime.result(tree_id, WAIT)
        tree = runtime.wait_idle(tree_id)
    assert result.status == "completed" and result.output == "job said resolved"
    assert P.entries("crashing") == ["job"]
    turns = P.turns()
    assert [t["number"] for t in turns] == [1, 2]
    outcome = turns[1]["tasks"][0]["outcome"]
    assert outcome["result"]["status"] == "completed" and outcome["result"]["output"] == "resolved"
    assert child_by_key(tree, "job").status == "completed"


# ---------------------------------------------------------------------------
# 31. a null output survives recovery


@pytest.mark.parametrize("point", ["before:ProcessTerminated:3", "after:ProcessTerminated:4"],
                         ids=["before_completion", "after_completion"])
def test_s31_a_null_output_survives_process_death(durable_store_url: str, point: str) -> None:
    """Scope ``collaboration_test.go`` TestNullCompletionSurvivesTreeRecovery, with real death.

    after_completion: the process dies right after the append holding the root's completion;
    a new Runtime reads status completed and output null, and calls nothing.
    before_completion: it dies instead of appending turn 2's settlement (the completing
    decision); recovery finds that call unknown, the host resolves it with the decision
    ``{"mode": "", "output": null}``, and the collaboration completes with null.
    Either way the worker ran once and each turn's policy once.
    """
    program = P.build("null-output")
    start_id = f"start:team-null-{point.split(':')[0]}"
    crash(durable_store_url, "null-output", start_id, "initial", f"crash:{point}")
    assert P.entries("echo") == ["draft"] and [t["number"] for t in P.turns()] == [1, 2]
    tree_id = TreeID.for_start(start_id)  # type: ignore[arg-type]
    with open_runtime(durable_store_url, program) as runtime:
        recover(runtime, tree_id)
        tree = runtime.wait_idle(tree_id)
        if point.startswith("before"):
            [(key, effect_id)] = unknown(tree)
            assert key == "collaboration.turn.2"
            runtime.resolve_unknown_effect(
                effect_id, Settlement.succeeded({"output": {"mode": "", "state": "initial", "output": None}})
            )
        else:
            assert unknown(tree) == [] and tree.root.terminal
        result = runtime.result(tree_id, WAIT)
    assert result.status == "completed" and result.output is None
    assert result.termination is not None and result.termination["cause"] == "completion"
    assert P.entries("echo") == ["draft"] and [t["number"] for t in P.turns()] == [1, 2]


# ---------------------------------------------------------------------------
# 33. an outcome arriving during a coordinator turn is seen by the next turn


def answer_gate(runtime: Any, tree_id: Any, key: str, signal_id: str, text: str = "answer") -> Any:
    """Answer the InputGate child ``key`` with ``text`` once it waits; returns that child."""

    def waiting() -> bool:
        try:
            return child_by_key(runtime.capture(tree_id), key).current_wait is not None
        except AssertionError:
            return False

    wait_until(waiting, f"gate {key} to wait")
    gate = child_by_key(runtime.capture(tree_id), key)
    assert runtime.deliver_signals(gate.process_id, [SignalRequest(signal_id, text, gate.current_wait)])
    return gate


def check_turns_of_scenario_33(count: int) -> None:
    turns = P.turns()
    assert [t["number"] for t in turns] == [1, 2, 3]
    assert P.entries("entered") == ["turn 2"]
    second, third = turns[1], turns[2]
    assert len(second["tasks"]) == count and all("outcome" not in t for t in second["tasks"])
    seen = third["tasks"][0]
    assert "start" not in seen and seen["outcome"]["result"]["status"] == "completed"
    assert seen["outcome"]["result"]["output"]["payload"] == "answer"
    if count == 2:
        other = third["tasks"][1]
        assert "outcome" not in other and "process_id" in other["start"]


@pytest.mark.parametrize("count", [1, 2], ids=["tasks_1", "tasks_2"])
def test_s33_an_outcome_arriving_during_a_turn_is_seen_by_the_next_turn(store_url: str, count: int) -> None:
    """Scope ``concurrency_test.go`` TestCoordinatorWaitIncludesResultsArrivingDuringItsModelCall (memory).

    Turn 1 starts the ``input`` gate (and, with 2 tasks, an ``other`` gate) and continues; turn 2
    is held; meanwhile the host answers ``input``, whose outcome the collaboration records while
    turn 2 runs. Turn 2 (which saw no outcome) decides ``wait`` with nothing new: since an
    outcome arrived during the turn, turn 3 starts at once, sees it (and ``other`` still
    running), and completes; ``other`` is then canceled.
    Adaptation: the coordinator is a transform held open, not a model call.
    """
    program = P.team(P.during_turn, P.gate())
    with open_runtime(store_url, program) as runtime:
        handle = runtime.start(program, str(count))
        wait_until(lambda: P.entries("entered") == ["turn 2"], "turn 2 to be held")
        gate = answer_gate(runtime, handle.tree_id, "input", "signal:during-decision")

        def consumed() -> bool:  # the gate drained and the collaboration recorded it: it waits again
            tree = runtime.capture(handle.tree_id)
            root = tree.root
            return bool(child_by_key(tree, "input").terminal and root.pending_count == 0 and root.current_wait)

        wait_until(consumed, "the collaboration to record the gate's outcome while turn 2 runs")
        assert P.entries("turn") and len(P.turns()) == 2  # turn 2 is still held
        P.release_file().touch()
        result = handle.result(WAIT)
        tree = runtime.wait_idle(handle.tree_id)
    assert result.status == "completed" and result.output == "observed during decision"
    check_turns_of_scenario_33(count)
    assert P.turns()[2]["tasks"][0]["outcome"]["process_id"] == str(gate.process_id)
    if count == 2:
        assert child_by_key(tree, "other").status == "canceled"


def test_s33_an_outcome_arriving_during_a_turn_survives_process_death(durable_store_url: str) -> None:
    """Scope ``concurrency_test.go`` TestCoordinatorWaitIncludesResultsArrivingDuringItsModelCall (restored).

    In a child process: turn 2 is held, the ``input`` gate is answered and its outcome recorded
    by the collaboration, then the process dies with turn 2's call in flight. The stored root
    state holds the outcome as unseen (Scope: "the crash cut retains an unseen worker outcome").
    Recovery here: turn 2's call is unknown (never made again); the host resolves it with the
    decision the policy would have made (``wait`` with nothing new); turn 3 starts at once,
    sees the outcome, and completes. Turn 2's policy ran once, in the dead process.
    Adaptation: Scope stops after the coordinator's settlement is durable; our transform's
    call is cut instead, so the host resolves it. Run with 2 tasks (the other gate still runs
    when turn 3 decides); the in-process test covers 1 and 2.
    """
    count = 2
    program = P.build("during-turn")
    start_id = f"start:team-during-{count}"
    crash(durable_store_url, "during-turn", start_id, str(count), "answer-during-turn-2")
    assert [t["number"] for t in P.turns()] == [1, 2] and P.entries("entered") == ["turn 2"]
    tree_id = TreeID.for_start(start_id)  # type: ignore[arg-type]
    store = EventStore(durable_store_url)
    try:
        with open_runtime(store, program) as runtime:
            stored = runtime.capture(tree_id)
            state = stored.root.state
            assert state["tasks"][0].get("outcome") is not None and state["unseen"] is True
            assert child_by_key(stored, "input").status == "completed"
            recover(runtime, tree_id)
            tree = runtime.wait_idle(tree_id)
            [(key, effect_id)] = unknown(tree)
            assert key == "collaboration.turn.2"
            runtime.resolve_unknown_effect(effect_id, Settlement.succeeded({"output": {"mode": "wait", "state": str(count)}}))
            result = runtime.result(tree_id, WAIT)
    finally:
        store.close()
    assert result.status == "completed" and result.output == "observed during decision"
    check_turns_of_scenario_33(count)

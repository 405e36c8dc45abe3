"""The team (collaboration) strategy: scenarios 27-35 of the reference section 11
(scope-interaction-team-agentrun.md sections 7.2, 8.1-8.3; the seed ``scope-team.txt`` where
they differ), on real stores, driven by a :class:`Runtime`.

Common adaptations, said once here:

* Scope's coordinator is a ``workflow.Transform`` over a Go function; ours is
  ``transform(TransformConfig(..., input_schema=TURN_SCHEMA, output_schema=DECISION_SCHEMA))``
  over a module-level policy in ``tests/team/programs.py``, which logs every Turn it receives
  (the test asserts on the logged Turns instead of returning Go errors from the policy).
* ``synctest`` barriers become a policy call held open (``programs.hold``) until the test
  creates a release file.
* Scope's "restore from a tree snapshot" is a new Runtime over the same store (the tree is folded
  again from its events); real process death is in ``test_team_recovery.py``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.team import (
    DECISION_SCHEMA,
    TURN_SCHEMA,
    TeamConfig,
    TeamMember,
    TransformConfig,
    compile_team,
    transform,
)
from agentfold.domain.canonical import JSON
from agentfold.domain.errors import AgentfoldError, ClassifiedError, InvalidInput
from agentfold.domain.ids import Digest, SignalID, TreeID
from agentfold.domain.program import Descriptor, Program, Signal, SignalRequest
from agentfold.domain.workflow import TransformStrategy
from tests.interaction.support import child_by_key, open_runtime
from tests.interaction.tools import WAIT, GatedModel, final, wait_until
from tests.team import programs as P


def release() -> None:
    P.release_file().touch()


def failure_of(result: Any) -> dict[str, str]:
    assert result.termination is not None and result.termination["failure"] is not None, result
    return result.termination["failure"]  # type: ignore[no-any-return]


def child_keys(tree: Any) -> list[str]:
    return [str(p.child_key) for p in tree.processes.values() if p.child_key is not None]


def stream_length(store: EventStore, tree_id: Any) -> int:
    return len(store.read(tree_id))


def run(store_url: str, program: Program, input: JSON = "initial") -> tuple[Any, Any]:
    """Run ``program`` to its end; its result and the final tree."""
    with open_runtime(store_url, program) as runtime:
        handle = runtime.start(program, input)
        result = handle.result(WAIT)
        tree = runtime.wait_idle(handle.tree_id)
    return result, tree


# ---------------------------------------------------------------------------
# 27. continue beside a running task; signal and cancel controls; receipts; drained cancellation


def test_s27_continue_beside_a_running_task_then_controls_and_a_drained_cancellation(store_url: str) -> None:
    """Scope ``collaboration_test.go`` TestBackgroundContinueControlAndDrain.

    Turn 1 starts a background InputGate task and continues; turn 2 runs beside it (its Turn
    shows the task started, not drained, and the new working state), then decides a signal and
    a cancel control on it with mode wait; turn 3 sees both receipts (the cancel accepted, the
    unaddressed signal refused by the gate: a control rejection is a fact, not a failure) and
    the task's drained outcome "canceled", and completes.
    Adaptation: the control's signal has no wait id, so the gate (which takes only addressed
    answers) refuses it; Scope's test checks only that both receipts exist.
    """
    program = P.team(P.background_control, P.gate())
    result, tree = run(store_url, program)

    assert result.status == "completed" and result.output == "continued, controlled, drained"
    turns = P.turns()
    assert [t["number"] for t in turns] == [1, 2, 3]
    first, second, third = turns
    assert first["state"] == "initial" and first["tasks"] == [] and first["controls"] == []
    assert first["workers"] == [{"name": "test.gate", "description": "Receive input.",
                                 "input_schema": P.TEXT, "output_schema": P.gate().descriptor.output_schema}]
    gate = child_by_key(tree, "background")
    # Turn 2 runs beside the task: started, not drained.
    assert second["state"] == "working" and second["controls"] == []
    [running] = second["tasks"]
    assert running["request"] == {"key": "background", "worker": "test.gate", "input": "wait"}
    assert running["start"] == {"process_id": str(gate.process_id)} and "outcome" not in running
    # Turn 3: the receipts of turn 2's controls, in decision order, and the drained cancellation.
    assert [c["control"] for c in third["controls"]] == [
        {"task": "background", "signal": {"id": "signal:steer", "payload": "new direction"}},
        {"task": "background", "cancel_reason": "No longer needed."},
    ]
    signal_receipt, cancel_receipt = (c["result"] for c in third["controls"])
    assert set(signal_receipt) == {"child", "signal_id", "failure"}, signal_receipt
    assert (signal_receipt["child"], signal_receipt["signal_id"]) == (str(gate.process_id), "signal:steer")
    assert set(signal_receipt["failure"]) == {"kind", "code", "message"} and signal_receipt["failure"]["code"]
    assert cancel_receipt == {"child": str(gate.process_id)}
    [drained] = third["tasks"]
    assert "start" not in drained and drained["outcome"]["process_id"] == str(gate.process_id)
    assert drained["outcome"]["result"]["status"] == "canceled"
    assert gate.status == "canceled"
    assert child_keys(tree) == ["collaboration.turn.1", "background", "collaboration.turn.2", "collaboration.turn.3"]


# ---------------------------------------------------------------------------
# 28. follow-up with a new key


def test_s28_a_follow_up_task_uses_a_new_key_and_carries_the_previous_output(store_url: str) -> None:
    """Scope ``collaboration_test.go`` TestCompletedTaskFollowUp.

    Turn 1 waits for ``draft``; turn 2 sees its drained outcome (the outcome replaced the
    start) and asks for ``revision`` with the draft's output in its input; turn 3 completes
    with the revision's output. The worker ran exactly twice, with exactly those inputs.
    """
    program = P.team(P.follow_up, P.echo())
    result, tree = run(store_url, program)

    assert result.status == "completed" and result.output == "echo: echo: draft revised"
    assert P.entries("echo") == ["draft", "echo: draft revised"]
    turns = P.turns()
    assert [t["number"] for t in turns] == [1, 2, 3]
    draft = turns[1]["tasks"][0]
    assert set(draft) == {"request", "outcome"}
    assert draft["outcome"]["result"]["status"] == "completed" and draft["outcome"]["result"]["output"] == "echo: draft"
    assert [t["request"]["key"] for t in turns[2]["tasks"]] == ["draft", "revision"]
    assert child_by_key(tree, "draft").status == "completed" and child_by_key(tree, "revision").status == "completed"


# ---------------------------------------------------------------------------
# 29. an addressed answer to an InputGate worker wakes the waiting collaboration


def test_s29_an_addressed_answer_to_an_input_gate_worker_wakes_the_coordinator(store_url: str) -> None:
    """Scope ``collaboration_test.go`` TestAddressedInputWakesWaitingCollaboration.

    Turn 1 waits for an InputGate task; the collaboration then waits (one turn only). The host
    answers the gate's wait; the gate completes with the answer Signal itself (its id, the wait
    id, the payload), which turn 2 reads from the task outcome.
    """
    program = P.team(P.addressed_input, P.gate())
    with open_runtime(store_url, program) as runtime:
        handle = runtime.start(program, "initial")

        def gate_waiting() -> bool:
            try:
                return child_by_key(runtime.capture(handle.tree_id), "input").current_wait is not None
            except AssertionError:
                return False

        wait_until(gate_waiting, "the input gate to wait")
        gate = child_by_key(runtime.capture(handle.tree_id), "input")
        wait = gate.waits[gate.current_wait]
        assert (str(wait.key), wait.prompt, wait.response_schema) == ("coordination.input", "instruction", P.TEXT)
        assert len(P.turns()) == 1
        assert runtime.deliver_signals(gate.process_id, [SignalRequest("signal:answer", "proceed", gate.current_wait)])
        result = handle.result(WAIT)

    assert result.status == "completed" and result.output == 'signal:answer:"proceed"'
    turns = P.turns()
    assert [t["number"] for t in turns] == [1, 2]
    outcome = turns[1]["tasks"][0]["outcome"]
    assert outcome["result"]["output"] == {"id": "signal:answer", "wait_id": str(gate.current_wait), "payload": "proceed"}


# ---------------------------------------------------------------------------
# 30. no input before the first turn


def test_s30_an_unsolicited_signal_before_the_first_turn_is_a_protocol_failure() -> None:
    """Scope ``collaboration_test.go`` TestDefinitionConformance (the rejected case).

    The Strategy's first Step with a Signal in its window is refused with contract
    ``collaboration.protocol.invalid`` (Scope drives ``Definition.Start`` + ``Step`` directly;
    so does this test).
    """
    program = P.team(P.finish_at_once, P.echo())
    strategy = program.strategy
    state = strategy.initial("initial")
    unsolicited = Signal(SignalID("signal:unsolicited"), "x")
    with pytest.raises(ClassifiedError) as caught:
        strategy.decide(state, [unsolicited])
    assert (caught.value.failure.kind.value, caught.value.failure.code) == ("contract", "collaboration.protocol.invalid")
    # Without the signal the same state starts turn 1.
    step = strategy.decide(state, [])
    assert step.consumed == 0


def test_s30_the_collaboration_refuses_unaddressed_host_signals_at_admission(store_url: str) -> None:
    """Spec 8.1: "Unaddressed host signals are rejected by the root descriptor's signal schema."

    A host signal to the root of a running collaboration is refused with a classified error and
    nothing is appended; the collaboration then completes normally.
    """
    program = P.team(P.during_turn, P.gate())
    store = EventStore(store_url)
    try:
        with open_runtime(store, program) as runtime:
            handle = runtime.start(program, "1")
            wait_until(lambda: P.entries("entered") == ["turn 2"], "turn 2 to be held")
            before = stream_length(store, handle.tree_id)
            with pytest.raises(AgentfoldError) as caught:
                runtime.deliver_signals(handle.root_process_id, [SignalRequest("signal:host", "hello")])
            assert caught.value.code == "engine.signal.rejected" and caught.value.message
            assert stream_length(store, handle.tree_id) == before
            assert not runtime.capture(handle.tree_id).root.terminal
            # Let the run end: answer the gate, release turn 2.
            gate = child_by_key(runtime.capture(handle.tree_id), "input")
            wait_until(lambda: child_by_key(runtime.capture(handle.tree_id), "input").current_wait is not None,
                       "the gate to wait")
            gate = child_by_key(runtime.capture(handle.tree_id), "input")
            assert runtime.deliver_signals(gate.process_id, [SignalRequest("signal:answer", "go", gate.current_wait)])
            release()
            assert handle.result(WAIT).status == "completed"
    finally:
        store.close()


# ---------------------------------------------------------------------------
# 31. a JSON null output completes and survives restore


def test_s31_a_null_output_completes_the_collaboration_and_survives_restore(store_url: str) -> None:
    """Scope ``collaboration_test.go`` TestNullCompletionSurvivesTreeRecovery.

    The Decision's ``output`` is an explicit JSON null (output schema ``{"type": "null"}``): it
    completes the collaboration (status completed, output null), and a new Runtime folding the
    tree again from the store reads the same. Real process death: ``test_team_recovery.py``.
    Adaptation: turn 1 first runs one task, so the completing turn is not the first.
    """
    program = P.build("null-output")
    store = EventStore(store_url)
    try:
        with open_runtime(store, program) as runtime:
            handle = runtime.start(program, "initial")
            result = handle.result(WAIT)
            runtime.wait_idle(handle.tree_id)
        assert result.status == "completed" and result.output is None
        assert result.termination is not None and result.termination["cause"] == "completion"
        with open_runtime(store, program) as fresh:
            root = fresh.capture(handle.tree_id).root
            again = fresh.result(handle.tree_id, WAIT)
    finally:
        store.close()
    assert root.status == "completed" and root.output is None
    assert again.status == "completed" and again.output is None and again.termination == result.termination
    assert [t["number"] for t in P.turns()] == [1, 2] and P.entries("echo") == ["draft"]


def test_s31_a_missing_output_is_not_a_completion() -> None:
    """Spec 8.2: only a *present* ``output`` completes; ``mode: ""`` without one is a decision error."""
    script = [{"mode": ""}]
    program = P.team(P.scripted, P.echo(), state_schema=True, output_schema={"type": "null"})
    result, _ = run("memory:", program, {"script": script})
    assert result.status == "failed"
    failure = failure_of(result)
    assert (failure["kind"], failure["code"]) == ("contract", "collaboration.decision.invalid")


# ---------------------------------------------------------------------------
# 32. a failing coordinator fails the collaboration with its own Failure; workers are canceled


class _PanickingTransform(TransformStrategy):
    """A coordinator whose Step raises (Scope's "panic") from turn 2 on."""

    def decide(self, state: dict[str, Any], window: Any) -> Any:
        if state.get("phase") == "start" and state["input"]["number"] >= 2:
            raise RuntimeError(P.FAILURE_MESSAGE)
        return super().decide(state, window)


def _panicking_coordinator() -> Program:
    base = P.coordinator(P.failing_second_turn)
    return dataclasses.replace(base, strategy=_PanickingTransform(),
                               implementation_digest=Digest.of(b"tests.team.panicking"))


def _failing_team(mode: str) -> Program:
    if mode == "start":
        member = TeamMember(P.coordinator(P.failing_second_turn), P.COORDINATOR_BUDGET, frozenset({"secret"}))
    elif mode == "panic":
        member = TeamMember(_panicking_coordinator(), P.COORDINATOR_BUDGET)
    else:
        member = TeamMember(P.coordinator(P.failing_second_turn), P.COORDINATOR_BUDGET)
    return P.team(P.failing_second_turn, P.gate(), coordinator_member=member)


def _failed_run(store_url: str, mode: str) -> tuple[Program, Any, Any, Any, Any]:
    """Run the scenario-32 collaboration whose coordinator fails as ``mode`` says; its Program,
    result and final tree, and the result and tree a new Runtime reads from the store."""
    program = _failing_team(mode)
    store = EventStore(store_url)
    try:
        with open_runtime(store, program) as runtime:
            handle = runtime.start(program, "initial")
            result = handle.result(WAIT)
            tree = runtime.wait_idle(handle.tree_id)
        with open_runtime(store, program) as fresh:
            again = fresh.result(handle.tree_id, WAIT)
            stored = fresh.capture(handle.tree_id)
    finally:
        store.close()
    return program, result, tree, again, stored


@pytest.mark.parametrize("mode", ["start", "execution", "panic"])
def test_s32_a_coordinator_failure_keeps_its_kind_code_and_message_and_drains_workers(store_url: str, mode: str) -> None:
    """Scope ``failure_recovery_test.go`` TestCoordinatorFailureSurvivesRecoveryAndDrainsWorkers.

    * start: the coordinator's start is refused (its capabilities exceed the collaboration's):
      the collaboration fails with that refusal unchanged;
    * execution: turn 2's policy raises: the coordinator fails ``transform.failed``;
    * panic: turn 2's coordinator Step raises: the kernel fails it ``execution.step.failed``.
    In each case the root's Failure equals the coordinator's exactly (kind, code, message), the
    background gate task started by turn 1 ends canceled, and a new Runtime reads the same
    failure from the store.
    Adaptation: Scope's "deployment unavailable" start failure has no counterpart (a Program's
    children are bound at compile time), so the start is refused by a capability escalation;
    Scope's ``panic`` kind is our ``execution.step.failed``.
    """
    _, result, tree, again, _ = _failed_run(store_url, mode)
    assert result.status == "failed"
    failure = failure_of(result)
    if mode == "start":
        assert failure == {"kind": "contract", "code": "engine.child.capability_escalation",
                           "message": "child capabilities ['secret'] exceed the parent's"}
        assert child_keys(tree) == [] and P.turns() == []
    else:
        turn2 = child_by_key(tree, "collaboration.turn.2")
        assert turn2.status == "failed"
        assert failure == turn2.termination.failure.to_json()
        expected_code = "transform.failed" if mode == "execution" else "execution.step.failed"
        assert (failure["kind"], failure["code"]) == ("execution", expected_code)
        assert P.FAILURE_MESSAGE in failure["message"]
        gate = child_by_key(tree, "background")
        assert gate.status == "canceled"
        assert [t["number"] for t in P.turns()] == ([1, 2] if mode == "execution" else [1])
    assert again.status == "failed" and failure_of(again) == failure


def _failed_state(mode: str) -> tuple[Program, EventStore, Any, dict[str, Any]]:
    """The scenario-32 collaboration run to its failure on a memory store with a snapshot
    after every append: its Program, the (open) store, the tree id and the root's state
    as folded from the events."""
    program = _failing_team(mode)
    store = EventStore("memory:")
    with open_runtime(store, program, snapshot_every=1) as runtime:
        handle = runtime.start(program, "initial")
        assert handle.result(WAIT).status == "failed"
        runtime.wait_idle(handle.tree_id)
    folded = store.load(handle.tree_id, Catalog([program]).resolve, use_snapshot=False)
    return program, store, handle.tree_id, json.loads(json.dumps(folded.state.root.state))


@pytest.mark.parametrize("mode", ["start", "execution", "panic"])
def test_s32_the_failed_collaboration_state_is_restorable(mode: str) -> None:
    """Scope ``failure_recovery_test.go`` (the Restore half): the root's stored state after the
    coordinator failure is restorable: the failed tree loads from its last snapshot (a state
    the collaboration's own ``decode_state`` refuses makes the store fall back to folding every
    event, with a warning), and ``decode_state`` accepts the stored state."""
    program, store, tree_id, state = _failed_state(mode)
    try:
        length = stream_length(store, tree_id)
        assert [row.originator_version for row in store.snapshots.select_events(tree_id.uuid)] == [length]
        loaded = store.load(tree_id, Catalog([program]).resolve)
        assert loaded.snapshot_version == length
        assert program.strategy.decode_state(state) == state
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["start", "execution", "panic"])
def test_s32_forged_contradictory_collaboration_states_are_refused(mode: str) -> None:
    """Scope ``failure_recovery_test.go`` ("contradictory forged states rejected"): forgeries of
    the failed root's state are refused with contract ``collaboration.state.invalid``.
    Adaptation: our forgeries follow our state's shape (Scope's name its Go fields)."""
    program, store, _, state = _failed_state(mode)
    store.close()
    strategy = program.strategy
    forged: list[dict[str, Any]] = [
        {**state, "phase": "flying"},
        {**state, "number": -1},
        {**state, "tasks": "none"},
        {**state, "unseen": "no"},
        {**state, "number": 0},
        {**state, "initial": "again"},
        {"phase": "completed", "number": state["number"]},
    ]
    if state.get("tasks"):
        task = dict(state["tasks"][0])
        task["start"] = {"process_id": "process:" + "0" * 64}
        task["outcome"] = task.get("outcome") or {"process_id": "process:" + "0" * 64}
        forged.append({**state, "tasks": [task]})
        forged.append({**state, "tasks": [state["tasks"][0], state["tasks"][0]]})
    for bad in forged:
        with pytest.raises(ClassifiedError) as caught:
            strategy.decode_state(bad)
        assert (caught.value.failure.kind.value, caught.value.failure.code) == ("contract", "collaboration.state.invalid"), bad


class _Unreachable:
    """A coordinator dispatcher whose call raises: its outcome is unknown (not a failure)."""

    def dispatch(self, request: Any, context: Any) -> Any:
        raise ConnectionError("the decision service did not answer")


def test_a_coordinator_subtree_left_with_unknown_effects_cannot_authorize_a_decision(store_url: str) -> None:
    """Spec 7.2 / 8.3 step 5 (Scope ``execution.go`` turnFailure, checked before the
    coordinator's own status): turn 1's coordinator call ends unknown; the host gives up on it
    and cancels that coordinator Process, which drains with the Effect unresolved. The
    collaboration fails external ``collaboration.coordinator.unresolved_effects`` naming the
    coordinator, and no further turn or task starts."""
    base = P.coordinator(P.finish_at_once)
    coordinator = dataclasses.replace(base, dispatcher=_Unreachable(),
                                      implementation_digest=Digest.of(b"tests.team.unreachable"))
    program = P.team(P.finish_at_once, P.echo(), coordinator_member=TeamMember(coordinator, P.COORDINATOR_BUDGET))
    with open_runtime(store_url, program) as runtime:
        handle = runtime.start(program, "initial")
        tree = runtime.wait_idle(handle.tree_id)
        turn1 = child_by_key(tree, "collaboration.turn.1")
        [record] = turn1.unknown_effects()
        assert not tree.root.terminal
        assert runtime.cancel(turn1.process_id, "giving up on the decision service")
        result = handle.result(WAIT)
        tree = runtime.wait_idle(handle.tree_id)
    assert result.status == "failed"
    failure = failure_of(result)
    assert (failure["kind"], failure["code"]) == ("external", "collaboration.coordinator.unresolved_effects"), failure
    assert str(turn1.process_id) in failure["message"] and str(record.effect_id) in failure["message"]
    assert child_keys(tree) == ["collaboration.turn.1"] and P.turns() == []


def test_a_coordinator_canceled_without_a_decision_is_an_invalid_decision(store_url: str) -> None:
    """Spec 8.3 step 5: a coordinator that drained neither failed nor unresolved is decoded as
    a Decision; one canceled by its host has no output, so the collaboration fails contract
    ``collaboration.decision.invalid`` (Scope ``state.go`` turnExecution.decision: "coordinator
    ended with canceled"). The coordinator here waits for an external answer (an InputGate
    strategy behind the coordinator contract), so its cancellation leaves nothing unresolved."""
    gate = P.gate()
    waiting = dataclasses.replace(gate, descriptor=Descriptor("test.coordinator", "Wait for a human.", TURN_SCHEMA,
                                                              DECISION_SCHEMA, None))
    program = P.team(P.finish_at_once, P.echo(), coordinator_member=TeamMember(waiting, P.COORDINATOR_BUDGET))
    with open_runtime(store_url, program) as runtime:
        handle = runtime.start(program, "initial")

        def coordinator_waits() -> bool:
            try:
                return child_by_key(runtime.capture(handle.tree_id), "collaboration.turn.1").current_wait is not None
            except AssertionError:
                return False

        wait_until(coordinator_waits, "the coordinator to wait")
        turn1 = child_by_key(runtime.capture(handle.tree_id), "collaboration.turn.1")
        assert runtime.cancel(turn1.process_id, "nobody answered")
        result = handle.result(WAIT)
        tree = runtime.wait_idle(handle.tree_id)
    assert result.status == "failed"
    failure = failure_of(result)
    assert (failure["kind"], failure["code"]) == ("contract", "collaboration.decision.invalid"), failure
    assert child_keys(tree) == ["collaboration.turn.1"]


# ---------------------------------------------------------------------------
# 34. the coordinator steers an Interaction worker through its signal contract


def test_s34_the_coordinator_steers_an_interaction_worker(store_url: str) -> None:
    """Scope ``concurrency_test.go`` TestCoordinatorSteersInteractionThroughItsCanonicalSignalContract.

    Turn 1 starts an Interaction worker and continues; the worker's first model call is held;
    turn 2 (held until then) sends it a steer control (``steer_signal``) and waits. The steer
    does not change the in-flight request; the model's "draft" plus the steer produce a second
    model call ("revised"); turn 3 reads the worker's output (2 model calls) and completes
    with the revised text. The control receipt names the worker and holds no failure.
    Adaptation: Scope holds turn 2's admission until the model call entered; we hold turn 2's
    policy call instead.
    """
    model = GatedModel([final("draft"), final("revised")], hold=[1])
    writer = compile_interaction(InteractionConfig(name="test.interaction", model=model))
    program = P.team(P.steer_writer, writer)
    with open_runtime(store_url, program) as runtime:
        handle = runtime.start(program, "initial")
        assert model.gates[1].entered.wait(WAIT)
        wait_until(lambda: P.entries("entered") == ["turn 2"], "turn 2 to be held")
        release()

        def steer_admitted() -> bool:
            return SignalID("signal:revise") in child_by_key(runtime.capture(handle.tree_id), "writer").signal_index

        wait_until(steer_admitted, "the steer to reach the worker")
        model.gates[1].release.set()
        result = handle.result(WAIT)
        tree = runtime.wait_idle(handle.tree_id)

    assert result.status == "completed" and result.output == "revised", result
    first, second = model.requests
    assert [m["role"] for m in first.messages] == ["user"]
    assert [m["role"] for m in second.messages] == ["user", "assistant", "user"]
    assert second.applied_steer_signal_ids == ("signal:revise",)
    turns = P.turns()
    assert [t["number"] for t in turns] == [1, 2, 3]
    writer_process = child_by_key(tree, "writer")
    [receipt] = turns[2]["controls"]
    assert receipt["result"]["child"] == str(writer_process.process_id) and not receipt["result"].get("failure")
    assert turns[2]["tasks"][0]["outcome"]["result"]["output"]["model_calls"] == 2


# ---------------------------------------------------------------------------
# 35. failure table: turn limit, invalid decisions


def test_s35_the_turn_limit_fails_the_collaboration_with_an_execution_failure(store_url: str) -> None:
    """Collaboration failure table: another turn beyond ``max_turns`` -> execution
    ``collaboration.limit.turns``; exactly ``max_turns`` coordinator calls were made."""
    program = P.team(P.keep_continuing, P.echo(), max_turns=2)
    result, tree = run(store_url, program)
    assert result.status == "failed"
    failure = failure_of(result)
    assert (failure["kind"], failure["code"]) == ("execution", "collaboration.limit.turns")
    assert [t["number"] for t in P.turns()] == [1, 2]
    assert child_keys(tree) == ["collaboration.turn.1", "collaboration.turn.2"]


def test_s35_an_unknown_worker_is_an_invalid_decision_and_starts_nothing(store_url: str) -> None:
    """Collaboration failure table: a task for an unknown worker -> contract
    ``collaboration.decision.invalid``; the whole candidate is discarded (no task started)."""
    program = P.team(P.unknown_worker, P.echo())
    result, tree = run(store_url, program)
    assert result.status == "failed"
    failure = failure_of(result)
    assert (failure["kind"], failure["code"]) == ("contract", "collaboration.decision.invalid")
    assert "test.missing" in failure["message"]
    assert child_keys(tree) == ["collaboration.turn.1"] and P.entries("echo") == []


OK = {"mode": "wait", "tasks": [{"key": "first", "worker": "test.echo", "input": "a"}]}
GATE = {"mode": "continue", "tasks": [{"key": "first", "worker": "test.gate", "input": "a"}]}

INVALID_DECISIONS: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    # rule 1: state, shape, output
    "state violates the state schema": ([{"mode": "continue", "state": "not an object"}], {}),
    "output with a mode": ([{"mode": "continue", "output": "x"}], {}),
    "output with tasks": ([{"mode": "", "output": "x", "tasks": [{"key": "t", "worker": "test.echo", "input": "a"}]}], {}),
    "output violates the output schema": ([{"mode": "", "output": 5}], {}),
    "no output and no mode": ([{"mode": ""}], {}),
    # rule 2: max tasks (rejected starts count too)
    "max_tasks 0 forbids worker starts": ([OK], {"max_tasks": 0}),
    "max_tasks counts existing tasks": ([OK, {"mode": "wait", "tasks": [{"key": "second", "worker": "test.echo", "input": "b"}]}],
                                        {"max_tasks": 1}),
    # rule 3: concurrency
    "too many concurrent tasks": ([{"mode": "wait", "tasks": [{"key": "a", "worker": "test.gate", "input": "a"},
                                                              {"key": "b", "worker": "test.gate", "input": "b"}]}],
                                  {"max_concurrent_tasks": 1}),
    "running tasks count toward concurrency": ([GATE, {"mode": "wait", "tasks": [{"key": "b", "worker": "test.gate", "input": "b"}]}],
                                               {"max_concurrent_tasks": 1}),
    # rule 4: controls per turn
    "too many controls": ([GATE, {"mode": "wait", "controls": [{"task": "first", "cancel_reason": "a"},
                                                               {"task": "first", "cancel_reason": "b"}]}],
                          {"max_controls_per_turn": 1}),
    # rule 5: task requests
    "reserved key prefix": ([{"mode": "wait", "tasks": [{"key": "collaboration.turn.9", "worker": "test.echo", "input": "a"}]}], {}),
    "invalid key": ([{"mode": "wait", "tasks": [{"key": "", "worker": "test.echo", "input": "a"}]}], {}),
    "unknown worker": ([{"mode": "wait", "tasks": [{"key": "t", "worker": "test.nobody", "input": "a"}]}], {}),
    "input invalid for the worker": ([{"mode": "wait", "tasks": [{"key": "t", "worker": "test.echo", "input": 5}]}], {}),
    "duplicate keys in one decision": ([{"mode": "wait", "tasks": [{"key": "t", "worker": "test.echo", "input": "a"},
                                                                   {"key": "t", "worker": "test.echo", "input": "b"}]}], {}),
    "key of an existing task": ([OK, {"mode": "wait", "tasks": [{"key": "first", "worker": "test.echo", "input": "b"}]}], {}),
    # rule 6: controls
    "control of an unknown task": ([{"mode": "continue", "controls": [{"task": "nobody", "cancel_reason": "x"}]}], {}),
    "control with signal and cancel": ([GATE, {"mode": "wait", "controls": [
        {"task": "first", "cancel_reason": "x", "signal": {"id": "signal:s", "payload": 1}}]}], {}),
    "control with neither signal nor cancel": ([GATE, {"mode": "wait", "controls": [{"task": "first"}]}], {}),
    # rule 7: wait on nothing
    "wait with nothing outstanding": ([{"mode": "wait"}], {}),
}


@pytest.mark.parametrize("case", sorted(INVALID_DECISIONS))
def test_s35_every_decision_rule_refuses_the_whole_candidate(case: str) -> None:
    """Spec 8.2 "Validation of a Decision" rules 1-7: each invalid Decision fails the
    collaboration with contract ``collaboration.decision.invalid``, on the turn that made it,
    and nothing of it is acted on (no child started by that turn, no further turn)."""
    script, options = INVALID_DECISIONS[case]
    program = P.team(P.scripted, P.echo(), P.gate(), state_schema={"type": "object"}, output_schema=P.TEXT, **options)
    result, tree = run("memory:", program, {"script": script})
    assert result.status == "failed", (case, result)
    failure = failure_of(result)
    assert (failure["kind"], failure["code"]) == ("contract", "collaboration.decision.invalid"), (case, failure)
    assert [t["number"] for t in P.turns()] == list(range(1, len(script) + 1)), case
    keys = child_keys(tree)
    assert keys[-1] == f"collaboration.turn.{len(script)}", (case, keys)
    earlier = [k for k in keys if not k.startswith("collaboration.turn.")]
    assert earlier == (["first"] if len(script) == 2 else []), (case, keys)


def test_completing_cancels_running_tasks(store_url: str) -> None:
    """Spec 8.3 step 6 / seed: completing the collaboration cancels remaining descendants; the
    running gate task ends canceled and the root completes with the Decision's output."""
    script = [GATE, {"mode": "", "output": "bye"}]
    program = P.team(P.scripted, P.gate(), state_schema={"type": "object"}, output_schema=P.TEXT)
    result, tree = run(store_url, program, {"script": script})
    assert result.status == "completed" and result.output == "bye"
    assert child_by_key(tree, "first").status == "canceled"
    second = P.turns()[1]
    assert "start" in second["tasks"][0] and "outcome" not in second["tasks"][0]


def test_a_failed_task_start_is_a_fact_for_the_next_turn() -> None:
    """Spec 8.3: start failures are explicit facts, not collaboration failures. A worker
    bound with a capability the collaboration lacks is refused at start; with mode wait and
    nothing running the next turn starts at once and sees ``start.failure``."""
    script = [OK, {"mode": "", "output": "seen"}]
    member = TeamMember(P.echo(), P.WORKER_BUDGET, frozenset({"secret"}))
    program = compile_team(TeamConfig(
        name="test.collaboration", coordinator=TeamMember(P.coordinator(P.scripted), P.COORDINATOR_BUDGET),
        workers=[member], state_schema={"type": "object"}, output_schema=P.TEXT,
    ))
    result, _ = run("memory:", program, {"script": script})
    assert result.status == "completed" and result.output == "seen"
    [refused] = P.turns()[1]["tasks"]
    assert "outcome" not in refused
    assert refused["start"] == {"failure": {"kind": "contract", "code": "engine.child.capability_escalation",
                                            "message": "child capabilities ['secret'] exceed the parent's"}}
    assert P.entries("echo") == []


def test_refused_starts_count_toward_max_tasks() -> None:
    """Spec 8.2 rule 2 / seed: "MaxTasks counts all attempts, including rejected starts". With
    ``max_tasks=1``, a refused start uses the one task; a later task is an invalid decision."""
    script = [OK, {"mode": "wait", "tasks": [{"key": "second", "worker": "test.echo", "input": "b"}]}]
    program = compile_team(TeamConfig(
        name="test.collaboration", coordinator=TeamMember(P.coordinator(P.scripted), P.COORDINATOR_BUDGET),
        workers=[TeamMember(P.echo(), P.WORKER_BUDGET, frozenset({"secret"}))],
        state_schema={"type": "object"}, output_schema=P.TEXT, max_tasks=1,
    ))
    result, tree = run("memory:", program, {"script": script})
    assert result.status == "failed"
    failure = failure_of(result)
    assert (failure["kind"], failure["code"]) == ("contract", "collaboration.decision.invalid"), failure
    assert [t["number"] for t in P.turns()] == [1, 2] and "second" not in child_keys(tree)


def test_an_initial_state_that_breaks_the_state_schema_is_refused_and_nothing_is_stored(store_url: str) -> None:
    """Spec 8.1: the root input is the initial working state, validated by ``state_schema``: a
    bad one is refused at start with a classified error; no tree is stored, nothing is called."""
    program = P.team(P.finish_at_once, P.echo())
    store = EventStore(store_url)
    try:
        with open_runtime(store, program) as runtime:
            with pytest.raises(AgentfoldError) as caught:
                runtime.start(program, 5, start_id="start:bad-state")
            assert caught.value.code and caught.value.message
        assert store.head(TreeID.for_start("start:bad-state")) is None  # type: ignore[arg-type]
    finally:
        store.close()
    assert P.turns() == []


# ---------------------------------------------------------------------------
# Compile-time refusals (spec 8.1)


def _coordinator_with(input_schema: JSON, output_schema: JSON) -> Program:
    return transform(TransformConfig("test.coordinator", P.finish_at_once, input_schema=input_schema,
                                     output_schema=output_schema))


def _config(**changes: Any) -> TeamConfig:
    base: dict[str, Any] = {
        "name": "test.collaboration",
        "coordinator": TeamMember(P.coordinator(P.finish_at_once)),
        "workers": [TeamMember(P.echo())],
    }
    base.update(changes)
    return TeamConfig(**base)


REFUSED_CONFIGS: dict[str, dict[str, Any]] = {
    "no worker": {"workers": []},
    "duplicate worker names": {"workers": [TeamMember(P.echo()), TeamMember(P.echo())]},
    "coordinator input is not TURN_SCHEMA": {
        "coordinator": TeamMember(_coordinator_with({**TURN_SCHEMA, "description": "x"}, DECISION_SCHEMA))},
    "coordinator output is not DECISION_SCHEMA": {
        "coordinator": TeamMember(_coordinator_with(TURN_SCHEMA, True))},
    "coordinator is not a TeamMember": {"coordinator": P.coordinator(P.finish_at_once)},
    "a worker is not a TeamMember": {"workers": [P.echo()]},
    "max_turns 0": {"max_turns": 0},
    "max_concurrent_tasks 0": {"max_concurrent_tasks": 0},
    "max_controls_per_turn 0": {"max_controls_per_turn": 0},
    # found by the review helper: these raised schema.invalid, AttributeError or TypeError
    "a state schema agentfold cannot enforce": {"state_schema": {"type": "thing"}},
    "an output schema agentfold cannot enforce": {"output_schema": {"frobnicate": 1}},
    "a member budget that is not a Budget": {"workers": [TeamMember(P.echo(), {"steps": 3})]},  # type: ignore[arg-type]
    "member capabilities that are a string": {"workers": [TeamMember(P.echo(), capabilities="net")]},  # type: ignore[arg-type]
    "a configuration that is not JSON": {"configuration": {1, 2}},
    # a description that is no text was accepted (and digested as a number)
    "a description that is not text": {"description": 5},
    "a description with a lone surrogate": {"description": "team \udc80"},
}


@pytest.mark.parametrize("case", sorted(REFUSED_CONFIGS))
def test_compile_team_refuses_an_invalid_definition(case: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        compile_team(_config(**REFUSED_CONFIGS[case]))
    assert caught.value.code == "collaboration.definition.invalid", (case, caught.value)
    assert caught.value.message


def test_compile_team_accepts_the_boundary_values() -> None:
    """``max_tasks=0`` (forbids worker starts) and ``max_turns=1`` are valid definitions."""
    program = compile_team(_config(max_tasks=0, max_turns=1, max_concurrent_tasks=1, max_controls_per_turn=1))
    assert program.descriptor.name == "test.collaboration"
    assert program.descriptor.input_schema is True and program.descriptor.output_schema is True

"""Every fold rule of DESIGN.md "Rules the fold enforces", proved on hand-built bad streams.

Each test starts from a valid stream (built event by event with the pydantic models of
``agentfold.domain.events`` and the derived ids of ``agentfold.domain.ids``, or recorded by a real Runtime),
corrupts it in one place, and asserts that :func:`agentfold.domain.tree.fold_tree` raises
:class:`FoldError` with the exact rule name and the exact position (one-based) of the
offending event. Every corrupt stream's prefix before the bad event must fold cleanly,
so the error is known to come from that event and not from an earlier mistake.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.budget import Budget
from agentfold.domain.errors import Failure, FailureKind
from agentfold.domain.events import (
    CheckpointCommitted,
    ControlRequested,
    EffectDeclared,
    EffectDispatched,
    EffectResolved,
    EffectSettled,
    ProcessStarted,
    ProcessTerminated,
    SignalAdmitted,
    StepCommitted,
    TreeEvent,
    TreeLimits,
    TreeStarted,
    WriterActivated,
)
from agentfold.domain.ids import (
    ChildKey,
    Digest,
    EffectAttemptID,
    EffectID,
    ProcessID,
    SignalID,
    StartID,
    TreeID,
    TreeIncarnationID,
    WaitID,
    child_process_id,
    child_wait_satisfied_signal_id,
    effect_id,
    root_process_id,
    settlement_signal_id,
    wait_id_for,
    wait_opened_signal_id,
)
from agentfold.domain.program import (
    ChildSpec,
    Complete,
    Continue,
    Descriptor,
    Program,
    ProgramRef,
    Signal,
    SignalRequest,
    Step,
    cancel_child_effect,
    signal_child_effect,
    start_child_effect,
)
from agentfold.domain.tree import FoldError, TreeState, fold_tree
from tests.bad_input_programs import listener_program
from tests.kernel_programs import IMPL, JsonStrategy, asker_program, chain_program, config_digest, parent_program

# ---------------------------------------------------------------------------
# Hand-built streams

START = StartID("fold-rules")
TREE = TreeID.for_start(START)
ROOT = root_process_id(bytes(range(16)))
INC1 = TreeIncarnationID.from_bytes(b"\x01" * 16)
INC2 = TreeIncarnationID.from_bytes(b"\x02" * 16)
INC3 = TreeIncarnationID.from_bytes(b"\x03" * 16)
REF = ProgramRef(
    name="test.fold",
    contract_digest=Digest.of(b"contract"),
    implementation_digest=Digest.of(b"implementation"),
    configuration_digest=Digest.of(b"configuration"),
    bindings_digest=ProgramRef.bindings_of([]),
)
CHILD_REF = ProgramRef(
    name="test.fold.child",
    contract_digest=Digest.of(b"child contract"),
    implementation_digest=Digest.of(b"implementation"),
    configuration_digest=Digest.of(b"child configuration"),
    bindings_digest=ProgramRef.bindings_of([]),
)
UNBOUND_REF = ProgramRef(
    "test.fold.unbound", REF.contract_digest, REF.implementation_digest, REF.configuration_digest, REF.bindings_digest
)
DIAGNOSTIC = Failure(FailureKind.EXTERNAL, "engine.dispatch.interrupted", "the writer stopped")
BOOM = Failure(FailureKind.EXECUTION, "test.fold.boom", "the strategy gave up")


def attempt(n: int) -> EffectAttemptID:
    return EffectAttemptID.from_bytes(n.to_bytes(16, "big"))


def eid(step: int, index: int = 0, pid: ProcessID = ROOT) -> EffectID:
    return effect_id(pid, step, index)


def started(
    budget: Budget | None = None,
    capabilities: Sequence[str] = (),
    limits: TreeLimits | None = None,
    pid: ProcessID = ROOT,
    programs: Sequence[ProgramRef] = (CHILD_REF,),
    **extra: Any,
) -> TreeStarted:
    """The root runs REF; CHILD_REF is bound under it, so start effects may name it by text ref."""
    return TreeStarted(
        process_id=pid,
        tree_id=extra.pop("tree_id", TREE),
        start_id=START,
        incarnation_id=INC1,
        program=REF,
        input={"n": 1},
        budget=budget or Budget(),
        capabilities=tuple(capabilities),
        limits=limits or TreeLimits(),
        programs=tuple(programs),
    )


def step(
    n: int, kind: str = "continue", *, consumed: int = 0, effects: int = 0, pid: ProcessID = ROOT, **extra: Any
) -> StepCommitted:
    return StepCommitted(process_id=pid, step=n, consumed=consumed, kind=kind, effects=effects, **extra)


def declared(
    n: int,
    index: int = 0,
    *,
    target: str = "dispatcher",
    payload: Any = None,
    replay: str = "never",
    pid: ProcessID = ROOT,
    effect: EffectID | None = None,
) -> EffectDeclared:
    return EffectDeclared(
        process_id=pid,
        effect_id=effect or eid(n, index, pid),
        step=n,
        index=index,
        target=target,
        payload=payload if payload is not None else {"call": f"{n}/{index}"},
        replay=replay,
    )


def dispatched(
    n: int, index: int = 0, *, att: int = 1, inc: TreeIncarnationID = INC1, pid: ProcessID = ROOT
) -> EffectDispatched:
    return EffectDispatched(process_id=pid, effect_id=eid(n, index, pid), attempt_id=attempt(att), incarnation_id=inc)


def settled(
    n: int,
    index: int = 0,
    status: str = "succeeded",
    *,
    att: int | None = 1,
    payload: Any = None,
    diagnostic: Failure | None = None,
    pid: ProcessID = ROOT,
    effect: EffectID | None = None,
) -> EffectSettled:
    if status == "unknown" and diagnostic is None:
        diagnostic = DIAGNOSTIC
    return EffectSettled(
        process_id=pid,
        effect_id=effect or eid(n, index, pid),
        status=status,
        payload=payload if payload is not None or status == "unknown" else {"value": 1},
        attempt_id=attempt(att) if att is not None else None,
        diagnostic=diagnostic,
    )


def resolved(
    n: int, index: int = 0, status: str = "succeeded", *, by: str = "host", pid: ProcessID = ROOT
) -> EffectResolved:
    return EffectResolved(
        process_id=pid, effect_id=eid(n, index, pid), status=status, payload={"value": 2}, resolved_by=by
    )


def admitted(
    sid: str, payload: Any = None, *, wait: WaitID | None = None, pid: ProcessID = ROOT, source: str = "host"
) -> SignalAdmitted:
    return SignalAdmitted(
        process_id=pid,
        signal_id=SignalID(sid),
        wait_id=wait,
        payload=payload if payload is not None else {"text": sid},
        source=source,
    )


def terminated(
    status: str = "completed",
    cause: str = "completion",
    *,
    pid: ProcessID = ROOT,
    failure: Failure | None = None,
    output: Any = None,
    unresolved: Sequence[EffectID] = (),
) -> ProcessTerminated:
    if status == "completed" and output is None:
        output = {"ok": True}
    return ProcessTerminated(
        process_id=pid,
        status=status,
        cause=cause,
        failure=failure,
        output=output,
        reason="" if cause == "completion" else cause,
        unresolved_effect_ids=tuple(unresolved),
    )


def activated(new: TreeIncarnationID, previous: TreeIncarnationID, pid: ProcessID = ROOT) -> WriterActivated:
    return WriterActivated(process_id=pid, incarnation_id=new, previous_incarnation_id=previous)


def control(kind: str, reason: str = "by test", *, owner: str = "host", pid: ProcessID = ROOT) -> ControlRequested:
    return ControlRequested(process_id=pid, control=kind, reason=reason, owner=owner)


def wait_payload(key: str = "answer") -> dict[str, Any]:
    return {"operation": "wait", "key": key}


CHILD_EFFECT = eid(1, 0)
CHILD = child_process_id(CHILD_EFFECT)


def child_payload(budget: Budget | None = None, key: str = "kid", capabilities: Sequence[str] = ()) -> dict[str, Any]:
    spec = ChildSpec(ChildKey(key), CHILD_REF, {"n": 1}, budget or Budget(), frozenset(capabilities))
    return {"operation": "start_child", **spec.to_json()}


def child_started(pid: ProcessID = CHILD, start: EffectID = CHILD_EFFECT) -> ProcessStarted:
    """The child's key, program, input, grant and capabilities are its start effect's payload."""
    return ProcessStarted(process_id=pid, parent_id=ROOT, start_effect_id=start)


def child_settled(status: str = "failed", payload: Any = None, effect: EffectID = CHILD_EFFECT) -> EffectSettled:
    """An explicit settlement of a start-child effect: only a failed start is stored this way."""
    body = payload if payload is not None else {"key": "kid", "program": str(CHILD_REF), "failure": BOOM.to_json()}
    return EffectSettled(process_id=ROOT, effect_id=effect, status=status, payload=body)


# Valid streams, one per area of the rules.


def one_effect() -> list[TreeEvent]:
    return [
        started(),  # 1
        step(1, effects=1),  # 2
        declared(1),  # 3
        dispatched(1),  # 4
        settled(1),  # 5
        step(2, "complete", consumed=1),  # 6
        terminated(),  # 7
    ]


def two_effects(replay: str = "never") -> list[TreeEvent]:
    return [
        started(),  # 1
        step(1, effects=2),  # 2
        declared(1, 0, replay=replay),  # 3
        declared(1, 1, replay=replay),  # 4
        dispatched(1, 0, att=1),  # 5
        settled(1, 0, att=1),  # 6
        dispatched(1, 1, att=2),  # 7
        settled(1, 1, att=2),  # 8
        step(2, "complete", consumed=2),  # 9
        terminated(),  # 10
    ]


def unknown_then_resolved() -> list[TreeEvent]:
    """A writer dies mid-dispatch; the next one settles unknown; a host resolves it."""
    return [
        started(),  # 1
        step(1, effects=2),  # 2
        declared(1, 0),  # 3
        declared(1, 1),  # 4
        dispatched(1, 0, att=1),  # 5
        activated(INC2, INC1),  # 6
        settled(1, 0, "unknown", att=1),  # 7
        resolved(1, 0),  # 8
        dispatched(1, 1, att=2, inc=INC2),  # 9
        settled(1, 1, att=2),  # 10
        step(2, "complete", consumed=2),  # 11
        terminated(),  # 12
    ]


def replayed_after_activation() -> list[TreeEvent]:
    """A same_identity effect is dispatched again by the new writer under a new attempt."""
    return [
        started(),  # 1
        step(1, effects=1),  # 2
        declared(1, replay="same_identity"),  # 3
        dispatched(1, att=1),  # 4
        activated(INC2, INC1),  # 5
        dispatched(1, att=2, inc=INC2),  # 6
        settled(1, att=2),  # 7
        step(2, "complete", consumed=1),  # 8
        terminated(),  # 9
    ]


WAIT_EFFECT = eid(1, 0)
WAIT = wait_id_for(WAIT_EFFECT)


def waiting() -> list[TreeEvent]:
    """Open an external wait, wait on it, receive the answer, complete.

    Nothing is stored for the wait's settlement: it settles (and the wait opens) as soon
    as its declaration is applied, at the frontier of a running Process.
    """
    return [
        started(),  # 1
        step(1, effects=1),  # 2
        declared(1, target="framework", payload=wait_payload()),  # 3 (the wait opens here)
        step(2, "wait", consumed=1, wait_id=WAIT),  # 4
        admitted("answer-1", {"name": "ada"}, wait=WAIT),  # 5
        step(3, "complete", consumed=1),  # 6
        terminated(),  # 7
    ]


PAUSED_WAIT = wait_id_for(eid(1, 1))


def wait_behind_a_pause() -> list[TreeEvent]:
    """A wait behind a dispatcher effect reaches the frontier while the Process is paused.

    It stays planned until the resume, which settles it and finishes the batch: the
    next Step sees the dispatcher's settlement and the wait's opening, and waits on it.
    """
    return [
        started(),  # 1
        step(1, effects=2),  # 2
        declared(1, 0),  # 3
        declared(1, 1, target="framework", payload=wait_payload()),  # 4
        dispatched(1, 0),  # 5
        control("pause", "hold"),  # 6
        settled(1, 0),  # 7 (the wait is now the frontier of a paused Process)
        control("resume", ""),  # 8 (the wait settles and opens here)
        step(2, "wait", consumed=2, wait_id=PAUSED_WAIT),  # 9
        admitted("answer-1", {"name": "ada"}, wait=PAUSED_WAIT),  # 10
        step(3, "complete", consumed=1),  # 11
        terminated(),  # 12
    ]


def signals() -> list[TreeEvent]:
    return [
        started(),  # 1
        admitted("s1"),  # 2
        admitted("s2"),  # 3
        step(1, "complete", consumed=2),  # 4
        terminated(),  # 5
    ]


def with_child(parent_budget: Budget | None = None, child_budget: Budget | None = None) -> list[TreeEvent]:
    """The root starts one child (ProcessStarted also settles the start), which completes; then the root."""
    return [
        started(parent_budget),  # 1
        step(1, effects=1),  # 2
        declared(1, target="framework", payload=child_payload(child_budget)),  # 3
        child_started(),  # 4
        step(1, "complete", pid=CHILD),  # 5
        terminated(pid=CHILD),  # 6
        step(2, "complete", consumed=1),  # 7
        terminated(),  # 8
    ]


def failed_child_start() -> list[TreeEvent]:
    """A start the kernel refused is stored as a failed EffectSettled; no child exists."""
    return [
        started(),  # 1
        step(1, effects=1),  # 2
        declared(1, target="framework", payload=child_payload()),  # 3
        child_settled(),  # 4
        step(2, "complete", consumed=1),  # 5
        terminated(),  # 6
    ]


KIDS_EFFECT = eid(2, 0)
KIDS = wait_id_for(KIDS_EFFECT)


def kids_payload(key: str = "kids") -> dict[str, Any]:
    return {
        "operation": "wait_children",
        "key": key,
        "children": [str(CHILD)],
        "boundary": "terminal_result",
        "condition": "all",
    }


def waiting_for_a_child() -> list[TreeEvent]:
    """The root starts a child, opens a child wait and waits on it; the child's end satisfies it."""
    return [
        started(),  # 1
        step(1, effects=1),  # 2
        declared(1, target="framework", payload=child_payload()),  # 3
        child_started(),  # 4
        step(2, consumed=1, effects=1),  # 5
        declared(2, target="framework", payload=kids_payload()),  # 6 (the child wait opens here)
        step(3, "wait", consumed=1, wait_id=KIDS),  # 7
        step(1, "complete", pid=CHILD),  # 8
        terminated(pid=CHILD),  # 9 (the satisfaction is derived here)
        step(4, "complete", consumed=1),  # 10
        terminated(),  # 11
    ]


HELLO = {"id": "hello", "wait_id": None, "payload": {"text": "hi"}}


def commanding() -> list[TreeEvent]:
    """The root starts a child, signals it and cancels it (parent-owned input), then completes."""
    commands = [
        {"operation": "signal_child", "child": str(CHILD), "signal": HELLO},
        {"operation": "cancel_child", "child": str(CHILD), "reason": "enough"},
    ]
    return [
        started(),  # 1
        step(1, effects=1),  # 2
        declared(1, target="framework", payload=child_payload()),  # 3
        child_started(),  # 4
        step(2, consumed=1, effects=2),  # 5
        declared(2, 0, target="framework", payload=commands[0]),  # 6
        declared(2, 1, target="framework", payload=commands[1]),  # 7
        admitted("hello", {"text": "hi"}, pid=CHILD, source="parent"),  # 8
        settled(2, 0, att=None, payload={"child": str(CHILD), "signal_id": "hello"}),  # 9
        control("cancel", "enough", owner="parent", pid=CHILD),  # 10
        settled(2, 1, att=None, payload={"child": str(CHILD)}),  # 11
        terminated("canceled", "parent_cancellation", pid=CHILD),  # 12
        step(3, "complete", consumed=2),  # 13
        terminated(),  # 14
    ]


def checkpointed_and_controlled() -> list[TreeEvent]:
    return [
        started(),  # 1
        step(1, "checkpoint"),  # 2
        CheckpointCommitted(process_id=ROOT, step=1, kind="progress"),  # 3
        control("pause", "host pause"),  # 4
        control("resume", ""),  # 5
        step(2, "pause", reason="strategy pause"),  # 6
        control("resume", ""),  # 7
        step(3, "fail"),  # 8 (the failure is stored once, in ProcessTerminated)
        terminated("failed", "execution_failure", failure=BOOM),  # 9
    ]


def canceled_with_unknown() -> list[TreeEvent]:
    """An unknown effect stays unresolved as evidence when the host cancels."""
    return [
        started(),  # 1
        step(1, effects=1),  # 2
        declared(1),  # 3
        dispatched(1),  # 4
        settled(1, status="unknown"),  # 5
        control("cancel"),  # 6
        terminated("canceled", "host_cancellation", unresolved=[eid(1)]),  # 7
    ]


VALID_STREAMS = {
    "one_effect": one_effect,
    "two_effects": two_effects,
    "unknown_then_resolved": unknown_then_resolved,
    "replayed_after_activation": replayed_after_activation,
    "waiting": waiting,
    "wait_behind_a_pause": wait_behind_a_pause,
    "failed_child_start": failed_child_start,
    "waiting_for_a_child": waiting_for_a_child,
    "signals": signals,
    "with_child": with_child,
    "checkpointed_and_controlled": checkpointed_and_controlled,
    "canceled_with_unknown": canceled_with_unknown,
    "commanding": commanding,
}


# ---------------------------------------------------------------------------
# Assertions


def assert_corrupt(events: Sequence[TreeEvent], bad: TreeEvent, rule: str, programs: Any = None) -> FoldError:
    """Folding ``events`` fails at ``bad`` (by identity) with ``rule``; everything before it folds."""
    index = next(i for i, e in enumerate(events) if e is bad)
    fold_tree(events[:index], programs)  # the prefix is valid: the error belongs to ``bad``
    with pytest.raises(FoldError) as caught:
        fold_tree(events, programs)
    error = caught.value
    assert (error.rule, error.position) == (rule, index + 1), str(error)
    first = events[0]
    if index > 0 and isinstance(first, TreeStarted):
        assert error.tree_id == first.tree_id  # the error names the tree it belongs to
    return error


def replace(events: list[TreeEvent], index: int, bad: TreeEvent) -> list[TreeEvent]:
    out = list(events)
    out[index] = bad
    return out


def insert(events: list[TreeEvent], index: int, bad: TreeEvent) -> list[TreeEvent]:
    out = list(events)
    out.insert(index, bad)
    return out


# ---------------------------------------------------------------------------
# Valid streams fold, deterministically


@pytest.mark.parametrize("name", sorted(VALID_STREAMS))
def test_valid_hand_built_streams_fold_without_error(name: str) -> None:
    events = VALID_STREAMS[name]()
    tree = fold_tree(events)
    assert tree.version == len(events)
    assert tree.root.terminal


@pytest.mark.parametrize("name", sorted(VALID_STREAMS))
def test_folding_the_same_events_twice_gives_identical_state(name: str) -> None:
    events = VALID_STREAMS[name]()
    assert fold_tree(events).to_json() == fold_tree(list(events)).to_json()


def test_valid_streams_fold_to_the_states_their_rules_describe() -> None:
    tree = fold_tree(unknown_then_resolved())
    root = tree.root
    assert root.batch == []  # the batch finished once the unknown was resolved and #1 settled
    assert (root.status, root.usage) == ("completed", {"steps": 2, "effects": 2, "signals": 2})
    assert tree.incarnations == [INC1, INC2]
    child_tree = fold_tree(with_child(Budget.of(steps=4), Budget.of(steps=2)))
    assert child_tree.root.allocated.steps == 2
    assert child_tree.processes[CHILD].status == "completed"
    canceled = fold_tree(canceled_with_unknown()).root
    assert canceled.termination is not None and canceled.termination.unresolved_effect_ids == (eid(1),)


# ---------------------------------------------------------------------------
# What the fold derives instead of storing


def test_a_wait_opens_when_its_declaration_is_applied() -> None:
    """A Step that declares only a wait opens it at once, so the next Step can Wait on it."""
    root = fold_tree(waiting()[:3]).root
    assert root.batch == []
    assert list(root.waits) == [WAIT] and root.open_wait_keys == {"answer": WAIT}
    (opened,) = root.pending()
    assert (opened.signal_id, opened.wait_id, opened.source) == (wait_opened_signal_id(WAIT), WAIT, "engine")
    assert opened.payload == {"operation": "wait", "wait_id": WAIT, "key": "answer"}
    assert root.reserved_signals == 0 and root.accepted_signals == 1


def test_a_wait_at_the_frontier_of_a_paused_process_opens_when_it_resumes() -> None:
    events = wait_behind_a_pause()
    paused = fold_tree(events[:7]).root  # the dispatcher effect settled while paused
    assert [r.phase for r in paused.batch] == ["settled", "planned"]
    assert paused.waits == {} and paused.pending() == []
    resumed = fold_tree(events[:8]).root
    assert resumed.batch == [] and list(resumed.waits) == [PAUSED_WAIT]
    assert [r.signal_id for r in resumed.pending()] == [
        settlement_signal_id(eid(1, 0)),
        wait_opened_signal_id(PAUSED_WAIT),
    ]


def test_a_wait_at_the_frontier_of_a_terminating_process_never_opens() -> None:
    events = [
        started(),
        step(1, effects=2),
        declared(1, 0),
        declared(1, 1, target="framework", payload=wait_payload()),
        dispatched(1, 0),
        control("cancel"),
        settled(1, 0),
        terminated("canceled", "host_cancellation"),
    ]
    root = fold_tree(events).root
    assert root.waits == {} and root.pending() == []
    assert [(r.effect_id, r.phase) for r in root.batch] == [(eid(1, 0), "settled"), (eid(1, 1), "planned")]


def test_process_started_settles_the_start_effect_with_the_derived_child_start_result() -> None:
    tree = fold_tree(with_child()[:4])
    root, child = tree.root, tree.processes[CHILD]
    assert root.batch == []
    (settlement,) = root.pending()
    assert settlement.signal_id == settlement_signal_id(CHILD_EFFECT)
    assert settlement.payload == {"key": "kid", "program": str(CHILD_REF), "process_id": CHILD}
    assert settlement.status is None  # framework settlements carry no dispatcher status
    # Everything about the child comes from the start effect's payload.
    assert (child.child_key, child.program, child.input) == ("kid", CHILD_REF, {"n": 1})
    assert (child.parent_id, child.start_effect_id, child.depth) == (ROOT, CHILD_EFFECT, 1)


def test_a_failed_start_settles_with_its_stored_failure_and_starts_no_child() -> None:
    tree = fold_tree(failed_child_start()[:4])
    assert list(tree.processes) == [ROOT]
    (settlement,) = tree.root.pending()
    assert settlement.payload == {"key": "kid", "program": str(CHILD_REF), "failure": BOOM.to_json()}


def test_a_child_wait_is_satisfied_by_the_childs_termination() -> None:
    events = waiting_for_a_child()
    before = fold_tree(events[:8]).root
    assert before.status == "waiting" and before.current_wait == KIDS
    after = fold_tree(events[:9]).root
    assert after.status == "running" and after.current_wait is None
    (satisfied,) = after.pending()
    assert (satisfied.signal_id, satisfied.wait_id) == (child_wait_satisfied_signal_id(KIDS), KIDS)
    (outcome,) = satisfied.payload["outcomes"]
    assert (outcome["key"], outcome["result"]["status"]) == ("kid", "completed")


def test_a_terminating_parent_gives_its_live_children_a_parent_owned_intent() -> None:
    events = [*waiting_for_a_child()[:7], control("kill"), terminated("killed", "engine_kill")]
    child = fold_tree(events).processes[CHILD]
    assert child.intents == {"cancel": ("parent", f"parent {ROOT} ended killed")}


def test_recorded_streams_store_no_settlement_for_waits_or_started_children(recorded: Any) -> None:
    """The kernel stores neither wait settlements nor successful start settlements."""
    for events, _ in recorded.values():
        declared_ops = {
            e.effect_id: e.payload.get("operation")
            for e in events
            if isinstance(e, EffectDeclared) and e.target == "framework"
        }
        stored = [
            (declared_ops[e.effect_id], e.status)
            for e in events
            if isinstance(e, EffectSettled) and e.effect_id in declared_ops
        ]
        assert not [s for s in stored if s[0] in ("wait", "wait_children") or s == ("start_child", "succeeded")]
    # The parent stream exercises both: two children started, then a child wait opened and answered.
    parent_events = recorded["parent"][0]
    assert sum(isinstance(e, ProcessStarted) for e in parent_events) == 2
    parent_ops = [
        e.payload["operation"] for e in parent_events if isinstance(e, EffectDeclared) and e.target == "framework"
    ]
    assert parent_ops.count("wait_children") == 1 and parent_ops.count("wait") == 2


class UnboundStarter(JsonStrategy):
    """Start a child whose Program is not bound anywhere in the tree, then report the start."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start":
            spec = ChildSpec(ChildKey("kid"), asker_program().ref, None)
            return Step(0, Continue((start_child_effect(spec),)), {"phase": "starting"})
        return Step(len(window), Complete({"start": window[0].payload}), {"phase": "done"})


def test_a_start_of_an_unbound_program_is_stored_as_a_failed_start() -> None:
    """Kernel spec: an unresolvable child Program is a failed start (deployment_unavailable),
    which the parent observes; it is not a refused Step."""
    program = Program(Descriptor("test.unbound_starter"), UnboundStarter(), IMPL, config_digest("unbound-starter"))
    store = EventStore("memory:")
    with Runtime(store, Catalog([program])) as runtime:
        handle = runtime.start(program, None)
        result = handle.result(timeout=30)
        events = [r.event for r in store.read(handle.tree_id)]
    assert result.status == "completed", result.termination
    start = result.output["start"]
    assert (start["key"], start["program"]) == ("kid", str(asker_program().ref))
    assert (start["failure"]["kind"], start["failure"]["code"]) == ("external", "engine.child.deployment_unavailable")
    (settled_start,) = [e for e in events if isinstance(e, EffectSettled)]
    assert settled_start.status == "failed" and settled_start.payload == start
    assert not [e for e in events if isinstance(e, ProcessStarted)]
    fold_tree(events)


@pytest.mark.parametrize("name", sorted(VALID_STREAMS))
def test_observing_the_state_mid_stream_does_not_change_it(name: str) -> None:
    """``to_json`` (show, snapshots) after every event leaves the final state as a plain fold's."""
    events = VALID_STREAMS[name]()
    observed = TreeState()
    for event in events:
        observed.apply(event)
        observed.to_json()
    assert observed.to_json() == fold_tree(events).to_json()


class Commander(JsonStrategy):
    """Start a listener child, signal it and cancel it in one batch, then complete."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start":
            spec = ChildSpec(ChildKey("kid"), self.child.ref, None)
            return Step(0, Continue((start_child_effect(spec),)), {"phase": "starting"})
        if state["phase"] == "starting":
            child = ProcessID(window[0].payload["process_id"])
            hello = SignalRequest(SignalID("hello"), {"text": "hi"})
            effects = (signal_child_effect(child, hello), cancel_child_effect(child, "enough"))
            return Step(1, Continue(effects), {"phase": "commanding"})
        return Step(len(window), Complete({"receipts": len(window)}), {"phase": "done"})


def commander_program() -> Program:
    child = listener_program()
    return Program(Descriptor("test.commander"), Commander(child), IMPL, config_digest("commander"), children=(child,))


def recorded_streams() -> dict[str, tuple[list[TreeEvent], Catalog]]:
    """Streams a real Runtime wrote on a memory store: a chain, an answered wait, a parent with children."""
    store = EventStore("memory:")
    out: dict[str, tuple[list[TreeEvent], Catalog]] = {}
    chain = chain_program()
    with Runtime(store) as runtime:
        handle = runtime.start(chain, {"n": 3})
        handle.result(timeout=30)
        out["chain"] = ([r.event for r in store.read(handle.tree_id)], Catalog([chain]))
    asker = asker_program()
    parent = parent_program(asker, 2)
    with Runtime(store, Catalog([parent])) as runtime:
        handle = runtime.start(parent, None)
        tree = runtime.wait_idle(handle.tree_id)
        for i, child in enumerate(p for p in tree.processes.values() if p.parent_id):
            runtime.deliver_signals(
                child.process_id, [SignalRequest(SignalID(f"a-{i}"), {"name": f"n{i}"}, child.current_wait)]
            )
        assert runtime.result(handle.tree_id, timeout=30).status == "completed"
        out["parent"] = ([r.event for r in store.read(handle.tree_id)], Catalog([parent]))
    commander = commander_program()
    with Runtime(store, Catalog([commander])) as runtime:
        handle = runtime.start(commander, None)
        assert handle.result(timeout=30).output == {"receipts": 2}
        out["commander"] = ([r.event for r in store.read(handle.tree_id)], Catalog([commander]))
    return out


@pytest.fixture(scope="module")
def recorded() -> dict[str, tuple[list[TreeEvent], Catalog]]:
    return recorded_streams()


def test_recorded_streams_fold_deterministically_with_and_without_programs(recorded: Any) -> None:
    for events, catalog in recorded.values():
        bare = [fold_tree(events).to_json() for _ in range(2)]
        assert bare[0] == bare[1]
        bound = [fold_tree(events, catalog.resolve).to_json() for _ in range(2)]
        assert bound[0] == bound[1]
        assert bound[0]["processes"][0]["status"] == "completed"
        # Strategy state is the only difference a bound fold adds.
        for process in bound[0]["processes"]:
            assert "state" in process
            process.pop("state")
        assert bound[0] == bare[0]


def test_folding_event_by_event_equals_folding_the_whole_stream(recorded: Any) -> None:
    events, catalog = recorded["parent"]
    tree = TreeState(catalog.resolve)
    for position, event in enumerate(events, start=1):
        tree.apply(event, position)
    assert tree.to_json() == fold_tree(events, catalog.resolve).to_json()
    # A snapshot taken mid-stream and folded on yields the same state again.
    middle = len(events) // 2
    head = fold_tree(events[:middle], catalog.resolve)
    while head._expect is not None:  # snapshots are taken only between whole Steps
        middle += 1
        head = fold_tree(events[:middle], catalog.resolve)
    resumed = TreeState.from_json(head.to_json(), catalog.resolve)
    resumed.apply_all(events[middle:])
    assert resumed.to_json() == tree.to_json()


# ---------------------------------------------------------------------------
# DESIGN rule: an effect is settled only after it was declared


def test_settlement_declared_an_effect_never_declared_cannot_settle() -> None:
    bad = settled(1)
    events = [started(), step(1), bad]
    assert_corrupt(events, bad, "settlement.declared")


def test_settlement_declared_a_settlement_for_another_process_is_not_a_declaration() -> None:
    base = one_effect()
    bad = settled(1, effect=eid(1, 0, CHILD))  # well-formed id, but nobody declared it
    assert_corrupt(replace(base, 4, bad), bad, "settlement.declared")


def test_effect_declaration_a_dropped_declaration_breaks_its_step() -> None:
    base = one_effect()
    events = base[:2] + base[3:]  # the step announced one declaration; it is missing
    assert_corrupt(events, events[2], "effect.declaration")


def test_effect_declared_a_dispatch_needs_a_declared_effect() -> None:
    base = one_effect()
    events = [base[0], step(1), *base[3:]]  # the declaration and the step's count both removed
    assert_corrupt(events, events[2], "effect.declared")


def test_effect_declaration_a_declaration_without_its_step() -> None:
    bad = declared(1)
    assert_corrupt([started(), bad], bad, "effect.declaration")


def test_effect_identity_the_effect_id_must_be_derived_from_process_step_and_index() -> None:
    base = one_effect()
    for wrong in (eid(1, 1), eid(2, 0), eid(1, 0, CHILD)):
        bad = declared(1, effect=wrong)
        assert_corrupt(replace(base, 2, bad), bad, "effect.identity")


# DESIGN rule: a dispatcher effect settles only after EffectDispatched


def test_settlement_after_dispatch_a_dispatcher_effect_never_dispatched_cannot_settle() -> None:
    base = one_effect()
    events = base[:3] + base[4:]  # EffectDispatched dropped
    assert_corrupt(events, events[3], "settlement.after_dispatch")


def test_settlement_after_dispatch_applies_to_unknown_settlements_too() -> None:
    bad = settled(1, status="unknown")
    events = [started(), step(1, effects=1), declared(1), bad]
    assert_corrupt(events, bad, "settlement.after_dispatch")


# DESIGN rule: the frontier rule, and an unknown blocks the rest of the batch


def test_effect_frontier_dispatch_out_of_declaration_order() -> None:
    base = two_effects()
    bad = dispatched(1, 1, att=2)
    assert_corrupt(replace(base, 4, bad), bad, "effect.frontier")


def test_effect_frontier_at_most_one_pending_effect_per_process() -> None:
    base = two_effects()
    bad = dispatched(1, 1, att=2)
    assert_corrupt(insert(base, 5, bad), bad, "effect.frontier")  # #0 is still pending


def test_effect_frontier_an_unknown_blocks_the_rest_of_the_batch() -> None:
    base = two_effects()
    events = replace(base, 5, settled(1, 0, "unknown", att=1))
    assert_corrupt(events, events[6], "effect.frontier")  # dispatch of #1 behind the unknown


def test_effect_frontier_a_later_effect_cannot_settle_before_the_frontier() -> None:
    base = two_effects()
    bad = settled(1, 1, att=2)
    assert_corrupt(replace(base, 5, bad), bad, "effect.frontier")


def test_step_batch_outstanding_an_unknown_blocks_the_process() -> None:
    events = [started(), step(1, effects=1), declared(1), dispatched(1), settled(1, status="unknown")]
    bad = step(2, "complete", consumed=1)
    assert_corrupt([*events, bad], bad, "step.batch_outstanding")


# DESIGN rule: at most one settlement per effect


def test_settlement_once_an_effect_settles_twice_while_its_batch_is_open() -> None:
    base = two_effects()
    bad = settled(1, 0, att=1, payload={"value": 99})
    assert_corrupt(insert(base, 6, bad), bad, "settlement.once")


def test_settlement_once_an_effect_settles_again_after_its_batch_finished() -> None:
    base = one_effect()
    bad = settled(1)
    assert_corrupt(insert(base, 5, bad), bad, "settlement.once")


def test_settlement_once_an_unknown_settlement_is_not_replaced_by_a_later_settlement() -> None:
    base = unknown_then_resolved()
    bad = settled(1, 0, att=1)  # must be a resolution, never a second settlement
    assert_corrupt(replace(base, 7, bad), bad, "settlement.once")


# DESIGN rule: then at most one resolution, and only of an unknown


def test_resolution_only_unknown_a_definite_effect_cannot_be_resolved() -> None:
    base = two_effects()
    bad = resolved(1, 0)
    assert_corrupt(insert(base, 6, bad), bad, "resolution.only_unknown")


def test_resolution_only_unknown_a_pending_effect_cannot_be_resolved() -> None:
    base = one_effect()
    bad = resolved(1)
    assert_corrupt(insert(base, 4, bad), bad, "resolution.only_unknown")


def test_resolution_only_unknown_a_finished_definite_effect_cannot_be_resolved() -> None:
    base = one_effect()
    bad = resolved(1)
    assert_corrupt(insert(base, 5, bad), bad, "resolution.only_unknown")


def test_resolution_only_unknown_an_undeclared_effect_cannot_be_resolved() -> None:
    bad = resolved(5)
    assert_corrupt([started(), bad], bad, "resolution.only_unknown")


def test_resolution_once_an_unknown_is_resolved_twice_while_its_batch_is_open() -> None:
    base = unknown_then_resolved()
    bad = resolved(1, 0, "failed")
    assert_corrupt(insert(base, 8, bad), bad, "resolution.once")


def test_resolution_once_an_unknown_is_resolved_again_after_its_batch_finished() -> None:
    events = [started(), step(1, effects=1), declared(1), dispatched(1), settled(1, status="unknown"), resolved(1)]
    bad = resolved(1, status="failed")
    assert_corrupt([*events, bad], bad, "resolution.once")


def test_resolution_process_finished_an_unknown_kept_as_evidence_cannot_be_resolved() -> None:
    bad = resolved(1)
    events = [*canceled_with_unknown(), bad]
    assert_corrupt(events, bad, "resolution.process_finished")


def test_dispatch_replay_policy_a_replay_resolution_needs_same_identity() -> None:
    base = unknown_then_resolved()
    bad = resolved(1, 0, by="replay")
    assert_corrupt(replace(base, 7, bad), bad, "dispatch.replay_policy")


# DESIGN rule: a signal id is admitted once


@pytest.mark.parametrize("payload", [{"text": "s1"}, {"text": "different"}], ids=["identical", "conflicting"])
def test_signal_dedup_a_signal_id_is_admitted_once(payload: Any) -> None:
    base = signals()
    bad = admitted("s1", payload)
    assert_corrupt(insert(base, 3, bad), bad, "signal.dedup")


def test_signal_dedup_holds_after_the_signal_was_consumed() -> None:
    events = [started(), admitted("s1"), step(1, consumed=1)]
    bad = admitted("s1")
    assert_corrupt([*events, bad], bad, "signal.dedup")


def test_signal_admission_engine_owned_ids_are_never_admitted_from_outside() -> None:
    bad = admitted("signal:engine:forged")
    assert_corrupt([started(), bad], bad, "signal.admission")


def test_signal_admission_an_answer_must_address_an_open_wait() -> None:
    base = waiting()
    bad = admitted("answer-2", {"name": "bob"}, wait=WAIT)  # already answered at position 5
    assert_corrupt(insert(base, 5, bad), bad, "signal.admission")
    bad = admitted("answer-0", {"name": "x"}, wait=wait_id_for(eid(9)))  # no such wait
    assert_corrupt(insert(base, 3, bad), bad, "signal.admission")


def test_signal_admission_unaddressed_input_is_refused_while_an_external_wait_is_current() -> None:
    base = waiting()
    bad = admitted("chatter")
    assert_corrupt(insert(base, 4, bad), bad, "signal.admission")


def test_signal_admission_a_terminal_process_admits_nothing() -> None:
    bad = admitted("late")
    assert_corrupt([*signals(), bad], bad, "signal.admission")


def test_signal_admission_the_program_signal_schema_is_enforced_when_programs_are_bound(recorded: Any) -> None:
    events, catalog = recorded["chain"]
    bad = admitted("host-input", pid=events[0].process_id)  # the chain program accepts no unaddressed input
    error = assert_corrupt([events[0], bad], bad, "signal.admission", catalog.resolve)
    assert "engine.signal.rejected" in error.detail


# DESIGN rule: terminal status never changes


@pytest.mark.parametrize(
    "bad",
    [
        terminated(),
        terminated("failed", "execution_failure", failure=BOOM),
        terminated("killed", "engine_kill"),
    ],
    ids=["same-status-again", "completed-becomes-failed", "completed-becomes-killed"],
)
def test_terminal_once_a_terminal_status_never_changes(bad: ProcessTerminated) -> None:
    assert_corrupt([*one_effect(), bad], bad, "terminal.once")


def test_terminal_once_holds_for_children_too() -> None:
    base = with_child()
    bad = terminated("canceled", "parent_cancellation", pid=CHILD)
    assert_corrupt(insert(base, 6, bad), bad, "terminal.once")


@pytest.mark.parametrize(
    ("bad", "rule"),
    [
        (step(3, "complete"), "step.process_terminal"),
        (control("cancel"), "control.process_terminal"),
        (control("pause"), "control.process_terminal"),
    ],
    ids=["step", "cancel", "pause"],
)
def test_a_terminal_process_takes_no_more_steps_or_controls(bad: TreeEvent, rule: str) -> None:
    assert_corrupt([*one_effect(), bad], bad, rule)


# DESIGN rule: budgets (steps, effects, signals) are never exceeded


def test_budget_steps_a_step_beyond_the_steps_budget() -> None:
    bad = step(3, "complete")
    events = [started(Budget.of(steps=2)), step(1), step(2), bad]
    assert_corrupt(events, bad, "budget.steps")


def test_budget_steps_zero_steps_forbid_any_computation() -> None:
    bad = step(1, "complete")
    assert_corrupt([started(Budget.of(steps=0)), bad], bad, "budget.steps")


def test_budget_effects_a_declaration_beyond_the_effects_budget() -> None:
    base = two_effects()
    events = replace(base, 0, started(Budget.of(effects=1)))
    assert_corrupt(events, events[3], "budget.effects")


def test_budget_effects_counts_effects_across_steps() -> None:
    events = [started(Budget.of(effects=1)), *one_effect()[1:6]]
    events[5] = step(2, effects=1, consumed=1)
    bad = declared(2)
    assert_corrupt([*events, bad], bad, "budget.effects")


def test_budget_signals_an_admitted_signal_beyond_the_signals_budget() -> None:
    base = signals()
    events = replace(base, 0, started(Budget.of(signals=1)))
    assert_corrupt(events, events[2], "budget.signals")


def test_budget_signals_a_declaration_cannot_reserve_its_settlement_signal() -> None:
    bad = declared(1)
    events = [started(Budget.of(signals=1)), admitted("s1"), step(1, consumed=1, effects=1), bad]
    assert_corrupt(events, bad, "budget.signals")


def test_budget_signals_a_child_wait_reserves_two_signals() -> None:
    spec = {
        "operation": "wait_children",
        "key": "kids",
        "children": [str(CHILD)],
        "boundary": "terminal_result",
        "condition": "all",
    }
    bad = declared(1, target="framework", payload=spec)
    assert_corrupt([started(Budget.of(signals=1)), step(1, effects=1), bad], bad, "budget.signals")


# DESIGN rule: child allocations are permanent


def test_budget_child_allocation_a_grant_larger_than_the_parent_budget() -> None:
    events = with_child(Budget.of(steps=3), Budget.of(steps=5))
    assert_corrupt(events, events[3], "budget.child_allocation")


def test_budget_child_allocation_a_grant_that_does_not_fit_what_is_left() -> None:
    # The parent used one step and needs one more to observe the start: 1 + 1 + 3 > 4.
    events = with_child(Budget.of(steps=4), Budget.of(steps=3))
    assert_corrupt(events, events[3], "budget.child_allocation")


def test_budget_child_allocation_an_unlimited_grant_from_a_finite_parent() -> None:
    events = with_child(Budget.of(effects=5), Budget())
    assert_corrupt(events, events[3], "budget.child_allocation")


def test_budget_child_allocation_is_permanent_after_the_child_ended() -> None:
    # 4 steps: the root's 2 steps + the child's grant of 2, never refunded when the child ends.
    events = with_child(Budget.of(steps=4), Budget.of(steps=2))
    events[6] = step(2, consumed=1)  # continue instead of complete
    fold_tree(events[:7])
    bad = step(3, "complete")
    assert_corrupt([*events[:7], bad], bad, "budget.steps")


def test_budget_child_allocation_counts_against_the_signals_budget_too() -> None:
    # Signals: the root's 1 reserved settlement + a grant of 3 > 3.
    events = with_child(Budget.of(signals=3), Budget.of(signals=3))
    assert_corrupt(events, events[3], "budget.child_allocation")


# ---------------------------------------------------------------------------
# Writers and incarnations


def test_writer_previous_incarnation_an_activation_must_name_the_current_writer() -> None:
    base = unknown_then_resolved()
    bad = activated(INC3, INC3)
    assert_corrupt(replace(base, 5, bad), bad, "writer.previous_incarnation")


def test_writer_previous_incarnation_a_stale_writer_cannot_activate_after_a_newer_one() -> None:
    base = unknown_then_resolved()
    bad = activated(INC3, INC1)  # INC2 took over at position 6
    assert_corrupt(insert(base, 6, bad), bad, "writer.previous_incarnation")


def test_writer_new_incarnation_an_incarnation_is_never_reused() -> None:
    base = unknown_then_resolved()
    bad = activated(INC1, INC2)
    assert_corrupt(insert(base, 6, bad), bad, "writer.new_incarnation")


def test_an_activation_after_every_process_ended_is_read_as_a_release_before_2026_12_05_wrote_it() -> None:
    # Such a release appended one when `recover` met an ended tree whose index row was behind
    # (tests/test_ending_subtree.py: this release appends none); the finished run stays readable.
    base = unknown_then_resolved()  # ends with the root's (the only Process's) ProcessTerminated
    tree = fold_tree([*base, activated(INC3, INC2)])
    assert tree.root.status == "completed" and tree.incarnation == INC3 and tree.classification() == "terminal"


def test_a_writer_may_activate_a_tree_whose_root_ended_while_a_child_still_runs() -> None:
    # The root's end gives its live child a cancel intent; the child's end is still to be
    # decided, by whoever owns the tree next.
    events = [*waiting_for_a_child()[:7], control("kill"), terminated("killed", "engine_kill"), activated(INC2, INC1)]
    tree = fold_tree(events)
    assert tree.root.terminal and tree.incarnation == INC2
    assert tree.classification() != "terminal"


def test_writer_root_an_activation_names_the_root() -> None:
    bad = activated(INC2, INC1, pid=CHILD)
    assert_corrupt([started(), bad], bad, "writer.root")


def test_settlement_attempt_a_stale_attempt_cannot_settle_definitely_after_reactivation() -> None:
    base = unknown_then_resolved()
    bad = settled(1, 0, att=1)  # the dead writer's attempt reports success after INC2 took over
    assert_corrupt(replace(base, 6, bad), bad, "settlement.attempt")


def test_settlement_attempt_a_replaced_attempt_cannot_settle_after_the_replay() -> None:
    base = replayed_after_activation()
    bad = settled(1, att=1)  # attempt 2 is the current one
    assert_corrupt(replace(base, 6, bad), bad, "settlement.attempt")


def test_settlement_attempt_must_name_the_dispatched_attempt() -> None:
    base = one_effect()
    bad = settled(1, att=7)
    assert_corrupt(replace(base, 4, bad), bad, "settlement.attempt")


def test_dispatch_incarnation_only_the_current_writer_dispatches() -> None:
    base = unknown_then_resolved()
    bad = dispatched(1, 1, att=2, inc=INC1)
    assert_corrupt(replace(base, 8, bad), bad, "dispatch.incarnation")


def test_dispatch_replay_policy_a_never_effect_is_not_dispatched_again() -> None:
    base = replayed_after_activation()
    events = [*base[:2], declared(1, replay="never"), *base[3:]]
    assert_corrupt(events, events[5], "dispatch.replay_policy")


def test_dispatch_once_one_writer_dispatches_an_effect_once() -> None:
    base = one_effect()
    bad = dispatched(1, att=2)
    assert_corrupt(insert(base, 4, bad), bad, "dispatch.once")


def test_dispatch_target_framework_effects_are_never_dispatched() -> None:
    bad = dispatched(1)  # the start-child effect, before its ProcessStarted
    assert_corrupt(insert(with_child(), 3, bad), bad, "dispatch.target")
    # A wait still planned behind the paused Process's frontier is no dispatcher effect either.
    bad = dispatched(1, 1, att=2)
    assert_corrupt(insert(wait_behind_a_pause(), 7, bad), bad, "dispatch.target")


@pytest.mark.parametrize("status", ["succeeded", "unknown"])
def test_dispatch_after_settlement_a_settled_effect_is_not_dispatched_again(status: str) -> None:
    base = two_effects()
    events = replace(base, 5, settled(1, 0, status, att=1))
    bad = dispatched(1, 0, att=3)
    assert_corrupt(insert(events, 6, bad), bad, "dispatch.after_settlement")


def test_dispatch_after_settlement_holds_after_the_batch_finished() -> None:
    base = one_effect()
    bad = dispatched(1, att=2)
    assert_corrupt(insert(base, 5, bad), bad, "dispatch.after_settlement")


@pytest.mark.parametrize("blocker", [control("pause", "hold"), control("cancel")], ids=["paused", "canceling"])
def test_dispatch_process_state_no_dispatch_while_paused_or_terminating(blocker: ControlRequested) -> None:
    base = one_effect()
    bad = dispatched(1)
    assert_corrupt([*base[:3], blocker, bad], bad, "dispatch.process_state")


def test_dispatch_process_state_a_new_owner_carries_on_a_paused_processs_call_but_not_a_terminating_ones() -> None:
    """A pause does not stop a call in flight: a new owner may dispatch it again (same_identity)
    while the Process is paused; under a terminal intent it may not (it settles unknown)."""
    calls = [started(), step(1, effects=1), declared(1, replay="same_identity"), dispatched(1)]
    again = dispatched(1, att=2, inc=INC2)
    tree = fold_tree([*calls, control("pause", "hold"), activated(INC2, INC1), again])
    [record] = tree.processes[ROOT].in_flight()
    assert tree.processes[ROOT].status == "paused" and record.phase == "pending" and record.attempts == 2
    bad = dispatched(1, att=2, inc=INC2)
    assert_corrupt([*calls, control("cancel"), activated(INC2, INC1), bad], bad, "dispatch.process_state")


# ---------------------------------------------------------------------------
# Stream shape


def test_stream_position_events_apply_at_consecutive_positions() -> None:
    events = one_effect()
    tree = TreeState()
    tree.apply(events[0], 1)
    tree.apply(events[1], 2)
    with pytest.raises(FoldError) as caught:
        tree.apply(events[2], 4)  # position 3 is missing
    assert (caught.value.rule, caught.value.position) == ("stream.position", 4)
    with pytest.raises(FoldError) as caught:
        tree.apply(events[2], 2)  # position 2 again
    assert (caught.value.rule, caught.value.position) == ("stream.position", 2)
    tree.apply(events[2], 3)
    assert tree.version == 3


def test_stream_first_event_a_stream_starts_with_tree_started() -> None:
    bad = step(1)
    with pytest.raises(FoldError) as caught:
        fold_tree([bad])
    assert (caught.value.rule, caught.value.position) == ("stream.first_event", 1)
    again = started()
    assert_corrupt([started(), again], again, "stream.first_event")


def test_stream_event_type_unknown_event_types_are_refused() -> None:
    class Forged(TreeEvent):
        pass

    bad = Forged(process_id=ROOT)
    assert_corrupt([started(), bad], bad, "stream.event_type")


def test_tree_identity_the_tree_id_is_derived_from_the_start_id() -> None:
    bad = started(tree_id=TreeID.for_start(StartID("another-start")))
    with pytest.raises(FoldError) as caught:
        fold_tree([bad])
    assert (caught.value.rule, caught.value.position) == ("tree.identity", 1)


def test_process_unknown_events_name_processes_of_the_tree() -> None:
    bad = admitted("s1", pid=CHILD)
    assert_corrupt([started(), bad], bad, "process.unknown")


# ---------------------------------------------------------------------------
# Steps


@pytest.mark.parametrize("number", [0, 1, 3, 1_000])
def test_step_sequence_steps_are_numbered_one_by_one(number: int) -> None:
    base = one_effect()
    bad = step(number, "complete", consumed=1)
    assert_corrupt(replace(base, 5, bad), bad, "step.sequence")


def test_step_sequence_a_terminal_step_is_followed_by_its_termination() -> None:
    base = one_effect()
    bad = admitted("between")
    assert_corrupt(insert(base, 6, bad), bad, "step.sequence")


def test_step_consumed_a_step_consumes_only_pending_signals() -> None:
    base = one_effect()
    bad = step(2, "complete", consumed=2)
    assert_corrupt(replace(base, 5, bad), bad, "step.consumed")


def test_step_effects_only_continue_declares_effects() -> None:
    bad = step(1, "complete", effects=1)
    assert_corrupt([started(), bad], bad, "step.effects")


def test_step_transition_a_pause_step_needs_a_reason() -> None:
    bad = step(1, "pause")
    assert_corrupt([started(), bad], bad, "step.transition")


def test_step_wait_a_wait_step_names_an_open_wait() -> None:
    base = waiting()
    bad = step(2, "wait", consumed=1, wait_id=wait_id_for(eid(9)))
    assert_corrupt(replace(base, 3, bad), bad, "step.wait")


def test_step_not_runnable_no_step_while_waiting_or_paused() -> None:
    base = waiting()
    bad = step(3, "complete")
    assert_corrupt(insert(base, 4, bad), bad, "step.not_runnable")
    paused = [started(), control("pause", "hold")]
    bad = step(1, "complete")
    assert_corrupt([*paused, bad], bad, "step.not_runnable")


def test_step_terminal_intent_no_step_after_a_cancel_was_requested() -> None:
    bad = step(1, "complete")
    assert_corrupt([started(), control("cancel"), bad], bad, "step.terminal_intent")


def test_step_batch_outstanding_no_step_while_effects_are_unsettled() -> None:
    base = one_effect()
    bad = step(2, "complete")
    assert_corrupt(insert(base, 4, bad), bad, "step.batch_outstanding")


def test_step_evolve_a_stream_whose_facts_the_strategy_cannot_evolve(recorded: Any) -> None:
    events, catalog = recorded["chain"]
    index = next(i for i, e in enumerate(events) if isinstance(e, StepCommitted))
    bad = events[index].model_copy(update={"facts": ["not", "an", "object"]})
    assert_corrupt(replace(events, index, bad), bad, "step.evolve", catalog.resolve)


def test_checkpoint_pairing_a_checkpoint_step_is_followed_by_its_checkpoint() -> None:
    base = checkpointed_and_controlled()
    events = base[:2] + base[3:]
    assert_corrupt(events, events[2], "checkpoint.pairing")
    bad = CheckpointCommitted(process_id=ROOT, step=4, kind="progress")
    assert_corrupt([started(), bad], bad, "checkpoint.pairing")


# ---------------------------------------------------------------------------
# Settlement shapes


def test_settlement_diagnostic_an_unknown_settlement_says_why() -> None:
    base = one_effect()
    bad = EffectSettled(process_id=ROOT, effect_id=eid(1), status="unknown", attempt_id=attempt(1))
    assert_corrupt(replace(base, 4, bad), bad, "settlement.diagnostic")


def test_settlement_framework_a_framework_effect_always_settles_definitely() -> None:
    bad = child_settled("unknown", payload={"key": "kid"})
    bad = bad.model_copy(update={"diagnostic": DIAGNOSTIC})
    assert_corrupt(replace(with_child(), 3, bad), bad, "settlement.framework")
    bad = settled(2, 0, status="unknown", att=None)  # the signal_child receipt
    assert_corrupt(replace(commanding(), 8, bad), bad, "settlement.framework")


def test_settlement_process_terminal_a_planned_effect_of_a_terminal_process_never_settles() -> None:
    events = [
        started(),
        step(1, effects=1),
        declared(1, target="framework", payload=child_payload()),
        control("cancel"),
        terminated("canceled", "host_cancellation"),
    ]
    bad = child_settled()
    assert_corrupt([*events, bad], bad, "settlement.process_terminal")


WAIT_SETTLEMENT = settled(1, 1, att=None, payload={"wait_id": PAUSED_WAIT})


@pytest.mark.parametrize(
    ("blocker", "bad"),
    [
        (control("pause", "hold"), WAIT_SETTLEMENT),
        (control("cancel"), WAIT_SETTLEMENT),
        (control("pause", "hold"), settled(1, 1, "failed", att=None, payload={"wait_id": PAUSED_WAIT})),
    ],
    ids=["paused", "canceling", "failed"],
)
def test_wait_settlement_a_wait_effect_is_never_settled_by_a_stored_event(
    blocker: ControlRequested, bad: EffectSettled
) -> None:
    """A wait at the frontier of a paused or terminating Process stays planned: nothing may settle it."""
    events = [
        started(),
        step(1, effects=2),
        declared(1, 0),
        declared(1, 1, target="framework", payload=wait_payload()),
        dispatched(1, 0),
        blocker,
        settled(1, 0),  # the wait is now the frontier, but the fold does not settle it
    ]
    assert_corrupt([*events, bad], bad, "wait.settlement")


def test_wait_settlement_a_child_wait_is_never_settled_by_a_stored_event() -> None:
    events = [*waiting_for_a_child()[:4], step(2, consumed=1, effects=2)]
    events += [declared(2, 0), declared(2, 1, target="framework", payload=kids_payload())]
    events += [dispatched(2, 0), control("pause", "hold"), settled(2, 0)]
    bad = settled(2, 1, att=None, payload={"wait_id": wait_id_for(eid(2, 1))})
    assert_corrupt([*events, bad], bad, "wait.settlement")


def test_settlement_once_a_wait_settled_on_declaration_is_not_settled_again() -> None:
    """The pre-compaction shape (an explicit settlement after the wait's declaration) is refused."""
    bad = settled(1, att=None, payload={"wait_id": WAIT})
    assert_corrupt(insert(waiting(), 3, bad), bad, "settlement.once")
    # In a batch still open behind the wait, the wait is already settled too.
    events = [started(), step(1, effects=2), declared(1, 0, target="framework", payload=wait_payload()), declared(1, 1)]
    assert_corrupt([*events, bad], bad, "settlement.once")


def test_effect_framework_unknown_framework_operations_are_refused() -> None:
    base = waiting()
    bad = declared(1, target="framework", payload={"operation": "teleport"})
    assert_corrupt(replace(base, 2, bad), bad, "effect.framework")


# ---------------------------------------------------------------------------
# Children


def test_child_start_effect_a_child_starts_only_from_its_frontier_start_effect() -> None:
    bad = child_started()
    assert_corrupt([started(), bad], bad, "child.start_effect")
    base = with_child()
    again = child_started()
    assert_corrupt(insert(base, 4, again), again, "child.start_effect")  # ProcessStarted settled it
    behind = [
        started(),
        step(1, effects=2),
        declared(1, 0),
        declared(1, 1, target="framework", payload=child_payload()),
    ]
    early = child_started(child_process_id(eid(1, 1)), eid(1, 1))  # #0 is still the frontier
    assert_corrupt([*behind, early], early, "child.start_effect")
    refused = failed_child_start()
    late = child_started()
    assert_corrupt(insert(refused, 4, late), late, "child.start_effect")  # a refused start starts no child
    not_a_start = child_started(child_process_id(eid(1, 1)), eid(1, 1))  # the frontier is a wait
    assert_corrupt(insert(wait_behind_a_pause(), 7, not_a_start), not_a_start, "child.start_effect")


def test_child_identity_the_child_id_is_derived_from_its_start_effect() -> None:
    base = with_child()
    bad = child_started(pid=ProcessID("process:forged"))
    assert_corrupt(replace(base, 3, bad), bad, "child.identity")


def test_child_key_a_parent_never_reuses_a_child_key() -> None:
    second = eid(1, 1)
    events = [
        started(),
        step(1, effects=2),
        declared(1, 0, target="framework", payload=child_payload()),
        declared(1, 1, target="framework", payload=child_payload()),  # the same key "kid"
        child_started(),
    ]
    bad = child_started(child_process_id(second), second)
    assert_corrupt([*events, bad], bad, "child.key")
    # Another key is fine.
    events[3] = declared(1, 1, target="framework", payload=child_payload(key="kid-2"))
    tree = fold_tree([*events, bad])
    assert tree.processes[child_process_id(second)].child_key == "kid-2"


@pytest.mark.parametrize(
    ("payload", "declared_ok"),
    [
        ({"operation": "start_child", "key": "kid", "input": {"n": 1}}, False),  # no program
        ({**child_payload(), "program": "test.fold.child"}, False),  # a name without its digest
        ({**child_payload(), "program": CHILD_REF.to_json()}, False),  # an object, not a text ref
        ({**child_payload(), "program": str(UNBOUND_REF)}, True),  # not bound in TreeStarted
        ({**child_payload(), "program": f"test.fold.other+{CHILD_REF.digest}"}, True),  # a bound digest, another name
        ({**child_payload(), "key": ""}, False),  # not a child key
        ({**child_payload(), "budget": {"steps": "many"}}, False),  # not a grant
    ],
    ids=["no-program", "name-only", "object", "unbound", "renamed", "empty-key", "bad-budget"],
)
def test_child_spec_a_start_effect_with_a_malformed_spec_starts_no_child(payload: dict[str, Any], declared_ok: bool) -> None:
    base = with_child()
    events = replace(base, 2, declared(1, target="framework", payload=payload))
    if declared_ok:
        # The kernel declares a start of a Program the tree does not bind (the parent then
        # observes a failed start), never a child started from it.
        assert_corrupt(events, events[3], "child.spec")
    else:
        # A spec the kernel's Step check refuses is never declared (settling it would fail
        # every recovery of the store).
        assert_corrupt(events, events[2], "effect.framework")


def test_child_capabilities_a_child_never_holds_more_than_its_parent() -> None:
    base = with_child()
    base[2] = declared(1, target="framework", payload=child_payload(capabilities=["net"]))
    assert_corrupt(base, base[3], "child.capabilities")
    base[0] = started(capabilities=["net"])
    tree = fold_tree(base)  # the parent holds it: valid
    assert tree.processes[CHILD].capabilities == ("net",)


def test_child_tree_limit_the_depth_limit_holds() -> None:
    events = replace(with_child(), 0, started(limits=TreeLimits(max_depth=0)))
    assert_corrupt(events, events[3], "child.tree_limit")


@pytest.mark.parametrize(
    "limits",
    [TreeLimits(max_children=0), TreeLimits(max_active_children=0), TreeLimits(max_tree_processes=1)],
    ids=["max_children", "max_active_children", "max_tree_processes"],
)
def test_child_tree_limit_every_limit_of_a_child_start_holds(limits: TreeLimits) -> None:
    # Found by a review of crafted histories: the fold checked the depth only, so a history
    # with more children than the kernel starts (engine.child.tree_limit) was imported.
    events = replace(with_child(), 0, started(limits=limits))
    error = assert_corrupt(events, events[3], "child.tree_limit")
    assert next(iter(limits.model_dump(exclude_defaults=True))) in str(error)
    fold_tree(replace(with_child(), 0, started(limits=TreeLimits(max_children=1, max_active_children=1,
                                                                  max_tree_processes=2))))  # room for one: valid


def test_child_parent_state_a_terminating_parent_starts_no_child() -> None:
    base = with_child()
    events = insert(base, 3, control("cancel"))
    assert_corrupt(events, events[4], "child.parent_state")


@pytest.mark.parametrize(
    "bad",
    [
        child_settled("succeeded", payload={"key": "kid", "program": str(CHILD_REF), "process_id": str(CHILD)}),
        child_settled("succeeded", payload={"key": "kid", "process_id": str(child_process_id(eid(9)))}),
        child_settled("failed", payload={"key": "kid", "program": str(CHILD_REF)}),
    ],
    ids=["success-as-settlement", "success-naming-another-child", "failed-without-failure"],
)
def test_child_start_settlement_only_a_failed_start_is_an_effect_settled(bad: EffectSettled) -> None:
    """A successful start is recorded by ProcessStarted alone; a failed one carries its failure."""
    assert_corrupt(replace(with_child(), 3, bad), bad, "child.start_settlement")


def test_child_start_settlement_a_started_child_is_not_also_settled() -> None:
    """After ProcessStarted the start is settled; the old shape's EffectSettled is a second settlement."""
    bad = child_settled("succeeded", payload={"key": "kid", "program": str(CHILD_REF), "process_id": str(CHILD)})
    assert_corrupt(insert(with_child(), 4, bad), bad, "settlement.once")
    failed = child_settled()
    assert_corrupt(insert(with_child(), 4, failed), failed, "settlement.once")


def test_child_control_settlement_a_receipt_names_the_child_of_its_effect() -> None:
    base = with_child()[:6]
    cancel_payload = {"operation": "cancel_child", "child": str(CHILD), "reason": "enough"}
    events = [*base, step(2, consumed=1, effects=1), declared(2, target="framework", payload=cancel_payload)]
    bad = settled(2, att=None, payload={"child": str(ROOT)})
    assert_corrupt([*events, bad], bad, "child.control_settlement")


@pytest.mark.parametrize(
    ("bad", "index"),
    [
        (admitted("forged", pid=CHILD, source="parent"), 4),  # no signal_child effect at all
        (admitted("hello", {"text": "changed"}, pid=CHILD, source="parent"), 7),  # not what the effect says
        (admitted("other", {"text": "hi"}, pid=CHILD, source="parent"), 7),  # another signal id
        (admitted("hello", {"text": "hi"}, source="parent"), 7),  # the root has no parent
    ],
    ids=["no-effect", "other-payload", "other-id", "root"],
)
def test_signal_source_parent_input_comes_only_from_the_parent_signal_child_effect(bad: TreeEvent, index: int) -> None:
    events = commanding()
    assert_corrupt(replace(events, index, bad) if index == 7 else insert(events, index, bad), bad, "signal.source")


@pytest.mark.parametrize(
    ("bad", "index"),
    [
        (control("cancel", "rogue", owner="parent", pid=CHILD), 4),  # no cancel_child effect
        (control("kill", "rogue", owner="parent", pid=CHILD), 9),  # a parent never kills
        (control("cancel", "rogue", owner="parent"), 9),  # the root has no parent
    ],
    ids=["no-effect", "kill", "root"],
)
def test_control_owner_parent_controls_come_only_from_the_parent_cancel_child_effect(
    bad: TreeEvent, index: int
) -> None:
    events = commanding()
    assert_corrupt(replace(events, index, bad) if index == 9 else insert(events, index, bad), bad, "control.owner")


def ending_with_a_call_in_flight(intent: str = "kill") -> list[TreeEvent]:
    """The root started a child, then a call; a host asks the root to end while the call is in flight."""
    return [
        *with_child()[:4],  # the child is running
        step(2, consumed=1, effects=1),  # 5: the root consumes the start and calls out
        declared(2),  # 6
        dispatched(2),  # 7
        control(intent),  # 8: the root cannot end yet
    ]


@pytest.mark.parametrize(
    ("intent", "kind"), [("kill", "cancel"), ("cancel", "cancel"), ("deadline", "deadline")]
)
def test_a_parent_that_has_to_end_records_its_end_on_its_live_children_at_once(intent: str, kind: str) -> None:
    # spec §2.6 "terminal intent stops the subtree": the child stops before the root's call settles.
    events = [*ending_with_a_call_in_flight(intent), control(kind, "parent ending", owner="parent", pid=CHILD)]
    tree = fold_tree(events)
    assert tree.processes[CHILD].terminal_intent == kind
    assert tree.processes[CHILD].intents[kind] == ("parent", "parent ending")
    status = "timed_out" if kind == "deadline" else "canceled"
    cause = "parent_deadline" if kind == "deadline" else "parent_cancellation"
    ended = fold_tree([*events, terminated(status, cause, pid=CHILD)])
    assert ended.processes[CHILD].status == status
    stepped = step(1, pid=CHILD)
    assert_corrupt([*events, stepped], stepped, "step.terminal_intent")


@pytest.mark.parametrize(("intent", "bad_kind"), [("kill", "deadline"), ("deadline", "cancel"), ("kill", "kill")])
def test_control_owner_a_child_records_only_the_end_its_ending_parent_gives_it(intent: str, bad_kind: str) -> None:
    bad = control(bad_kind, "parent ending", owner="parent", pid=CHILD)
    assert_corrupt([*ending_with_a_call_in_flight(intent), bad], bad, "control.owner")


def test_a_stream_stored_before_subtrees_stopped_at_once_still_folds() -> None:
    # Releases before 2026-12-01 let the child go on until the root itself ended: their
    # streams stay valid (the fold derives nothing early).
    events = [*ending_with_a_call_in_flight("kill"), step(1, pid=CHILD), settled(2), terminated("killed", "engine_kill")]
    tree = fold_tree(events)
    assert tree.processes[CHILD].committed_steps == 1
    assert tree.processes[CHILD].terminal_intent == "cancel"  # derived when the root ended


# ---------------------------------------------------------------------------
# Controls


def test_control_pause_state_a_paused_process_is_not_paused_again() -> None:
    bad = control("pause", "again")
    assert_corrupt([started(), control("pause", "hold"), bad], bad, "control.pause_state")


def test_control_reason_a_pause_needs_a_reason() -> None:
    bad = control("pause", "")
    assert_corrupt([started(), bad], bad, "control.reason")


def test_control_resume_state_only_a_paused_process_resumes() -> None:
    bad = control("resume", "")
    assert_corrupt([started(), bad], bad, "control.resume_state")


def test_control_duplicate_intent_a_terminal_intent_is_recorded_once() -> None:
    bad = control("kill", "twice")
    assert_corrupt([started(), control("kill"), bad], bad, "control.duplicate_intent")


# ---------------------------------------------------------------------------
# Termination


def test_terminal_in_flight_no_termination_while_an_effect_is_dispatched() -> None:
    bad = terminated("canceled", "host_cancellation")
    events = [*one_effect()[:4], control("cancel"), bad]
    assert_corrupt(events, bad, "terminal.in_flight")


def test_terminal_cause_the_status_follows_from_the_cause() -> None:
    base = one_effect()
    bad = terminated("killed", "completion")
    assert_corrupt(replace(base, 6, bad), bad, "terminal.cause")


@pytest.mark.parametrize(
    ("prefix", "bad"),
    [
        ([started()], terminated()),  # completion without a complete step
        ([started(), control("kill")], terminated("canceled", "host_cancellation")),  # kill outranks cancel
        ([started(), control("cancel"), control("kill")], terminated("canceled", "host_cancellation")),
        ([started(), control("cancel")], terminated()),  # an intent outranks completion
        ([started(), step(1, "complete")], terminated("failed", "execution_failure", failure=BOOM)),
        ([started()], terminated("canceled", "host_cancellation")),  # no cancel was requested
    ],
    ids=[
        "completion-without-step",
        "kill-over-cancel",
        "kill-after-cancel",
        "cancel-over-completion",
        "complete-step-ends-failed",
        "cancellation-without-intent",
    ],
)
def test_terminal_priority_the_first_terminal_outcome_follows_the_priority(
    prefix: list[TreeEvent], bad: ProcessTerminated
) -> None:
    assert_corrupt([*prefix, bad], bad, "terminal.priority")


@pytest.mark.parametrize(
    "failure",
    [None, Failure(FailureKind.CONTRACT, "test.fold.contract", "wrong kind")],
    ids=["missing", "wrong-kind"],
)
def test_terminal_failure_a_failure_cause_carries_a_failure_of_its_kind(failure: Failure | None) -> None:
    bad = terminated("failed", "execution_failure", failure=failure)
    assert_corrupt([started(), step(1, "fail"), bad], bad, "terminal.failure")


def test_terminal_output_only_a_completed_process_has_an_output() -> None:
    bad = terminated("killed", "engine_kill", output={"partial": True})
    assert_corrupt([started(), control("kill"), bad], bad, "terminal.output")


def test_terminal_unresolved_a_termination_lists_exactly_its_unknown_effects() -> None:
    base = canceled_with_unknown()
    bad = terminated("canceled", "host_cancellation")
    assert_corrupt(replace(base, 6, bad), bad, "terminal.unresolved")


def test_terminal_output_schema_a_completed_output_satisfies_the_output_schema() -> None:
    from agentfold.domain.program import Descriptor
    from tests.kernel_programs import IMPL, Chain, config_digest

    program = Program(
        Descriptor("test.schema", output_schema={"type": "object", "required": ["total"]}),
        Chain(),
        IMPL,
        config_digest("schema"),
    )
    catalog = Catalog([program])
    store = EventStore("memory:")
    with Runtime(store, catalog) as runtime:
        handle = runtime.start(program, {"n": 0})
        assert handle.result(timeout=30).status == "completed"
        events = [r.event for r in store.read(handle.tree_id)]
    last = events[-1]
    assert isinstance(last, ProcessTerminated)
    bad = last.model_copy(update={"output": {"effects": 0}})
    assert_corrupt(replace(events, len(events) - 1, bad), bad, "terminal.output_schema", catalog.resolve)


# ---------------------------------------------------------------------------
# Programs bound to the fold


def test_program_unavailable_a_bound_fold_needs_every_program(recorded: Any) -> None:
    events, _ = recorded["chain"]
    with pytest.raises(FoldError) as caught:
        fold_tree(events, lambda ref: None)
    assert (caught.value.rule, caught.value.position) == ("program.unavailable", 1)


def test_program_initial_a_stream_whose_program_refuses_its_input(recorded: Any) -> None:
    events, catalog = recorded["chain"]
    bad = events[0].model_copy(update={"input": {"n": "many"}})  # the schema takes it, initial() does not
    with pytest.raises(FoldError) as caught:
        fold_tree(replace(events, 0, bad), catalog.resolve)
    assert (caught.value.rule, caught.value.position) == ("program.initial", 1)


def test_program_input_a_stream_whose_input_breaks_its_programs_schema(recorded: Any) -> None:
    # Found by a review of crafted histories: a start input the kernel refuses
    # (engine.start.input_invalid) was imported, verified and recovered, and acted on.
    events, catalog = recorded["chain"]
    bad = events[0].model_copy(update={"input": {"m": 1}})  # the schema requires n
    with pytest.raises(FoldError) as caught:
        fold_tree(replace(events, 0, bad), catalog.resolve)
    assert (caught.value.rule, caught.value.position) == ("program.input", 1)
    fold_tree(replace(events, 0, bad))  # without the Programs the kernel's view cannot tell


# ---------------------------------------------------------------------------
# Corruptions of streams a real Runtime recorded


def _first(events: Sequence[TreeEvent], kind: type, after: int = 0) -> int:
    return next(i for i, e in enumerate(events) if isinstance(e, kind) and i >= after)


@pytest.mark.parametrize(
    ("corruption", "rule"),
    [
        ("drop-dispatch", "settlement.after_dispatch"),
        ("settle-twice", "settlement.once"),
        ("swap-settlement-status", "settlement.once"),
        ("wrong-effect-id", "effect.identity"),
        ("terminate-twice", "terminal.once"),
        ("duplicate-answer", "signal.dedup"),
        ("stale-incarnation", "dispatch.incarnation"),
        ("forged-parent-signal", "signal.source"),
        ("forged-parent-cancel", "control.owner"),
    ],
)
def test_recorded_streams_corrupted_in_one_place_name_the_broken_rule(
    recorded: Any, corruption: str, rule: str
) -> None:
    chain, chain_catalog = recorded["chain"]
    parent, parent_catalog = recorded["parent"]
    events, catalog = list(chain), chain_catalog
    if corruption == "drop-dispatch":
        i = _first(events, EffectDispatched)
        del events[i]
        bad = events[i]
    elif corruption in ("settle-twice", "swap-settlement-status"):
        i = _first(events, EffectSettled)
        original = events[i]
        bad = original.model_copy(update={"status": "failed"} if corruption.startswith("swap") else {})
        events.insert(i + 1, bad)
    elif corruption == "wrong-effect-id":
        i = _first(events, EffectDeclared)
        bad = events[i].model_copy(update={"effect_id": effect_id(events[i].process_id, 99, 0)})
        events[i] = bad
    elif corruption == "terminate-twice":
        bad = events[-1].model_copy(update={"status": "killed", "cause": "engine_kill", "output": None})
        events.append(bad)
    elif corruption == "duplicate-answer":
        events, catalog = list(parent), parent_catalog
        i = _first(events, SignalAdmitted)
        bad = events[i].model_copy(update={"payload": {"name": "someone else"}})
        events.insert(i + 1, bad)
    elif corruption == "forged-parent-signal":
        events, catalog = list(recorded["commander"][0]), recorded["commander"][1]
        i = _first(events, SignalAdmitted)
        bad = events[i].model_copy(update={"signal_id": SignalID("forged")})
        events.insert(i, bad)  # parent input that the parent's signal_child effect never carried
    elif corruption == "forged-parent-cancel":
        events, catalog = list(recorded["commander"][0]), recorded["commander"][1]
        bad = events[_first(events, ControlRequested)].model_copy()
        events.insert(_first(events, ProcessStarted) + 1, bad)  # before the parent declared its cancel_child
    else:  # a dispatch signed by an incarnation that never activated
        i = _first(events, EffectDispatched)
        bad = events[i].model_copy(update={"incarnation_id": INC3})
        events[i] = bad
    assert_corrupt(events, bad, rule)
    assert_corrupt(events, bad, rule, catalog.resolve)


def test_event_store_load_reports_the_fold_rule_of_a_corrupt_stream() -> None:
    """A corrupt stream written past the runtime is refused on load with its position and rule."""
    from agentfold.adapters.eventstore import CorruptStream

    store = EventStore("memory:")
    events = one_effect()
    events.insert(5, settled(1))  # a second settlement at position 6
    store.append(TREE, 0, events, previous_digest=None, timestamp="2024-01-01T00:00:00.000000Z")
    with pytest.raises(CorruptStream) as caught:
        store.load(TREE)
    assert (caught.value.position, caught.value.rule) == (6, "settlement.once")


@pytest.mark.parametrize(
    "payload",
    [
        {"operation": "signal_child", "child": str(CHILD)},  # no signal
        {"operation": "signal_child", "child": str(CHILD), "signal": "hello"},  # a signal that is no object
        {"operation": "cancel_child", "reason": "stop"},  # no child
        {"operation": "cancel_child", "child": 5, "reason": "stop"},  # not a process id
        {"operation": "cancel_child", "child": str(CHILD)},  # no reason
    ],
    ids=["signal-missing", "signal-text", "cancel-no-child", "cancel-child-number", "cancel-no-reason"],
)
def test_effect_framework_a_child_control_the_kernel_could_not_settle_is_refused(payload: dict[str, Any]) -> None:
    # Found by a review of crafted histories: such a declaration was imported and verified, then
    # every `recover` of the store failed with a bare KeyError (the other runs not recovered).
    base = waiting()
    bad = declared(1, target="framework", payload=payload)
    assert_corrupt(replace(base, 2, bad), bad, "effect.framework")


def test_effect_framework_a_framework_effect_is_declared_never_requiring_nothing() -> None:
    base = waiting()
    good = base[2]
    assert good.target == "framework" and good.replay == "never"
    for bad in (good.model_copy(update={"replay": "same_identity"}), good.model_copy(update={"capabilities": ("net",)})):
        assert_corrupt(replace(base, 2, bad), bad, "effect.framework")


def test_effect_capabilities_a_dispatcher_effect_requires_only_what_its_process_holds() -> None:
    # Found by a review of crafted histories: a charge declared requiring a capability the
    # Process did not hold was imported, verified and recovered, and the call was made.
    requiring = declared(1).model_copy(update={"capabilities": ("payments.admin",)})
    events = [started(), step(1, effects=1), requiring]
    assert_corrupt(events, requiring, "effect.capabilities")
    fold_tree([started(capabilities=["payments.admin"]), step(1, effects=1), requiring])  # the Process holds it: valid


def test_child_program_a_child_runs_a_program_its_parents_program_binds(recorded: Any) -> None:
    # Found by a review of crafted histories: the fold checked a child's Program against the
    # tree's bound refs only; the kernel starts only a Program the parent's binds
    # (engine.child.deployment_unavailable otherwise).
    events, catalog = recorded["parent"]
    root = events[0]
    assert isinstance(root, TreeStarted)
    real = catalog.resolve(root.program)

    class Unbinding:  # the parent's Program as one that binds no child
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def child(self, ref: ProgramRef) -> Any:
            return real if ref == real.ref else None

    def resolve(ref: ProgramRef) -> Any:
        return Unbinding() if ref == root.program else catalog.resolve(ref)

    first_child = _first(events, ProcessStarted)
    with pytest.raises(FoldError) as caught:
        fold_tree(events, resolve)
    assert (caught.value.rule, caught.value.position) == ("child.program", first_child + 1)
    fold_tree(events, catalog.resolve)  # bound as recorded: valid


def test_effect_framework_two_waits_of_one_step_never_share_a_key() -> None:
    # Found by a review of crafted histories: the kernel refuses such a Step
    # (execution.effect.invalid); the fold took it, opening one wait for two Effects.
    second = declared(1, 1, target="framework", payload=wait_payload())
    events = [started(), step(1, effects=2), declared(1, 0, target="framework", payload=wait_payload()), second]
    assert_corrupt(events, second, "effect.framework")
    fold_tree([*events[:3], declared(1, 1, target="framework", payload=wait_payload("other"))])  # two keys: valid


def test_effect_framework_a_step_consuming_a_waits_answer_does_not_open_its_key_again() -> None:
    # The kernel checks a Step's Effects before its consumption closes the wait (scope-kernel.md
    # 2.5 step 6, 5.3: a wait closes when the cursor passes its answer), so it refuses this Step
    # (execution.effect.invalid); the fold took it until 2026-12-05.
    answered = waiting()[:5]
    bad = declared(3, target="framework", payload=wait_payload())
    assert_corrupt([*answered, step(3, consumed=1, effects=1), bad], bad, "effect.framework")
    # The key is free from the next Step on, and another key in the same Step is valid.
    fold_tree([*answered, step(3, consumed=1), step(4, effects=1), declared(4, target="framework", payload=wait_payload())])
    fold_tree([*answered, step(3, consumed=1, effects=1), declared(3, target="framework", payload=wait_payload("next"))])


# ---------------------------------------------------------------------------
# Histories the kernel never writes (second review of crafted histories): each refused with
# its rule, the same way from a storage snapshot of the valid prefix (which holds the folded
# state every rule reads), while what the kernel, or a release whose stores this one reads,
# writes still folds.


def assert_corrupt_from_snapshot(events: Sequence[TreeEvent], bad: TreeEvent, rule: str) -> None:
    """``assert_corrupt``, and the same refusal when the prefix is loaded from a snapshot."""
    assert_corrupt(events, bad, rule)
    index = next(i for i, e in enumerate(events) if e is bad)
    prefix = fold_tree(events[:index])
    for loaded in (prefix, TreeState.from_json(prefix.to_json(compact=True))):
        with pytest.raises(FoldError) as caught:
            loaded.apply(bad)
        assert (caught.value.rule, caught.value.position) == (rule, index + 1), str(caught.value)


def test_child_parent_state_a_paused_parent_starts_no_child() -> None:
    # The kernel carries out a start only for a running parent: a paused one's waits for its resume.
    base = with_child()
    events = insert(base, 3, control("pause", "hold"))
    assert_corrupt_from_snapshot(events, events[4], "child.parent_state")
    resumed = fold_tree([*base[:3], control("pause", "hold"), control("resume", ""), *base[3:]])
    assert resumed.processes[CHILD].terminal  # started after the resume: valid


CANCEL_KID = {"operation": "cancel_child", "child": str(CHILD), "reason": "enough"}


@pytest.mark.parametrize(
    ("blocker", "bad", "index"),
    [
        (control("pause", "hold"), child_settled(), 3),  # a failed start of a paused parent
        (control("cancel"), child_settled(), 3),  # a failed start of a terminating parent
        (control("pause", "hold"), settled(2, 1, att=None, payload={"child": str(CHILD)}), 10),
        (control("kill"), settled(2, 1, att=None, payload={"child": str(CHILD)}), 10),
        (control("pause", "hold"), settled(2, 0, "failed", att=None, payload={
            "child": str(CHILD), "signal_id": "hello", "failure": BOOM.to_json()}), 7),  # a refused signal
    ],
    ids=["start-paused", "start-terminating", "cancel-receipt-paused", "cancel-receipt-killed", "signal-receipt-paused"],
)
def test_settlement_process_state_a_framework_effect_settles_only_for_a_running_process(
    blocker: ControlRequested, bad: EffectSettled, index: int
) -> None:
    # The kernel carries out a framework Effect only for a running Process without a terminal
    # intent (a killed one ends at once, its planned Effects never settle).
    base = failed_child_start() if index == 3 else commanding()
    events = [*base[:index], blocker, bad]
    assert_corrupt_from_snapshot(events, bad, "settlement.process_state")


@pytest.mark.parametrize(
    ("blocker", "bad", "rule"),
    [
        (control("pause", "hold"), admitted("hello", {"text": "hi"}, pid=CHILD, source="parent"), "signal.source"),
        (control("kill"), admitted("hello", {"text": "hi"}, pid=CHILD, source="parent"), "signal.source"),
        (control("pause", "hold"), control("cancel", "enough", owner="parent", pid=CHILD), "control.owner"),
    ],
    ids=["signal-paused", "signal-killed", "cancel-paused"],
)
def test_parent_input_comes_only_from_a_running_parents_frontier_effect(
    blocker: ControlRequested, bad: TreeEvent, rule: str
) -> None:
    events = commanding()
    at = 7 if rule == "signal.source" else 9
    forged = [*events[:at], blocker, bad] if rule == "signal.source" else [*events[:8], settled(
        2, 0, att=None, payload={"child": str(CHILD), "signal_id": "hello"}), blocker, bad]
    assert_corrupt_from_snapshot(forged, bad, rule)


@pytest.mark.parametrize(
    ("prefix", "unresolved"),
    [
        ([started(), step(1, effects=1), declared(1)], ()),  # a planned batch
        ([*one_effect()[:4], settled(1, status="unknown")], (eid(1),)),  # an unknown frontier
        ([started(), control("pause", "hold")], ()),
        (waiting()[:4], ()),
    ],
    ids=["planned-batch", "unknown-frontier", "paused", "waiting"],
)
def test_terminal_failure_state_a_failure_without_intent_ends_only_a_process_that_could_step(
    prefix: list[TreeEvent], unresolved: tuple[EffectID, ...]
) -> None:
    # A failure without an intent is a Step's (refused, or a fail Step): the kernel runs a Step
    # only for a running Process with no batch outstanding; in these states it writes nothing
    # (parked) or settles, dispatches, starts.
    bad = terminated("failed", "execution_failure", failure=BOOM, unresolved=unresolved)
    assert_corrupt_from_snapshot([*prefix, bad], bad, "terminal.failure_state")
    fold_tree([started(), terminated("failed", "execution_failure", failure=BOOM)])  # a refused first Step


@pytest.mark.parametrize("kind", ["cancel", "kill", "deadline", "pause"])
@pytest.mark.parametrize("reason", ["", " \t\n"])
def test_control_reason_every_control_but_resume_has_a_reason(kind: str, reason: str) -> None:
    # The kernel checks every reason it records (check_reason: non-empty once trimmed).
    bad = control(kind, reason)
    assert_corrupt_from_snapshot([started(), bad], bad, "control.reason")
    fold_tree([started(), control("pause", "hold"), control("resume", "")])  # a resume needs none


def test_step_transition_a_pause_steps_reason_is_not_blank() -> None:
    bad = step(1, "pause", reason="   ")
    assert_corrupt_from_snapshot([started(), bad], bad, "step.transition")


@pytest.mark.parametrize("reason", ["", "  "])
def test_effect_framework_a_cancel_child_reason_is_not_blank(reason: str) -> None:
    # Refused where it is declared: settling it would record a cancel without a reason.
    bad = declared(2, target="framework", payload={**CANCEL_KID, "reason": reason})
    events = [*with_child()[:4], step(2, consumed=1, effects=1), bad]
    assert_corrupt(events, bad, "effect.framework")


@pytest.mark.parametrize("kind", ["", "Round.Complete", "9th", "round complete", "é"])
def test_checkpoint_kind_a_checkpoint_kind_is_a_qualified_name(kind: str) -> None:
    bad = CheckpointCommitted(process_id=ROOT, step=1, kind=kind)
    assert_corrupt([started(), step(1, "checkpoint"), bad], bad, "checkpoint.kind")


@pytest.mark.parametrize("att", [2, None], ids=["another-attempt", "no-attempt"])
def test_settlement_attempt_an_unknown_names_the_attempt_in_flight(att: int | None) -> None:
    bad = settled(1, status="unknown", att=att)
    assert_corrupt_from_snapshot([*one_effect()[:4], bad], bad, "settlement.attempt")
    # Recovery's unknown names the previous writer's attempt: valid.
    fold_tree([*one_effect()[:4], activated(INC2, INC1), settled(1, status="unknown", att=1)])


def test_histories_earlier_releases_wrote_still_fold() -> None:
    # Releases before 2026-12-01 let a child go on (step, call out, have an unknown resolved by a
    # host: before 2026-12-03) while its parent had a terminal intent; releases before 2026-12-03
    # let a Step reserve settlements past max_pending_signals. This release reads their stores.
    child_calls = [
        *ending_with_a_call_in_flight("kill"),
        step(1, effects=1, pid=CHILD),
        declared(1, pid=CHILD),
        dispatched(1, pid=CHILD),
        settled(1, status="unknown", pid=CHILD),
        resolved(1, pid=CHILD),
        settled(2),
        terminated("killed", "engine_kill"),
    ]
    assert fold_tree(child_calls).processes[CHILD].terminal_intent == "cancel"
    bound = TreeLimits(max_pending_signals=1)
    overreserved = fold_tree([started(limits=bound), step(1, effects=2), declared(1, 0), declared(1, 1)])
    assert overreserved.root.reserved_signals == 2

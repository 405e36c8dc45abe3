"""Kernel behaviour a mutation audit of the step and fold rules (2026-12-05, "kernel") found
undefended: each test failed with its mutant planted and passes without it.

- a parent that times out with no call of its own in flight gives its live children a
  deadline (they end ``timed_out``, cause ``parent_deadline``), not a cancellation;
- a ``subtree_drained`` child wait is satisfied when the child's whole subtree has ended,
  not when the child alone has (that is ``terminal_result``);
- unaddressed input queues while a Process waits on its children: it does not wake it;
- the ids the kernel derives are the formula of scope-kernel.md §1.3 (stored histories of
  every release name them: a change makes every existing store unreadable);
- a child's grant must leave its parent the Step that observes the start (the kernel
  reserves it as the fold does: a grant that does not fails the start, not the owner);
- a new owner never dispatches again a ``same_identity`` call of a Process that has to end:
  it is recorded unknown, without a call.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import RandomIds, Runtime
from agentfold.domain.budget import Budget
from agentfold.domain.events import (
    ControlRequested,
    EffectDeclared,
    EffectSettled,
    ProcessStarted,
    StepCommitted,
    WriterActivated,
)
from agentfold.domain.ids import (
    ChildKey,
    SignalID,
    WaitKey,
    child_wait_satisfied_signal_id,
    settlement_signal_id,
    wait_opened_signal_id,
)
from agentfold.domain.kernel import Kernel
from agentfold.domain.program import (
    ChildSpec,
    ChildWaitSpec,
    Complete,
    Continue,
    Descriptor,
    Pause,
    Program,
    Replay,
    Signal,
    SignalRequest,
    Step,
    Wait,
    start_child_effect,
    wait_children_effect,
    wait_effect,
)
from agentfold.domain.requests import EffectRequest, Settlement
from agentfold.domain.tree import TreeState, fold_tree
from tests.kernel_programs import (
    IMPL,
    CallLog,
    GatedCall,
    JsonStrategy,
    asker_program,
    chain_program,
    config_digest,
    parent_program,
)

WAIT = 30.0


def _store(tmp_path: Path, name: str) -> EventStore:
    return EventStore(f"sqlite:///{tmp_path / name}")


def _wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _children(tree: TreeState, parent: Any) -> list[Any]:
    return [tree.processes[cid] for cid in parent.children]


# ---------------------------------------------------------------------------
# A parent's end reaches its children with the intent of its cause


@pytest.mark.parametrize(("control", "status", "cause"), [
    ("deadline", "timed_out", "parent_deadline"),
    ("cancel", "canceled", "parent_cancellation"),
])
def test_a_parent_ended_while_waiting_on_its_children_gives_them_the_end_of_its_cause(
    tmp_path: Path, control: str, status: str, cause: str,
) -> None:
    # The parent waits on its children with no call in flight, so it ends at once and the fold
    # gives its live children their intent (spec §2.6: a deadline for a deadline).
    child = asker_program("mk.prop.asker")
    parent = parent_program(child, count=2, name="mk.prop.parent")
    with Runtime(_store(tmp_path, "prop.db"), Catalog([parent])) as runtime:
        handle = runtime.start(parent, None, start_id=f"prop-{control}")
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert tree.root.status == "waiting"
        assert [c.status for c in _children(tree, tree.root)] == ["waiting", "waiting"]

        getattr(runtime, control)(handle.root_process_id)
        assert runtime.result(handle.tree_id, timeout=WAIT).status == status
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        ends = [(c.status, c.termination.cause) for c in _children(tree, tree.root) if c.termination]
        assert ends == [(status, cause), (status, cause)]


# ---------------------------------------------------------------------------
# subtree_drained waits for the child's whole subtree


class StartsThenCompletes(JsonStrategy):
    """Starts one grandchild (a one-call chain), waits for the host's go, and completes
    without waiting for the grandchild."""

    def __init__(self, grandchild: Program) -> None:
        self.grandchild = grandchild

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            spec = ChildSpec(ChildKey("grandchild"), self.grandchild.ref, {"n": 1})
            return Step(0, Continue((start_child_effect(spec), wait_effect(WaitKey("go")))), {"phase": "opening"})
        if phase == "opening":
            (opened,) = [s for s in window if s.wait_id is not None]
            return Step(len(window), Wait(opened.wait_id), {"phase": "waiting"})
        return Step(len(window), Complete({"left_running": True}), {"phase": "done"})


@pytest.mark.parametrize("boundary", ["subtree_drained", "terminal_result"])
def test_a_subtree_drained_wait_is_satisfied_only_once_the_childs_whole_subtree_ended(
    tmp_path: Path, boundary: str,
) -> None:
    log = CallLog(tmp_path / "calls.jsonl")
    gated = GatedCall(log, at=0)
    grandchild = chain_program(gated, name="mk.drain.grandchild")
    child = Program(Descriptor("mk.drain.child"), StartsThenCompletes(grandchild), IMPL,
                    config_digest("mk.drain.child"), children=(grandchild,))
    root = parent_program(child, count=1, name=f"mk.drain.root.{boundary}", boundary=boundary)
    with Runtime(_store(tmp_path, "drain.db"), Catalog([root]), cancel_grace=WAIT) as runtime:
        handle = runtime.start(root, None, start_id=f"drain-{boundary}")
        try:
            assert gated.entered.wait(WAIT), "the grandchild's call never started"
            tree = runtime.capture(handle.tree_id)
            (middle,) = _children(tree, tree.root)
            go = SignalRequest(SignalID("go"), {"go": True}, middle.current_wait)
            assert runtime.deliver_signals(middle.process_id, [go])

            def child_ended() -> bool:
                tree = runtime.capture(handle.tree_id)
                return any(c.terminal for c in _children(tree, tree.root))

            _wait_until(child_ended, "the child to complete")
            tree = runtime.capture(handle.tree_id)
            (middle,) = _children(tree, tree.root)
            (low,) = _children(tree, middle)
            assert middle.status == "completed"
            assert not low.terminal, "the grandchild's call is held: it cannot have ended"
            if boundary == "terminal_result":
                # The child's own end is enough: the root completes with the call still held.
                assert runtime.result(handle.tree_id, timeout=WAIT).status == "completed"
                return
            time.sleep(0.3)  # time for a wrongly satisfied wait to show
            tree = runtime.capture(handle.tree_id)
            assert tree.root.status == "waiting", "the wait was satisfied before the grandchild ended"
        finally:
            gated.release.set()
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert result.status == "completed"
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        (middle,) = _children(tree, tree.root)
        (low,) = _children(tree, middle)
        assert low.status == "canceled"  # its parent's end reached it; it ended once its call settled
        assert result.output == {"outcomes": [{"status": "completed", "output": {"left_running": True}}]}


# ---------------------------------------------------------------------------
# Unaddressed input queues while a child wait is current


class WaitsOnAskers(JsonStrategy):
    """Starts two asker children, waits on both, completes with the unaddressed input it got."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            effects = tuple(start_child_effect(ChildSpec(ChildKey(f"asker-{i}"), self.child.ref)) for i in range(2))
            return Step(0, Continue(effects), {"phase": "starting"})
        if phase == "starting":
            started = tuple(s.payload["process_id"] for s in window)
            spec = ChildWaitSpec(WaitKey("askers"), started)
            return Step(len(window), Continue((wait_children_effect(spec),)), {"phase": "opening"})
        if phase == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting", "wait_id": window[0].wait_id})  # type: ignore[arg-type]
        satisfied = [s for s in window if s.wait_id == state["wait_id"]]
        if not satisfied:
            return Step(0, Pause("woken without its children's outcomes"), {})
        notes = [s.payload for s in window if s.wait_id is None]
        return Step(len(window), Complete({"notes": notes, "outcomes": len(satisfied[0].payload["outcomes"])}))


def test_unaddressed_input_queues_while_a_process_waits_on_its_children_and_does_not_wake_it(
    tmp_path: Path,
) -> None:
    asker = asker_program("mk.queue.asker")
    parent = Program(Descriptor("mk.queue.parent", signal_schema={"type": "object"}), WaitsOnAskers(asker), IMPL,
                     config_digest("mk.queue.parent"), children=(asker,))
    with Runtime(_store(tmp_path, "queue.db"), Catalog([parent])) as runtime:
        handle = runtime.start(parent, None, start_id="queue")
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert tree.root.status == "waiting"
        steps = tree.root.committed_steps

        # A current child wait lets unaddressed input queue (scope-kernel.md §5.2 rule 6).
        assert runtime.deliver_signals(handle.root_process_id, [SignalRequest(SignalID("note-1"), {"note": 1})])
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert tree.root.status == "waiting"
        assert tree.root.committed_steps == steps, "the unaddressed input woke the waiting process"
        assert [r.signal_id for r in tree.root.pending()] == ["note-1"]

        for i, asker_process in enumerate(_children(tree, tree.root)):
            answer = SignalRequest(SignalID(f"name-{i}"), {"name": f"n{i}"}, asker_process.current_wait)
            assert runtime.deliver_signals(asker_process.process_id, [answer])
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert (result.status, result.output) == ("completed", {"notes": [{"note": 1}], "outcomes": 2})


# ---------------------------------------------------------------------------
# Derived identities: the formula of scope-kernel.md §1.3


def _spec_derive(prefix: str, tag: str, *parts: str | int) -> str:
    """``prefix`` + hex SHA-256 of the tag and parts joined with NUL (decimal numbers in ASCII)."""
    return prefix + hashlib.sha256("\x00".join([tag, *map(str, parts)]).encode("ascii")).hexdigest()


def test_every_id_the_kernel_derives_and_stores_is_the_specified_formula(tmp_path: Path) -> None:
    asker = asker_program("mk.ids.asker")
    parent = parent_program(asker, count=1, name="mk.ids.parent")
    store = _store(tmp_path, "ids.db")
    with Runtime(store, Catalog([parent])) as runtime:
        handle = runtime.start(parent, None, start_id="ids")
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        stored = [record.event for record in store.read(handle.tree_id)]

    declared = [e for e in stored if isinstance(e, EffectDeclared)]
    assert declared, "the run declared no effect"
    for effect in declared:  # EffectID = effect: + H("effect", processID, step, index)
        assert effect.effect_id == _spec_derive("effect:", "effect", effect.process_id, effect.step, effect.index)
    root = handle.root_process_id
    start_effect = _spec_derive("effect:", "effect", root, 1, 0)
    (started,) = [e for e in stored if isinstance(e, ProcessStarted)]
    assert started.start_effect_id == start_effect
    assert started.process_id == _spec_derive("process:", "child", start_effect)  # child ProcessID

    waits = {e.process_id: e.wait_id for e in stored if isinstance(e, StepCommitted) and e.kind == "wait"}
    by_effect = {(e.process_id, e.step): e.effect_id for e in declared}
    # The root's wait_children is its step 2's only effect; the asker's wait its step 1's.
    assert waits[root] == _spec_derive("wait:", "wait", by_effect[(root, 2)])
    assert waits[started.process_id] == _spec_derive("wait:", "wait", by_effect[(started.process_id, 1)])
    assert tree.processes[started.process_id].current_wait == waits[started.process_id]

    # The engine's signal ids (a Program sees them in its window).
    some_wait = waits[root]
    assert settlement_signal_id(start_effect) == _spec_derive("signal:engine:", "signal", start_effect)
    assert wait_opened_signal_id(some_wait) == _spec_derive("signal:engine:", "wait-opened", some_wait)
    assert child_wait_satisfied_signal_id(some_wait) == _spec_derive(
        "signal:engine:", "child-wait-satisfied", some_wait
    )


# ---------------------------------------------------------------------------
# A child's grant leaves its parent the Step that observes the start


class Done(JsonStrategy):
    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        return Step(0, Complete({"done": True}))


class Grants(JsonStrategy):
    """Starts one child with ``grant`` steps, then completes with what the start came to."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start":
            spec = ChildSpec(ChildKey("granted"), self.child.ref, budget=Budget.of(steps=state["input"]["grant"]))
            return Step(0, Continue((start_child_effect(spec),)), {"phase": "starting"})
        body = window[0].payload
        failure = body.get("failure")
        return Step(1, Complete({"start": failure["code"] if failure else "started"}))


@pytest.mark.parametrize(("grant", "outcome"), [(1, "started"), (2, "engine.child.budget_exhausted")])
def test_a_child_grant_must_leave_the_parent_the_step_that_observes_the_start(
    tmp_path: Path, grant: int, outcome: str,
) -> None:
    # Steps budget 3: step 1 starts the child; step 2 must stay possible. A grant of 1 leaves it
    # (1 + 1 + 1 = 3); a grant of 2 would not (1 + 1 + 2 = 4): the start fails, the run goes on.
    child = Program(Descriptor("mk.grant.child"), Done(), IMPL, config_digest("mk.grant.child"))
    parent = Program(Descriptor("mk.grant.parent"), Grants(child), IMPL, config_digest("mk.grant.parent"),
                     children=(child,))
    with Runtime(_store(tmp_path, "grant.db"), Catalog([parent])) as runtime:
        handle = runtime.start(parent, {"grant": grant}, start_id=f"grant-{grant}", budget=Budget.of(steps=3))
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert (result.status, result.output) == ("completed", {"start": outcome})
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert tree.root.allocated.steps == (grant if outcome == "started" else 0)
        assert len(tree.root.children) == (1 if outcome == "started" else 0)


# ---------------------------------------------------------------------------
# A Process that has to end never has a call made again by a new owner


def held_call() -> tuple[threading.Event, threading.Event, list[str], Callable[[EffectRequest, DispatchContext], Settlement]]:
    """A dispatcher whose call is held open: (entered, release, the effect ids called, the dispatcher)."""
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def held(request: EffectRequest, context: DispatchContext) -> Settlement:
        calls.append(request.effect_id)
        entered.set()
        release.wait(WAIT)
        return Settlement.succeeded({"value": 1})

    return entered, release, calls, held


def test_a_new_owner_records_unknown_a_same_identity_call_of_a_process_that_has_to_end(tmp_path: Path) -> None:
    """The history a crash leaves when a same_identity call was in flight and a cancel was
    recorded: the next owner's activation settles the call unknown without calling anything
    (scope-kernel.md §3.8: a terminal intent forces never), and the Process then ends canceled
    with the call as unresolved evidence."""
    entered, release, calls, held = held_call()
    program = chain_program(held, replay=Replay.SAME_IDENTITY, name="mk.ending.replayable")
    catalog = Catalog([program])
    store = _store(tmp_path, "ending.db")
    with Runtime(store, catalog, cancel_grace=WAIT) as runtime:
        handle = runtime.start(program, {"n": 1}, start_id="ending")
        try:
            assert entered.wait(WAIT)
            assert runtime.cancel(handle.root_process_id)
            _wait_until(lambda: runtime.capture(handle.tree_id).root.terminal_intent == "cancel", "the cancel")
            # What the store holds at this moment is what a crash here would leave behind.
            history = [record.event for record in store.read(handle.tree_id)]
        finally:
            release.set()
        runtime.result(handle.tree_id, timeout=WAIT)
    assert calls and len(calls) == 1

    tree = fold_tree(history, catalog.resolve)
    assert tree.root.terminal_intent == "cancel"
    (in_flight,) = tree.root.in_flight()
    assert in_flight.replay == "same_identity"
    ids = RandomIds()
    activation = Kernel(tree, catalog.resolve, ids).activate(ids.incarnation_id())
    assert activation.dispatches == [], "a call of a Process that has to end was made again"
    assert [type(e) for e in activation.events] == [WriterActivated, EffectSettled]
    settled = activation.events[1]
    assert isinstance(settled, EffectSettled)
    assert (settled.effect_id, settled.status) == (in_flight.effect_id, "unknown")
    assert settled.diagnostic is not None and settled.diagnostic.code == "engine.dispatch.interrupted"
    ended = Kernel(tree, catalog.resolve, ids).advance()
    assert ended.dispatches == []
    assert tree.root.status == "canceled"
    assert tree.root.termination is not None
    assert tree.root.termination.unresolved_effect_ids == (in_flight.effect_id,)


def test_a_new_owner_records_unknown_a_same_identity_call_whose_ancestor_has_to_end(tmp_path: Path) -> None:
    """As above, one level down: the crash comes right after the host's cancel of the root was
    stored, before the owner's next pass gave the child its own intent. The child's call is
    still not made again: its ancestor's intent is enough (``TreeState.ending``)."""
    entered, release, calls, held = held_call()
    child = chain_program(held, replay=Replay.SAME_IDENTITY, name="mk.ending.child")
    root = parent_program(child, count=1, name="mk.ending.root")
    catalog = Catalog([root])
    store = _store(tmp_path, "ancestor.db")
    with Runtime(store, catalog, cancel_grace=WAIT) as runtime:
        handle = runtime.start(root, {"child": {"n": 1}}, start_id="ancestor-ending")
        try:
            assert entered.wait(WAIT)
            assert runtime.cancel(handle.root_process_id)
            _wait_until(lambda: runtime.capture(handle.tree_id).root.terminal, "the root to end")
            history = [record.event for record in store.read(handle.tree_id)]
        finally:
            release.set()
        runtime.result(handle.tree_id, timeout=WAIT)
    assert len(calls) == 1
    # The stored history up to the host's cancel of the root: what a crash right after that
    # append leaves (the child holds no intent of its own yet).
    cut = next(i for i, e in enumerate(history)
               if isinstance(e, ControlRequested) and e.process_id == handle.root_process_id) + 1
    tree = fold_tree(history[:cut], catalog.resolve)
    (low,) = _children(tree, tree.root)
    assert tree.root.terminal_intent == "cancel" and low.terminal_intent is None
    (in_flight,) = low.in_flight()
    ids = RandomIds()
    activation = Kernel(tree, catalog.resolve, ids).activate(ids.incarnation_id())
    assert activation.dispatches == [], "a call under an ending ancestor was made again"
    settled = [e for e in activation.events if isinstance(e, EffectSettled)]
    assert [(e.effect_id, e.status) for e in settled] == [(in_flight.effect_id, "unknown")]
    Kernel(tree, catalog.resolve, ids).advance()
    assert (tree.root.status, low.status) == ("canceled", "canceled")


# ---------------------------------------------------------------------------
# A zero grant is a finite quota of zero, not "unlimited"


class StartsOneCaller(JsonStrategy):
    """Starts one child with an effects grant of 0 and completes with how the child ended."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            spec = ChildSpec(ChildKey("no-calls"), self.child.ref, {"n": 1}, budget=Budget.of(effects=0))
            return Step(0, Continue((start_child_effect(spec),)), {"phase": "starting"})
        if phase == "starting":
            spec = ChildWaitSpec(WaitKey("caller"), (window[0].payload["process_id"],))
            return Step(1, Continue((wait_children_effect(spec),)), {"phase": "opening"})
        if phase == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting"})  # type: ignore[arg-type]
        (outcome,) = window[0].payload["outcomes"]
        termination = outcome["result"]["termination"]
        return Step(1, Complete({"status": outcome["result"]["status"], "code": termination["failure"]["code"]}))


def test_a_child_granted_zero_effects_may_make_no_call(tmp_path: Path) -> None:
    calls: list[str] = []

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        calls.append(request.effect_id)
        return Settlement.succeeded({"value": 1})

    child = chain_program(call, name="mk.zero.child")
    parent = Program(Descriptor("mk.zero.parent"), StartsOneCaller(child), IMPL, config_digest("mk.zero.parent"),
                     children=(child,))
    with Runtime(_store(tmp_path, "zero.db"), Catalog([parent])) as runtime:
        handle = runtime.start(parent, None, start_id="zero-grant")
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert (result.status, result.output) == ("completed", {"status": "failed", "code": "engine.limit.effects"})
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        (granted,) = _children(tree, tree.root)
        assert granted.budget.effects.maximum == 0
    assert calls == []

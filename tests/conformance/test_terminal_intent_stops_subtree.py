"""A terminal intent stops the whole subtree at once (scope-kernel.md §2.6, §6.4), on every store.

A Process that has to end (kill, deadline, cancellation by the host, or ``cancel_child`` by its
parent) but cannot yet, because one of its own calls is in flight, ends when that call settles.
Its descendants must not go on meanwhile: each live child records, in the same owner cycle, the
intent its parent's end will give it (``cancel``; ``deadline`` under a deadline), and so on down
the tree, so they take no new Step and start no new call. Before this, the children kept calling
out until the parent's own call returned (30 calls in 1.5 s in a probe).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext, FunctionDispatcher
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.events import ControlRequested, EffectDispatched
from agentfold.domain.ids import ChildKey, ProcessID
from agentfold.domain.program import (
    ChildSpec,
    Complete,
    Continue,
    Descriptor,
    Program,
    Signal,
    Step,
    cancel_child_effect,
    dispatcher_effect,
    start_child_effect,
)
from agentfold.domain.requests import EffectRequest, Settlement
from agentfold.domain.tree import ProcessState, TreeState
from tests.kernel_programs import IMPL, JsonStrategy, config_digest

Call = Callable[[EffectRequest, DispatchContext], Settlement]
WAIT = 20.0


class Calls:
    """Every dispatcher call the loopers start, with when it started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started: list[tuple[float, str]] = []

    def looping(self, name: str) -> Call:
        def call(request: EffectRequest, context: DispatchContext) -> Settlement:
            with self._lock:
                self.started.append((time.monotonic(), name))
            time.sleep(0.01)
            return Settlement.succeeded({"n": len(self.started)})

        return call

    def since(self, moment: float) -> int:
        with self._lock:
            return sum(1 for at, _ in self.started if at > moment)

    def of(self, name: str) -> int:
        with self._lock:
            return sum(1 for _, who in self.started if who == name)


class Gate:
    """A call that blocks, ignoring cancellation, until the test opens the gate."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.open = threading.Event()

    def call(self, request: EffectRequest, context: DispatchContext) -> Settlement:
        self.entered.set()
        self.open.wait(WAIT)
        return Settlement.succeeded({"gate": "opened"})


class Looper(JsonStrategy):
    """Starts ``child`` first when it has one, then calls its dispatcher forever."""

    def __init__(self, child: Program | None) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start" and self.child is not None:
            spec = ChildSpec(ChildKey("below"), self.child.ref)
            return Step(0, Continue((start_child_effect(spec),)), {"phase": "looping"})
        return Step(len(window), Continue((dispatcher_effect({"loop": True}),)), {"phase": "looping"})


class Blocker(JsonStrategy):
    """Starts ``child``, then makes one call (that blocks), then completes."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def start_middle(self) -> Step:
        spec = ChildSpec(ChildKey("middle"), self.child.ref)
        return Step(0, Continue((start_child_effect(spec),)), {"phase": "started"})

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            return self.start_middle()
        if phase == "started":
            return Step(1, Continue((dispatcher_effect({"blocking": True}),)), {"phase": "blocked"})
        return Step(len(window), Complete({"done": True}), {"phase": "done"})


def looper_program(name: str, call: Call, child: Program | None = None) -> Program:
    return Program(
        Descriptor(name), Looper(child), IMPL, config_digest(name),
        children=(child,) if child is not None else (), dispatcher=FunctionDispatcher(call),
    )


def blocker_program(name: str, child: Program, call: Call) -> Program:
    return Program(
        Descriptor(name), Blocker(child), IMPL, config_digest(name),
        children=(child,), dispatcher=FunctionDispatcher(call),
    )


class Canceller(Blocker):
    """Starts ``child``, lets it run until its own call returns, then cancels it and completes."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            return self.start_middle()
        if phase == "started":
            middle = window[0].payload["process_id"]
            return Step(1, Continue((dispatcher_effect({"hold": True}),)), {"phase": "holding", "middle": middle})
        if phase == "holding":
            effect = cancel_child_effect(ProcessID(state["middle"]), "enough")
            return Step(len(window), Continue((effect,)), {"phase": "canceling"})
        return Step(len(window), Complete({"canceled": state["middle"]}), {"phase": "done"})


def permitted_after(store: EventStore, tree_id: Any, ending: ProcessID, below: set[ProcessID]) -> list[Any]:
    """Dispatch permissions granted to ``below`` after ``ending``'s first terminal intent:
    none, since its subtree records its own intents in the same owner cycle."""
    events = [r.event for r in store.read(tree_id)]
    first = next(
        i for i, e in enumerate(events)
        if isinstance(e, ControlRequested) and e.process_id == ending and e.control in ("cancel", "kill", "deadline")
    )
    return [e for e in events[first:] if isinstance(e, EffectDispatched) and e.process_id in below]


def by_depth(tree: TreeState) -> list[ProcessState]:
    return sorted(tree.processes.values(), key=lambda p: p.depth)


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


STOPS = {
    # host control on the root -> (the root's end, what its descendants end as, their cause)
    "kill": ("killed", "canceled", "parent_cancellation"),
    "cancel": ("canceled", "canceled", "parent_cancellation"),
    "deadline": ("timed_out", "timed_out", "parent_deadline"),
}


@pytest.mark.parametrize("control", sorted(STOPS))
def test_a_host_control_on_a_process_with_a_call_in_flight_stops_its_descendants_at_once(
    store_url: str, control: str
) -> None:
    calls, gate = Calls(), Gate()
    leaf = looper_program("subtree.leaf", calls.looping("leaf"))
    middle = looper_program("subtree.middle", calls.looping("middle"), leaf)
    root = blocker_program(f"subtree.root-{control}", middle, gate.call)
    root_end, descendants_end, cause = STOPS[control]
    store = EventStore(store_url)
    with Runtime(store, Catalog([root])) as runtime:
        handle = runtime.start(root, None)
        assert gate.entered.wait(WAIT)
        wait_until(lambda: calls.of("leaf") >= 3 and calls.of("middle") >= 3, "both loopers to run")

        getattr(runtime, control)(handle.root_process_id)
        asked = time.monotonic()
        # The root's own call is still blocked: it cannot end. Its subtree stops anyway.
        wait_until(
            lambda: all(p.terminal for p in by_depth(runtime.capture(handle.tree_id))[1:]),
            "the descendants to end while the root's call is blocked",
        )
        tree = runtime.capture(handle.tree_id)
        top, mid, low = by_depth(tree)
        assert top.status == "running" and top.terminal_intent == control and top.in_flight()
        for process in (mid, low):
            assert process.status == descendants_end
            assert process.termination is not None and process.termination.cause == cause
        # At most the calls already permitted when the control arrived (one per looper) start after it.
        started_after = calls.since(asked)
        assert started_after <= 2, started_after
        stopped = time.monotonic()
        assert permitted_after(store, handle.tree_id, top.process_id, {mid.process_id, low.process_id}) == []

        gate.open.set()
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert result.status == root_end
        assert calls.since(stopped) == 0

    # The stream records why each descendant stopped: the host's control, then the parent-owned
    # intent of the middle Process (its call was in flight or it would have ended at once), and
    # the leaf's when the middle could not end at once either (else the middle's end gave it).
    controls = [r.event for r in store.read(handle.tree_id) if isinstance(r.event, ControlRequested)]
    kind = "deadline" if control == "deadline" else "cancel"
    recorded = [(c.process_id, c.control, c.owner) for c in controls]
    assert recorded[:2] == [(top.process_id, control, "host"), (mid.process_id, kind, "parent")]
    assert recorded[2:] in ([], [(low.process_id, kind, "parent")])


def test_cancel_child_of_a_child_with_a_call_in_flight_stops_the_grandchildren_at_once(store_url: str) -> None:
    calls, gate, hold = Calls(), Gate(), threading.Event()
    leaf = looper_program("subtree.cc-leaf", calls.looping("leaf"))
    middle = blocker_program("subtree.cc-middle", leaf, gate.call)

    def holding(request: EffectRequest, context: DispatchContext) -> Settlement:
        hold.wait(WAIT)  # the root cancels its child only once the test says so
        return Settlement.succeeded({})

    name = "subtree.cc-root"
    root = Program(
        Descriptor(name), Canceller(middle), IMPL, config_digest(name),
        children=(middle,), dispatcher=FunctionDispatcher(holding),
    )
    store = EventStore(store_url)
    with Runtime(store, Catalog([root])) as runtime:
        handle = runtime.start(root, None)
        assert gate.entered.wait(WAIT)
        wait_until(lambda: calls.of("leaf") >= 3, "the grandchild to run")

        hold.set()  # the root now cancels its child, whose own call is blocked
        wait_until(
            lambda: by_depth(runtime.capture(handle.tree_id))[2].terminal,
            "the grandchild to end while its parent's call is blocked",
        )
        _root, mid, low = by_depth(runtime.capture(handle.tree_id))
        assert mid.status == "running" and mid.terminal_intent == "cancel" and mid.in_flight()
        assert low.status == "canceled" and low.termination is not None
        assert low.termination.cause == "parent_cancellation"
        assert permitted_after(store, handle.tree_id, mid.process_id, {low.process_id}) == []
        stopped = time.monotonic()

        gate.open.set()
        result = runtime.result(handle.tree_id, timeout=WAIT)
        assert result.status == "completed" and result.output == {"canceled": str(mid.process_id)}
        # The root completed on the receipt; its child ends once its own call returns.
        wait_until(lambda: runtime.capture(handle.tree_id).processes[mid.process_id].terminal, "the child to end")
        assert calls.since(stopped) == 0
        middle_end = runtime.capture(handle.tree_id).processes[mid.process_id]
        assert middle_end.status == "canceled" and middle_end.termination is not None
        assert middle_end.termination.cause == "parent_cancellation"


def test_children_keep_the_first_end_they_recorded_a_deadline_then_a_kill_leaves_them_timed_out(
    store_url: str,
) -> None:
    # As Scope's stopProcessTree at each intent: the deadline gives the children a deadline,
    # the kill that follows a cancel, and a deadline outranks a cancel.
    calls, gate = Calls(), Gate()
    leaf = looper_program("subtree.dk-leaf", calls.looping("leaf"))
    middle = looper_program("subtree.dk-middle", calls.looping("middle"), leaf)
    root = blocker_program("subtree.dk-root", middle, gate.call)
    with Runtime(EventStore(store_url), Catalog([root])) as runtime:
        handle = runtime.start(root, None)
        assert gate.entered.wait(WAIT)
        wait_until(lambda: calls.of("leaf") >= 1, "the leaf to run")
        runtime.deadline(handle.root_process_id)
        runtime.kill(handle.root_process_id)
        wait_until(
            lambda: all(p.terminal for p in by_depth(runtime.capture(handle.tree_id))[1:]), "the descendants to end"
        )
        gate.open.set()
        assert runtime.result(handle.tree_id, timeout=WAIT).status == "killed"
        _root, mid, low = by_depth(runtime.capture(handle.tree_id))
        for process in (mid, low):
            assert process.status == "timed_out"
            assert process.termination is not None and process.termination.cause == "parent_deadline"

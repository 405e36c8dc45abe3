"""Mutation audit of the coordination Programs (InputGate, Deadline) and Transform: behaviour the
earlier tests left undefended, each test named after what a user observes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.follower import Follower
from agentfold.adapters.host import Host
from agentfold.adapters.queries import HostQueries
from agentfold.adapters.runtime import RandomIds
from agentfold.adapters.sources import ProgramSources
from agentfold.adapters.team import TransformConfig, transform
from agentfold.domain.coordination import parse_instant
from agentfold.domain.errors import AgentfoldError, InvalidInput
from agentfold.domain.events import StepCommitted
from agentfold.domain.ids import StartID
from agentfold.domain.kernel import Kernel, start_tree
from agentfold.domain.program import SignalRequest
from agentfold.domain.requests import Settlement
from agentfold.domain.tree import TreeState
from agentfold.projections.host_views import gate_inputs
from tests.interaction.support import open_runtime
from tests.interaction.tools import WAIT, wait_until
from tests.team import programs as P
from tests.team.test_input_gate import waiting_gate


def test_an_early_answer_completes_the_gate_in_the_step_that_adopts_its_wait() -> None:
    """Docs (coordination.py): an answer admitted after the wait was declared but before the gate
    adopted it "is honoured in the same Step": the run takes 2 Steps, not 3, and that Step
    consumes both the opening and the answer (nothing is left in the gate's mailbox)."""
    gate = P.gate()
    catalog = Catalog([gate])
    ids = RandomIds()
    started = start_tree(gate, "request", start_id=StartID("start:early-same-step"),
                         root_id=ids.root_process_id(), incarnation_id=ids.incarnation_id())
    tree = TreeState(catalog.resolve)
    tree.apply(started)
    kernel = Kernel(tree, catalog.resolve, ids)
    events: list[Any] = list(kernel.advance(max_events=1).events)
    [wait_id] = list(tree.root.waits)
    events.extend(kernel.admit_signals(tree.root.process_id, [SignalRequest("signal:early", "yes", wait_id)]))
    events.extend(kernel.advance().events)
    root = tree.root
    assert root.status == "completed"
    steps = [(e.step, e.consumed, e.kind) for e in events if isinstance(e, StepCommitted)]
    assert [(step, consumed) for step, consumed, _ in steps] == [(1, 0), (2, 2)], steps
    assert root.pending_count == 0
    assert root.usage == {"steps": 2, "effects": 1, "signals": 2}


def test_a_gate_answered_while_paused_leaves_the_list_and_a_second_answer_changes_nothing(tmp_path: Path) -> None:
    """docs/team.md: ``gates`` lists the InputGates that wait for an answer. A gate whose answer
    was admitted while its run is paused (so its Step has not consumed it yet) waits for nothing:
    it leaves Host.gates at once, a second answer under another signal id is refused, and once
    resumed the gate completes with the first answer's identity."""
    gate = P.gate()
    store = EventStore(f"sqlite:///{tmp_path / 'gates.db'}")
    try:
        with open_runtime(store, gate) as runtime:
            handle = runtime.start(gate, "request")
            root = waiting_gate(runtime, handle)
            runtime.wait_idle(handle.tree_id)
            host = Host(runtime)
            [entry] = host.gates(str(handle.tree_id))
            assert runtime.pause(root.process_id)
            runtime.wait_idle(handle.tree_id)
            assert host.answer_gate(entry["process_id"], entry["wait_id"], "first", signal_id="signal:first")
            runtime.wait_idle(handle.tree_id)
            assert not runtime.capture(handle.tree_id).root.terminal  # paused: the answer is not consumed yet
            assert host.gates(str(handle.tree_id)) == []
            assert list(host.gates()) == []
            with pytest.raises(AgentfoldError):
                host.answer_gate(entry["process_id"], entry["wait_id"], "second", signal_id="signal:second")
            assert runtime.resume(root.process_id)
            result = handle.result(WAIT)
    finally:
        store.close()
    assert result.status == "completed"
    assert result.output == {"id": "signal:first", "wait_id": entry["wait_id"], "payload": "first"}


def _waiting_gate_kernel(start_id: str) -> tuple[TreeState, Kernel]:
    gate = P.gate()
    catalog = Catalog([gate])
    ids = RandomIds()
    started = start_tree(gate, "request", start_id=StartID(start_id),
                         root_id=ids.root_process_id(), incarnation_id=ids.incarnation_id())
    tree = TreeState(catalog.resolve)
    tree.apply(started)
    kernel = Kernel(tree, catalog.resolve, ids)
    kernel.advance()
    assert tree.root.current_wait is not None
    return tree, kernel


def test_a_gate_whose_cancel_is_recorded_but_not_carried_out_is_no_longer_listed() -> None:
    """A cancel recorded on a waiting gate (e.g. by ``agentfold cancel`` while no owner drives the
    run) ends it: the gate takes no answer any more, so the listing every surface reads
    (``gate_inputs``: Host.gates, ``agentfold gates``, GET /gates) no longer offers it."""
    tree, kernel = _waiting_gate_kernel("start:cancel-recorded")
    [listed] = gate_inputs(tree)
    assert listed.process_id == tree.root.process_id
    assert kernel.request_control(tree.root.process_id, "cancel")
    assert not tree.root.terminal and tree.ending(tree.root) is not None
    assert gate_inputs(tree) == []


class _Vanished(BaseException):
    """Not an Exception: the transform's call ends without an outcome (as a dying process's)."""


def _vanishes(value: Any) -> Any:
    raise _Vanished


def test_runtime_resolution_of_a_transform_call_is_refused_when_its_output_breaks_the_output_schema(
    tmp_path: Path,
) -> None:
    """``Runtime.resolve_unknown_effect`` (docs/concepts.md) of a transform's unknown call: a value
    the function could not have returned (its output schema) is refused before anything is
    stored (``engine.effect.settlement_invalid``), rather than failing the run later; the value
    it could have returned completes it."""
    program = transform(TransformConfig("t.vanishes", _vanishes, identity="tests.vanishes/1",
                                        output_schema={"type": "object"}))
    store = EventStore(f"sqlite:///{tmp_path / 'resolve.db'}")
    try:
        with open_runtime(store, program) as runtime:
            handle = runtime.start(program, 1)
            runtime.wait_idle(handle.tree_id)
            [unknown] = Host(runtime).unknown(str(handle.tree_id))
            head = store.max_notification_id()
            with pytest.raises(InvalidInput) as refused:
                runtime.resolve_unknown_effect(unknown["effect_id"], Settlement.succeeded({"output": 10}))
            assert refused.value.code == "engine.effect.settlement_invalid"
            assert "output schema" in refused.value.message
            assert store.max_notification_id() == head
            runtime.resolve_unknown_effect(unknown["effect_id"], Settlement.succeeded({"output": {"v": 10}}))
            result = handle.result(WAIT)
    finally:
        store.close()
    assert (result.status, result.output) == ("completed", {"v": 10})


def test_a_deadline_on_february_29_of_a_century_year_is_refused_unless_it_divides_by_400() -> None:
    """Gregorian leap years: 2100-02-29 names no calendar date (refused with
    ``coordination.input.invalid``, a Deadline never waits for it); 2000-02-29 does."""
    assert parse_instant("2000-02-29T12:00:00Z") == "2000-02-29T12:00:00Z"
    for text in ("2100-02-29T00:00:00Z", "1900-02-29T00:00:00+01:00"):
        with pytest.raises(InvalidInput) as caught:
            parse_instant(text)
        assert caught.value.code == "coordination.input.invalid" and "names no calendar date" in caught.value.message


def three_gates_then_wait(turn: dict[str, Any]) -> dict[str, Any]:
    """Turn 1 starts the gates a, b and c; every later turn waits."""
    if turn["number"] == 1:
        return {"mode": "continue", "state": turn["state"],
                "tasks": [P.task(key, "test.gate", f"{key}?") for key in ("a", "b", "c")]}
    return {"mode": "wait", "state": turn["state"]}


def test_a_runs_gates_read_from_the_read_model_are_in_its_process_order(tmp_path: Path) -> None:
    """``gates TREE`` lists a run's waiting InputGates in the tree's Process order (host_views);
    read from the follower's table (``agentfold_rm_input_gates``) the order is the same as the
    live listing: a, b, c as the team started them."""
    program = P.team(three_gates_then_wait, P.gate(), max_turns=4)
    store = EventStore(f"sqlite:///{tmp_path / 'order.db'}")
    try:
        with open_runtime(store, program) as runtime:
            handle = runtime.start(program, "begin")
            host = Host(runtime)
            wait_until(lambda: len(host.gates(str(handle.tree_id))) == 3, "three gates to wait")
            runtime.wait_idle(handle.tree_id)
            live = host.gates(str(handle.tree_id))
        assert [g["task"] for g in live] == ["a", "b", "c"]
        Follower(store, Catalog([program])).catch_up()
        queries = HostQueries(store, ProgramSources())
        assert queries.gates(handle.tree_id) == live
        assert list(queries.gates()) == live
    finally:
        store.close()

"""Budgets a mutation audit (2026-12-05, "budget") found undefended: each test failed with its
mutant planted and passes without it.

- a host signal sent while an Effect's settlement is reserved counts that reservation: the
  signals budget is never overrun once the call settles;
- a Step that declares more Effects than the budget has left fails the Process durably with
  ``engine.limit.effects`` and makes no call (it did not wedge the tree's owner);
- a tree loaded from a snapshot taken while a call was in flight keeps its reserved
  settlement (a second Runtime refuses the signal the budget cannot hold);
- a parent that granted Steps to a child fails with ``engine.limit.steps`` when its own Steps
  run out (the grant is counted by the kernel, not only by the fold);
- the kernel refuses a grant of Effects or Signals that does not fit beside the start effect
  and its reserved settlement (``engine.child.budget_exhausted``: the run goes on);
- a Step whose settlement has no room (beside a child wait's reserved satisfaction, or in the
  mailbox bound) fails the Process with ``engine.limit.signals`` of kind ``execution``;
- the fold refuses a stored history that overran a budget through a child's grant: an Effect
  declared (effects or signals) past what the grant left, a grant of Effects that did not fit;
- an adapter's budget is granted to its Interaction child even when its caller is unlimited;
- a host's run answer gives each Process its own usage;
- ``agentfold show`` prints a quota of 0 as ``<= 0``, not as unlimited.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.cli import main
from agentfold.adapters.dispatch import DispatchContext, FunctionDispatcher
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.interaction import AdapterConfig, InteractionConfig, adapt, compile_interaction
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.sources import ProgramSources
from agentfold.domain.budget import Budget
from agentfold.domain.errors import EngineCode, ResourceLimitExceeded
from agentfold.domain.events import EffectDeclared, ProcessTerminated, TreeLimits
from agentfold.domain.ids import ChildKey, SignalID, WaitKey
from agentfold.domain.program import (
    ChildSpec,
    ChildWaitSpec,
    Complete,
    Continue,
    Descriptor,
    Pause,
    Program,
    Signal,
    SignalRequest,
    Step,
    Wait,
    dispatcher_effect,
    start_child_effect,
    wait_children_effect,
)
from agentfold.domain.requests import EffectRequest, Settlement
from agentfold.domain.tree import fold_tree
from tests.kernel_programs import IMPL, JsonStrategy, chain_program, config_digest
from tests.test_fold_rules import assert_corrupt, declared, step, with_child
from tests.test_mutants_kernel import WAIT, _store


def _program(name: str, strategy: Any, **kwargs: Any) -> Program:
    """A test Program named ``name`` (its configuration digest from the name)."""
    return Program(Descriptor(name, signal_schema=kwargs.pop("signal_schema", None)), strategy, IMPL,
                   config_digest(name), **kwargs)


def _family(name: str, parent: Any, child_strategy: Any) -> Program:
    """A parent Program built by ``parent(child)`` around a child Program ``<name>.child``."""
    child = _program(f"{name}.child", child_strategy)
    return _program(f"{name}.parent", parent(child), children=(child,))


class _HeldCall:
    """A dispatcher that holds its call until ``release`` is set (``entered`` once it holds)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, request: EffectRequest, context: DispatchContext) -> Settlement:
        self.entered.set()
        self.release.wait(WAIT)
        return Settlement.succeeded({"value": 1})


# ---------------------------------------------------------------------------
# A host signal counts the settlement already reserved


class OneCallThenDone(JsonStrategy):
    """Declares one dispatcher call, then completes with how many signals its Step saw."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start":
            return Step(0, Continue((dispatcher_effect({"call": 1}),)), {"phase": "calling"})
        return Step(len(window), Complete({"seen": len(window)}))


def test_a_host_signal_sent_while_a_settlement_is_reserved_never_overruns_the_signals_budget(tmp_path: Path) -> None:
    # Budget 2 signals; the call in flight holds 1 for its settlement: a host may send 1, not 2.
    held = _HeldCall()
    entered, release = held.entered, held.release
    program = _program("budget.reserved", OneCallThenDone(), signal_schema={"type": "object"},
                       dispatcher=FunctionDispatcher(held))
    store = _store(tmp_path, "reserved.db")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, None, start_id="reserved", budget=Budget.of(signals=2))
            pid = handle.root_process_id
            try:
                assert entered.wait(WAIT)
                pair = [SignalRequest(SignalID("h1"), {}), SignalRequest(SignalID("h2"), {})]
                before = len(store.read(handle.tree_id))
                with pytest.raises(ResourceLimitExceeded) as refused:
                    runtime.deliver_signals(pid, pair)
                assert refused.value.code == EngineCode.LIMIT_SIGNALS
                assert len(store.read(handle.tree_id)) == before  # the refusal stored nothing
                assert runtime.deliver_signals(pid, pair[:1])
            finally:
                release.set()
            result = runtime.result(handle.tree_id, timeout=WAIT)
            assert (result.status, result.output) == ("completed", {"seen": 2})
            assert result.usage["signals"] == 2  # never 3 of a budget of 2
    finally:
        store.close()


def test_a_tree_loaded_from_a_snapshot_taken_with_a_call_in_flight_keeps_its_reserved_settlement(
    tmp_path: Path,
) -> None:
    # A snapshot after every append: the one taken while the call is held records its reserved
    # settlement. A second Runtime (which loads the tree from that snapshot) must refuse what the
    # budget cannot hold: 2 signals, 1 of them reserved, leaves room for 1 host signal.
    held = _HeldCall()
    entered, release = held.entered, held.release
    program = _program("budget.snapshot", OneCallThenDone(), signal_schema={"type": "object"},
                       dispatcher=FunctionDispatcher(held))
    url = f"sqlite:///{tmp_path / 'snapshot.db'}"
    store, other = EventStore(url), EventStore(url)
    try:
        with Runtime(store, Catalog([program]), snapshot_every=1) as runtime:
            handle = runtime.start(program, None, start_id="snapshot", budget=Budget.of(signals=2))
            pid = handle.root_process_id
            try:
                assert entered.wait(WAIT)
                loaded = other.load(handle.tree_id, Catalog([program]).resolve)
                assert loaded.snapshot_version > 0  # it did load from a snapshot
                assert loaded.state.root.reserved_signals == 1
                with Runtime(other, Catalog([program])) as second:
                    pair = [SignalRequest(SignalID("h1"), {}), SignalRequest(SignalID("h2"), {})]
                    with pytest.raises(ResourceLimitExceeded) as refused:
                        second.deliver_signals(pid, pair)
                    assert refused.value.code == EngineCode.LIMIT_SIGNALS
            finally:
                release.set()
            result = runtime.result(handle.tree_id, timeout=WAIT)
            assert result.usage["signals"] <= 2
    finally:
        other.close()
        store.close()


# ---------------------------------------------------------------------------
# More Effects in one Step than the budget has left


class TwoCallsAtOnce(JsonStrategy):
    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        effects = (dispatcher_effect({"call": 1}), dispatcher_effect({"call": 2}))
        return Step(0, Continue(effects), {"phase": "calling"})


def test_a_step_declaring_more_effects_than_are_left_fails_the_process_and_calls_nothing(tmp_path: Path) -> None:
    calls: list[str] = []

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        calls.append(request.effect_id)
        return Settlement.succeeded({"value": 1})

    name = "budget.two-at-once"
    program = _program(name, TwoCallsAtOnce(), dispatcher=FunctionDispatcher(call))
    store = _store(tmp_path, "two.db")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, None, start_id="two", budget=Budget.of(effects=1))
            result = runtime.result(handle.tree_id, timeout=WAIT)
            assert result.status == "failed"
            assert result.termination is not None
            assert result.termination["failure"]["code"] == EngineCode.LIMIT_EFFECTS
            assert result.termination["failure"]["kind"] == "execution"
            assert result.usage["effects"] == 0
            events = [record.event for record in store.read(handle.tree_id)]
            assert not any(isinstance(e, EffectDeclared) for e in events)
            assert isinstance(events[-1], ProcessTerminated)
    finally:
        store.close()
    assert calls == []


# ---------------------------------------------------------------------------
# A parent's own Steps run out after a grant


class Done(JsonStrategy):
    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        return Step(0, Complete({"done": True}))


class GrantsThenGoesOn(JsonStrategy):
    """Starts a child granted 1 Step, observes the start, then wants two more Steps."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            spec = ChildSpec(ChildKey("granted"), self.child.ref, budget=Budget.of(steps=1))
            return Step(0, Continue((start_child_effect(spec),)), {"phase": "starting"})
        if phase == "starting":
            return Step(len(window), Continue(), {"phase": "more"})
        return Step(len(window), Complete({"finished": True}))


def test_a_parent_whose_steps_went_to_a_child_fails_with_the_steps_limit(tmp_path: Path) -> None:
    # Budget 3 steps = 2 of the parent's own + 1 granted: the third Step of its own is refused.
    parent = _family("budget.grant", GrantsThenGoesOn, Done())
    store = _store(tmp_path, "grant.db")
    try:
        with Runtime(store, Catalog([parent])) as runtime:
            handle = runtime.start(parent, None, start_id="grant", budget=Budget.of(steps=3))
            result = runtime.result(handle.tree_id, timeout=WAIT)
            assert result.status == "failed"
            assert result.termination is not None
            assert result.termination["failure"]["code"] == EngineCode.LIMIT_STEPS
            assert result.usage["steps"] == 2
            root = runtime.wait_idle(handle.tree_id, timeout=WAIT).root
            assert root.allocated.steps == 1
    finally:
        store.close()


class GrantsOne(JsonStrategy):
    """Starts one child granted ``grant`` of dimension ``dimension``, then completes with how the start came out."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start":
            grant = Budget.of(**{state["input"]["dimension"]: state["input"]["grant"]})
            spec = ChildSpec(ChildKey("granted"), self.child.ref, budget=grant)
            return Step(0, Continue((start_child_effect(spec),)), {"phase": "starting"})
        failure = window[0].payload.get("failure")
        return Step(1, Complete({"start": failure["code"] if failure else "started"}))


@pytest.mark.parametrize(("dimension", "grant", "outcome"), [
    ("effects", 1, "started"), ("effects", 2, "engine.child.budget_exhausted"),
    ("signals", 2, "started"), ("signals", 3, "engine.child.budget_exhausted"),
])
def test_a_grant_must_fit_beside_the_start_effect_and_its_reserved_settlement(
    tmp_path: Path, dimension: str, grant: int, outcome: str,
) -> None:
    # Effects 2 / signals 3: the start effect is already prepared (1 effect) and its settlement
    # reserved (1 signal); a grant that does not fit beside them fails the start, the run goes on.
    limit = {"effects": 2, "signals": 3}[dimension]
    parent = _family("budget.fit", GrantsOne, Done())
    store = _store(tmp_path, "fit.db")
    try:
        with Runtime(store, Catalog([parent])) as runtime:
            handle = runtime.start(parent, {"dimension": dimension, "grant": grant}, start_id="fit",
                                   budget=Budget.of(**{dimension: limit}))
            result = runtime.result(handle.tree_id, timeout=WAIT)
            assert (result.status, result.output) == ("completed", {"start": outcome})
            root = runtime.wait_idle(handle.tree_id, timeout=WAIT).root
            assert getattr(root.allocated, dimension) == (grant if outcome == "started" else 0)
    finally:
        store.close()


class Holds(JsonStrategy):
    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        return Step(0, Pause("holding"), {"phase": "held"})


class WaitsThenCalls(JsonStrategy):
    """Starts a child that holds, opens a wait on it (its satisfaction stays reserved), then
    declares one dispatcher call."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            spec = ChildSpec(ChildKey("held"), self.child.ref, budget=Budget.of(signals=0))
            return Step(0, Continue((start_child_effect(spec),)), {"phase": "starting"})
        if phase == "starting":
            wait = ChildWaitSpec(WaitKey("held"), (window[0].payload["process_id"],))
            return Step(1, Continue((wait_children_effect(wait),)), {"phase": "opening"})
        if phase == "opening":
            return Step(1, Continue((dispatcher_effect({"call": 1}),)), {"phase": "calling"})
        return Step(len(window), Complete({"called": True}))


def test_a_call_whose_settlement_has_no_room_beside_a_reserved_child_wait_fails_the_process(tmp_path: Path) -> None:
    # Signals 3: the start's settlement and the wait's opening are accepted, its satisfaction is
    # reserved: the call's settlement would be a fourth, so the Step that declares it is refused.
    calls: list[str] = []

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        calls.append(request.effect_id)
        return Settlement.succeeded({"value": 1})

    child = _program("budget.held.child", Holds())
    parent = _program("budget.held.parent", WaitsThenCalls(child), children=(child,), dispatcher=FunctionDispatcher(call))
    store = _store(tmp_path, "held.db")
    try:
        with Runtime(store, Catalog([parent])) as runtime:
            handle = runtime.start(parent, None, start_id="held", budget=Budget.of(signals=3))
            result = runtime.result(handle.tree_id, timeout=WAIT)
            assert result.status == "failed"
            assert result.termination is not None
            assert result.termination["failure"]["code"] == EngineCode.LIMIT_SIGNALS
            assert result.termination["failure"]["kind"] == "execution"  # docs/errors.md: a budget, not a contract
            assert result.usage["signals"] <= 3
    finally:
        store.close()
    assert calls == []


def test_a_step_whose_settlement_does_not_fit_the_mailbox_fails_with_an_execution_failure(tmp_path: Path) -> None:
    # docs/errors.md: engine.limit.signals from a Step (budget or mailbox bound) is an execution failure.
    program = chain_program(name="budget.mailbox")
    store = _store(tmp_path, "mailbox.db")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {"n": 1}, start_id="mailbox", limits=TreeLimits(max_pending_signals=0))
            result = runtime.result(handle.tree_id, timeout=WAIT)
    finally:
        store.close()
    assert result.status == "failed" and result.termination is not None
    failure = result.termination["failure"]
    assert (failure["code"], failure["kind"]) == (EngineCode.LIMIT_SIGNALS, "execution")
    assert result.usage == {"steps": 0, "effects": 0, "signals": 0}


# ---------------------------------------------------------------------------
# The fold refuses a stored history that overran through a grant


def _parent_declares_after_the_grant(parent: Budget, child: Budget) -> tuple[list[Any], Any]:
    """with_child, but the root's second Step declares one more Effect instead of completing."""
    events = with_child(parent, child)[:6]
    bad = declared(2)
    return [*events, step(2, consumed=1, effects=1), bad], bad


def test_the_fold_refuses_an_effect_declared_past_what_a_grant_of_effects_left() -> None:
    # Effects 2: the start effect + a grant of 1; a second Effect of the root's own is one too many.
    events, bad = _parent_declares_after_the_grant(Budget.of(effects=2), Budget.of(effects=1))
    assert_corrupt(events, bad, "budget.effects")
    fold_tree(_parent_declares_after_the_grant(Budget.of(effects=3), Budget.of(effects=1))[0])


def test_the_fold_refuses_an_effect_whose_settlement_a_grant_of_signals_left_no_room_for() -> None:
    # Signals 2: the start's settlement + a grant of 1; the next settlement has no room.
    events, bad = _parent_declares_after_the_grant(Budget.of(signals=2), Budget.of(signals=1))
    assert_corrupt(events, bad, "budget.signals")
    fold_tree(_parent_declares_after_the_grant(Budget.of(signals=3), Budget.of(signals=1))[0])


def test_the_fold_refuses_a_grant_of_effects_that_does_not_fit_what_is_left() -> None:
    # The start effect itself is prepared: 1 + a grant of 2 > 2.
    events = with_child(Budget.of(effects=2), Budget.of(effects=2))
    assert_corrupt(events, events[3], "budget.child_allocation")
    fold_tree(with_child(Budget.of(effects=2), Budget.of(effects=1)))


# ---------------------------------------------------------------------------
# `agentfold show` prints a zero quota as a limit


def test_show_prints_a_zero_quota_as_a_limit_not_as_unlimited(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = chain_program(name="budget.show")
    url = f"sqlite:///{tmp_path / 'show.db'}"
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {"n": 0}, start_id="show", budget=Budget.of(steps=5, effects=0))
            assert runtime.result(handle.tree_id, timeout=WAIT).status == "completed"
    finally:
        store.close()
    capsys.readouterr()
    assert main(["show", "show", "--store", url], sources=ProgramSources(programs=(program,))) == 0
    out = capsys.readouterr().out
    assert "budget: steps <= 5, effects <= 0" in out, out


# ---------------------------------------------------------------------------
# An adapter's budget is its Interaction child's grant, under an unlimited caller too


class OneAnswer:
    def call(self, request: Any) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": '{"message": "hi"}'}, "finish_reason": "stop"}


def test_an_adapter_grants_its_budget_to_its_interaction_under_an_unlimited_caller(tmp_path: Path) -> None:
    # One Step: the Interaction declares its model call and has no Step left to read the answer.
    inner = compile_interaction(InteractionConfig(name="budget.adapted.model", model=OneAnswer(), max_model_calls=1))
    adapted = adapt(AdapterConfig(
        name="budget.adapted", interaction=inner, budget=Budget.of(steps=1),
        build_input=lambda req: {"messages": [{"role": "user", "content": "hello"}]},
        decode_output=lambda out: {"text": out["model_response"]["message"]["content"][0]["text"]},
    ))
    store = _store(tmp_path, "adapted.db")
    try:
        with Runtime(store) as runtime:
            handle = runtime.start(adapted, {}, start_id="adapted")  # the caller itself is unlimited
            result = runtime.result(handle.tree_id, timeout=WAIT)
            tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
    finally:
        store.close()
    (child,) = [p for p in tree.processes.values() if p.parent_id == tree.root.process_id]
    assert child.budget == Budget.of(steps=1)
    assert child.status == "failed" and child.termination is not None and child.termination.failure is not None
    assert child.termination.failure.code == EngineCode.LIMIT_STEPS
    assert result.status == "failed", result


# ---------------------------------------------------------------------------
# A host's run answer gives each Process its own usage


class WaitsForChild(JsonStrategy):
    """Starts one child (granted nothing), waits for it to end, then completes."""

    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            return Step(0, Continue((start_child_effect(ChildSpec(ChildKey("granted"), self.child.ref)),)),
                        {"phase": "starting"})
        if phase == "starting":
            wait = ChildWaitSpec(WaitKey("granted"), (window[0].payload["process_id"],))
            return Step(1, Continue((wait_children_effect(wait),)), {"phase": "opening"})
        if phase == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting"})  # type: ignore[arg-type]
        return Step(len(window), Complete({"done": True}))


def test_the_host_run_answer_gives_each_process_its_own_usage(tmp_path: Path) -> None:
    parent = _family("budget.usage", WaitsForChild, Done())
    store = _store(tmp_path, "usage.db")
    try:
        with Runtime(store, Catalog([parent])) as runtime:
            handle = runtime.start(parent, None, start_id="usage")
            assert runtime.result(handle.tree_id, timeout=WAIT).status == "completed"
            tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
            run = Host(runtime).run("usage")
    finally:
        store.close()
    usage = {p["child_key"]: p["usage"] for p in run["processes"]}
    assert usage == {
        # 4 Steps; the start and the wait; the start's settlement, the wait's opening and its satisfaction
        None: {"steps": 4, "effects": 2, "signals": 3},
        "granted": {"steps": 1, "effects": 0, "signals": 0},  # completed at its first Step
    }
    assert [p["usage"] for p in run["processes"]] == [p.usage for p in tree.processes.values()]

"""`agentfold audit drift TREE`: the current code re-decides every recorded Step.

A chain run (4 dispatcher effects, then complete) is recorded by a real Runtime with
the original strategy. Test copies of the strategy, bound under the same ProgramRef
(as a new deployment of the same program version would be), change one decision rule;
drift must name the exact Step, its position and the first differing field.

Positions of the chain: step k's StepCommitted is at 2 + 4(k-1), its EffectDeclared
right after it; step 5 (complete) is at 18, ProcessTerminated at 19.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.sources import ProgramSources
from agentfold.domain.ids import TreeID
from agentfold.domain.program import Complete, Continue, Program, Signal, Step, dispatcher_effect
from tests.audit.support import Sql, chain_sources, cli, record_chain, record_demo
from tests.kernel_programs import IMPL, Chain, chain_program


def step_position(step: int) -> int:
    return 2 + 4 * (step - 1)


def same_ref(strategy: Any) -> Program:
    """A test copy of the chain program: the same ProgramRef, a different strategy."""
    original = chain_program()
    copy = Program(original.descriptor, strategy, IMPL, original.configuration_digest, policy=original.policy,
                   dispatcher=original.dispatcher)
    assert copy.ref == original.ref
    return copy


class NewPayloadAtStep3(Chain):
    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        step = super().decide(state, window)
        if state["done"] + len(window) == 2 and isinstance(step.transition, Continue):
            return Step(step.consumed, Continue((dispatcher_effect({"index": 2, "retry": True}),)), step.facts)
        return step


class CompletesAfterTwo(Chain):
    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        done = state["done"] + len(window)
        if done == 2:
            return Step(len(window), Complete({"total": 2, "effects": 2}), {"done": done, "total": 2})
        return super().decide(state, window)


class RaisesAtStep4(Chain):
    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["done"] + len(window) == 3:
            raise RuntimeError("the new rule does not handle a third result")
        return super().decide(state, window)


class EvolveRefusesStep2(Chain):
    def evolve(self, state: Any, facts: Any, consumed: Sequence[Signal]) -> Any:
        if (facts or {}).get("done") == 1:
            raise ValueError("the new state cannot hold one result")
        return super().evolve(state, facts, consumed)


class ShortcutDisagreesWithEvolve(EvolveRefusesStep2):
    """decide hands the kernel its next state; the fold of the facts (evolve) disagrees."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        step = super().decide(state, window)
        return Step(step.consumed, step.transition, step.facts, next_state={**state, **(step.facts or {})})


@pytest.fixture
def chain(durable_store_url: str) -> tuple[str, str]:
    return durable_store_url, str(record_chain(durable_store_url, n=4))


def drift(capsys: pytest.CaptureFixture[str], store: str, tree: str, program: Program | None = None) -> Any:
    sources = chain_sources(program) if program is not None else chain_sources()
    return cli(capsys, "audit", "drift", tree, "--json", "--store", store, sources=sources)


def test_the_recorded_code_shows_no_drift(capsys: pytest.CaptureFixture[str], chain: Any) -> None:
    store, tree = chain
    ran = drift(capsys, store, tree)
    assert ran.code == 0
    report = ran.json()
    assert report == {"tree": tree, "ok": True, "events": 19, "decisions": 5, "first_drift": None, "error": None}


@pytest.mark.parametrize("cut", ["between-steps", "last-event"])
def test_drift_of_a_history_cut_under_its_index_row_is_a_corrupt_store_not_drift(
    capsys: pytest.CaptureFixture[str], chain: Any, cut: str
) -> None:
    """Found by an audit walkthrough: a tail cut between whole Steps said "no drift" (exit 0),
    and with only the last event gone the code was blamed (DRIFT, ProcessTerminated "missing
    from the history"), while show, export and verify refused the tree as corrupt."""
    store, tree = chain
    tree_id = TreeID(tree)
    last = 19
    positions = (last - 1, last) if cut == "between-steps" else (last,)
    sql = Sql(store)
    sql.delete(tree_id, *positions)
    ran = drift(capsys, store, tree)
    assert ran.code == 1 and ran.stdout == "", ran.stdout
    error = ran.error()
    assert (error["code"], error["detail"]["rule"]) == ("store.corrupt", "index.head_mismatch"), error
    assert "events after it were deleted" in error["message"]


def test_a_changed_effect_payload_is_detected_at_its_step(capsys: pytest.CaptureFixture[str], chain: Any) -> None:
    store, tree = chain
    ran = drift(capsys, store, tree, same_ref(NewPayloadAtStep3()))
    assert ran.code == 1
    found = ran.json()["first_drift"]
    assert (found["tree"], found["step"], found["position"]) == (tree, 3, step_position(3))
    assert found["differs_at"] == step_position(3) + 1  # the StepCommitted matches, its EffectDeclared does not
    assert found["path"] == "EffectDeclared.payload.retry"
    assert found["recorded"][1]["body"]["payload"] == {"index": 2}
    assert found["current"][1]["body"]["payload"] == {"index": 2, "retry": True}
    assert ran.json()["decisions"] == 3


def test_a_changed_transition_is_detected_at_its_step(capsys: pytest.CaptureFixture[str], chain: Any) -> None:
    store, tree = chain
    found = drift(capsys, store, tree, same_ref(CompletesAfterTwo())).json()["first_drift"]
    assert (found["step"], found["position"], found["differs_at"]) == (3, step_position(3), step_position(3))
    assert found["path"] == "StepCommitted.effects"
    assert [e["type"] for e in found["current"]] == ["StepCommitted", "ProcessTerminated"]


def test_a_decide_that_now_raises_is_drift_at_its_step(capsys: pytest.CaptureFixture[str], chain: Any) -> None:
    store, tree = chain
    found = drift(capsys, store, tree, same_ref(RaisesAtStep4())).json()["first_drift"]
    assert (found["step"], found["position"]) == (4, step_position(4))
    assert found["path"] == "StepCommitted (the current code records ProcessTerminated)"
    assert found["current"][0]["body"]["failure"]["code"] == "execution.step.failed"


def test_an_evolve_that_refuses_the_recorded_facts_is_drift_at_its_step(
    capsys: pytest.CaptureFixture[str], chain: Any
) -> None:
    store, tree = chain
    ran = drift(capsys, store, tree, same_ref(EvolveRefusesStep2()))
    assert ran.code == 1
    found = ran.json()["first_drift"]
    assert (found["step"], found["position"]) == (2, step_position(2))
    assert "evolve failed" in found["current"][0]["body"]["reason"]


def test_a_history_the_new_evolve_cannot_fold_is_reported_with_its_rule(
    capsys: pytest.CaptureFixture[str], chain: Any
) -> None:
    store, tree = chain
    ran = drift(capsys, store, tree, same_ref(ShortcutDisagreesWithEvolve()))
    assert ran.code == 1
    report = ran.json()
    assert report["first_drift"] is None and report["decisions"] == 2  # the decisions themselves agree
    assert (report["error"]["position"], report["error"]["rule"]) == (step_position(2), "step.evolve")


def test_drift_needs_the_programs_of_the_tree(capsys: pytest.CaptureFixture[str], chain: Any) -> None:
    store, tree = chain
    ran = cli(capsys, "audit", "drift", tree, "--json", "--store", store, sources=ProgramSources())
    assert ran.code == 2 and ran.error()["code"] == "engine.program.unavailable"


def test_drift_text_names_the_step(capsys: pytest.CaptureFixture[str], chain: Any) -> None:
    store, tree = chain
    ran = cli(capsys, "audit", "drift", tree, "--store", store, sources=chain_sources(same_ref(NewPayloadAtStep3())))
    assert ran.code == 1
    assert f"step 3 (position {step_position(3)})" in ran.stdout


def test_an_interaction_run_with_tools_and_a_human_answer_has_no_drift(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    store = f"sqlite:///{tmp_path / 'demo.db'}"
    tree = str(record_demo(tmp_path / "run", store))
    ran = cli(capsys, "audit", "drift", tree, "--json", "--store", store)  # the console script's sources
    assert ran.code == 0, ran.stdout + ran.stderr
    report = ran.json()
    assert report["ok"] is True and report["decisions"] > 10

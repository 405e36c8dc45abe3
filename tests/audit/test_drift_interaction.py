"""`agentfold audit drift` on an Interaction: a changed decision rule is found at its exact Step.

The bundled trip-planner scenario is recorded with the CLI (model call 1 asks for the
weather and a hotel booking, model call 2 for a budget approval that a human answers,
model call 3 gives the final answer). Test copies of its Program are then bound under
the SAME ProgramRef, as a new build of the same program version would be: the scenario
loader builds the recorded Program and swaps in an Interaction strategy whose decision
differs (a ProgramRef covers the descriptor, the implementation label, the
configuration and the child bindings; the strategy object itself is not part of it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.scenario import PROGRAM_NAME, scenario_program
from agentfold.adapters.sources import ProgramSources
from agentfold.domain.ids import TreeID
from agentfold.domain.interaction.interaction import CompletionCandidate, CompletionDecision, InteractionStrategy
from agentfold.domain.program import Checkpoint, Program, Step
from tests.audit.support import Sql, cli, record_demo
from tests.audit.test_verify_interaction import events, step_starting_tool


class BookingNeedsApprovalFirst(InteractionStrategy):
    """The new rule: a ``book_hotel`` call is no longer run; it is answered with an error."""

    def _advance(self, plan: Any) -> Step:
        r = plan.state.round
        if r is not None and r.cursor < len(r.calls) and r.calls[r.cursor].name == "book_hotel":
            plan.add({"op": "reject", "text": 'error: tool "book_hotel" needs an approved budget first'})
            return plan.step(
                Checkpoint("interaction.round.progress", {"model_call_sequence": r.sequence, "results": r.cursor + 1})
            )
        return super()._advance(plan)


def _ask_for_the_price(candidate: CompletionCandidate) -> CompletionDecision:
    return CompletionDecision(False, "Say what the hotel costs.")


def sources_with(change: str, built: list[Program]) -> ProgramSources:
    """The console script's scenario loader, except that the Interaction's strategy is the test copy."""

    def load(document: Any) -> Program:
        program = scenario_program(document)
        recorded: InteractionStrategy = program.strategy  # type: ignore[assignment]
        if change == "tool_admission":
            strategy: InteractionStrategy = BookingNeedsApprovalFirst(recorded.definition)
        else:  # the completion check now rejects the final answer
            definition = dataclasses.replace(recorded.definition, completion_validator=_ask_for_the_price)
            strategy = InteractionStrategy(definition)
        copy = dataclasses.replace(program, strategy=strategy)
        assert copy.ref == program.ref and copy.strategy is not program.strategy
        built.append(copy)
        return copy

    return ProgramSources(loaders={PROGRAM_NAME: load})


def root_steps(sql: Sql, tree_id: TreeID, root: str) -> dict[int, dict[str, Any]]:
    """The root Interaction's StepCommitted bodies by position."""
    return {v: body for v, kind, body in events(sql, tree_id) if kind == "StepCommitted" and body["process_id"] == root}


@pytest.fixture
def demo(tmp_path: Path) -> tuple[str, TreeID]:
    store = f"sqlite:///{tmp_path / 'demo.db'}"
    return store, record_demo(tmp_path / "run", store)


def test_a_tool_call_the_new_rule_no_longer_admits_is_drift_at_the_step_that_started_it(
    capsys: pytest.CaptureFixture[str], demo: tuple[str, TreeID]
) -> None:
    store, tree_id = demo
    sql = Sql(store)
    root = events(sql, tree_id)[0][2]["process_id"]
    booking = step_starting_tool(sql, tree_id, 1, 1)  # the Step that started the book_hotel Tool child
    recorded_step = root_steps(sql, tree_id, root)[booking]
    assert recorded_step["facts"]["ops"][-1] == {"op": "start_batch", "kind": "tool", "request": 1, "size": 1}

    built: list[Program] = []
    ran = cli(capsys, "audit", "drift", str(tree_id), "--json", "--store", store,
              sources=sources_with("tool_admission", built))
    assert ran.code == 1, ran.stdout + ran.stderr
    assert built, "the test copy was not bound"
    report = ran.json()
    assert report["ok"] is False and report["error"] is None
    found = report["first_drift"]
    assert (found["tree"], found["process_id"], found["step"], found["position"]) == (
        str(tree_id), root, recorded_step["step"], booking)
    assert found["differs_at"] == booking  # the StepCommitted itself differs
    assert found["path"] == "StepCommitted.effects"  # the first differing member: no Effect is declared now
    assert [e["type"] for e in found["recorded"]] == ["StepCommitted", "EffectDeclared"]
    assert [e["type"] for e in found["current"]] == ["StepCommitted", "CheckpointCommitted"]
    assert found["current"][0]["body"]["facts"]["ops"][-1]["op"] == "reject"
    # Every earlier decision (the weather call included) was re-decided and agreed.
    assert report["decisions"] == sum(1 for v, kind, _ in events(sql, tree_id) if kind == "StepCommitted" and v <= booking)
    assert report["events"] == booking - 1


def test_a_completion_check_that_now_rejects_the_final_answer_is_drift_at_the_completing_step(
    capsys: pytest.CaptureFixture[str], demo: tuple[str, TreeID]
) -> None:
    store, tree_id = demo
    sql = Sql(store)
    root = events(sql, tree_id)[0][2]["process_id"]
    steps = root_steps(sql, tree_id, root)
    (completing,) = [v for v, body in steps.items() if body["kind"] == "complete"]

    ran = cli(capsys, "audit", "drift", str(tree_id), "--json", "--store", store, sources=sources_with("completion", []))
    assert ran.code == 1, ran.stdout + ran.stderr
    found = ran.json()["first_drift"]
    assert (found["process_id"], found["step"], found["position"], found["differs_at"]) == (
        root, steps[completing]["step"], completing, completing)
    assert found["path"] == "StepCommitted.effects"  # a model call is declared instead of none
    assert [e["type"] for e in found["recorded"]] == ["StepCommitted", "ProcessTerminated"]
    assert [e["type"] for e in found["current"]] == ["StepCommitted", "EffectDeclared"]  # a fourth model call
    ops = found["current"][0]["body"]["facts"]["ops"]
    assert {"op": "user", "text": "Say what the hotel costs."} in ops
    assert ops[-1] == {"op": "model_call", "sequence": 4}


def test_the_recorded_strategy_bound_the_same_way_shows_no_drift(
    capsys: pytest.CaptureFixture[str], demo: tuple[str, TreeID]
) -> None:
    """The control: the same binding path with the recorded strategy re-decides every Step identically."""
    store, tree_id = demo
    built: list[Program] = []

    def load(document: Any) -> Program:
        program = scenario_program(document)
        built.append(program)
        return program

    ran = cli(capsys, "audit", "drift", str(tree_id), "--json", "--store", store,
              sources=ProgramSources(loaders={PROGRAM_NAME: load}))
    assert ran.code == 0, ran.stdout
    assert built and ran.json()["first_drift"] is None

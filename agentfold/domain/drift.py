"""Drift: would the current code decide what a recorded history says it decided? (pure)

A Step's decision is ``decide(state, window)``: the Process's strategy state and its
pending signals, both of which the fold rebuilds exactly from the events before the
Step was recorded. :func:`find_drift` folds a recorded stream with the *current*
Programs and, at every decision point, asks the current ``decide`` again and compares
what the kernel would record (``StepCommitted``, its ``CheckpointCommitted`` or
``EffectDeclared`` events and, for ``complete`` / ``fail``, the ``ProcessTerminated``)
with the events that were recorded, field by field in canonical JSON.

Decision points are every ``StepCommitted`` and every ``ProcessTerminated`` that a
Step produced without a ``StepCommitted`` (a ``decide`` that raised, a refused Step, a
spent steps budget): a failure cause on a running Process with no terminal intent
that no compared decision already covered.

The kernel's own Step path (:class:`~agentfold.domain.kernel.Kernel`) builds the expected
events, with its append hook replaced so that nothing is applied to the tree being
folded: the comparison uses exactly the rules that wrote the history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from agentfold.domain.canonical import JSON, canonical_bytes, value_at
from agentfold.domain.events import (
    EffectDeclared,
    EffectResolved,
    EffectSettled,
    ProcessTerminated,
    StepCommitted,
    TreeEvent,
    event_body,
    event_type,
)
from agentfold.domain.ids import EffectAttemptID, TreeIncarnationID
from agentfold.domain.input_changes import INPUT_PATCH, holds_input_patch, with_whole_input
from agentfold.domain.kernel import Kernel, Progress
from agentfold.domain.program import ProgramResolver
from agentfold.domain.tree import _MISSING, FAILURE_CAUSE, FoldError, ProcessState, TreeState

_FAILURE_CAUSES = frozenset(FAILURE_CAUSE.values())


@dataclass(frozen=True, slots=True)
class Drift:
    """The first decision the current code makes differently from the recorded one."""

    tree_id: str | None
    process_id: str
    step: int
    """The Step number the recorded decision had (committed steps + 1 at that point)."""
    position: int
    """The position of the recorded decision's first event (the decision point)."""
    differs_at: int
    """The position of the first recorded event the current decision does not reproduce."""
    path: str
    """Where the first difference lies, e.g. ``EffectDeclared.payload.index``."""
    recorded: list[dict[str, JSON]]
    current: list[dict[str, JSON]]

    def to_json(self) -> dict[str, JSON]:
        return {
            "tree": self.tree_id,
            "process_id": self.process_id,
            "step": self.step,
            "position": self.position,
            "differs_at": self.differs_at,
            "path": self.path,
            "recorded": self.recorded,
            "current": self.current,
        }


@dataclass(frozen=True, slots=True)
class DriftReport:
    """What a drift check found: the decisions it compared and the first that differs."""

    tree_id: str | None
    events: int
    decisions: int
    drift: Drift | None = None
    error: FoldError | None = None
    """The recorded stream does not fold with the current Programs (e.g. ``step.evolve``)."""

    @property
    def ok(self) -> bool:
        return self.drift is None and self.error is None

    def to_json(self) -> dict[str, JSON]:
        return {
            "tree": self.tree_id,
            "ok": self.ok,
            "events": self.events,
            "decisions": self.decisions,
            "first_drift": self.drift.to_json() if self.drift is not None else None,
            "error": self.error.to_json() if self.error is not None else None,
        }


class _NoIdentities:
    """A Step never draws fresh ids; only dispatch and activation do."""

    def attempt_id(self) -> EffectAttemptID:
        raise AssertionError("deciding a Step needs no attempt id")

    def incarnation_id(self) -> TreeIncarnationID:
        raise AssertionError("deciding a Step needs no incarnation id")


class _DecisionProbe(Kernel):
    """The kernel's Step path with its append hook collecting events instead of applying them."""

    def _emit(self, progress: Progress, event: TreeEvent, next_state: Any = _MISSING) -> None:
        progress.events.append(event)

    def decision(self, process: ProcessState) -> list[TreeEvent]:
        progress = Progress()
        # The kernel's own Step path (budget check, decide, validation, evolve, events):
        # drift is measured against exactly the rules that wrote the history.
        self._run_step(progress, process)
        return progress.events


def event_json(event: TreeEvent) -> dict[str, JSON]:
    """An event as ``{"type", "body"}`` with its stored body (defaults omitted)."""
    return {"type": event_type(event), "body": _canonical(event_body(event))}


def _canonical(value: JSON) -> JSON:
    # Through canonical bytes: tuples become lists and numbers compare as stored.
    return orjson.loads(canonical_bytes(value))


def first_difference(recorded: JSON, current: JSON, path: str = "") -> str | None:
    """The path of the first member where two JSON values differ (None when equal)."""
    if type(recorded) is not type(current) and not (
        isinstance(recorded, (int, float)) and isinstance(current, (int, float))
        and not isinstance(recorded, bool) and not isinstance(current, bool)
    ):
        return path or "$"
    if isinstance(recorded, dict):
        for key in sorted(set(recorded) | set(current)):
            if key not in recorded or key not in current:
                return f"{path}.{key}"
            found = first_difference(recorded[key], current[key], f"{path}.{key}")
            if found is not None:
                return found
        return None
    if isinstance(recorded, list):
        for index, (a, b) in enumerate(zip(recorded, current, strict=False)):
            found = first_difference(a, b, f"{path}[{index}]")
            if found is not None:
                return found
        if len(recorded) != len(current):
            return f"{path}[{min(len(recorded), len(current))}]"
        return None
    return None if recorded == current else (path or "$")


def _inline(event: TreeEvent, settled: dict[str, JSON]) -> TreeEvent:
    """A ``ProcessTerminated`` with its output inline: whether an output is stored by
    reference (``output_of``, schema version 2) or inline (what older releases wrote) is a
    storage form, not a decision, so drift compares both in the inline form."""
    if isinstance(event, ProcessTerminated) and event.output_of is not None and event.output_of.effect_id in settled:
        found, value = value_at(settled[event.output_of.effect_id], event.output_of.path)
        if found:
            return event.model_copy(update={"output": value, "output_of": None})
    return event


def _whole_input(event: TreeEvent, tree: TreeState) -> TreeEvent:
    """An ``EffectDeclared`` with a child's input whole: stored as its changes from an earlier
    child's input (``input_patch``, schema version 2) or whole (older releases, or changes no
    shorter) is a storage form, not a decision, so drift compares both whole."""
    if not isinstance(event, EffectDeclared) or not holds_input_patch(event.target, event.payload):
        return event
    process = tree.processes.get(event.process_id)
    patch = event.payload[INPUT_PATCH]
    base = process.child_keys.get(patch.get("base")) if process is not None and isinstance(patch, dict) else None  # type: ignore[arg-type]
    if base is None:
        return event
    try:
        return event.model_copy(update={"payload": with_whole_input(event.payload, tree.processes[base].input)})
    except ValueError:
        return event


def _compare(
    recorded: Sequence[TreeEvent], current: Sequence[TreeEvent], settled: dict[str, JSON] | None = None,
    tree: TreeState | None = None,
) -> tuple[int, str] | None:
    """(offset, path) of the first recorded event the current decision does not reproduce."""
    if settled is not None:
        recorded = [_inline(e, settled) for e in recorded]
        current = [_inline(e, settled) for e in current]
    if tree is not None:
        recorded = [_whole_input(e, tree) for e in recorded]
        current = [_whole_input(e, tree) for e in current]
    for offset, expected in enumerate(current):
        if offset >= len(recorded):
            return offset, f"{event_type(expected)} (missing from the history)"
        got = recorded[offset]
        if type(got) is not type(expected):
            return offset, f"{event_type(got)} (the current code records {event_type(expected)})"
        a, b = _canonical(event_body(got)), _canonical(event_body(expected))
        if a != b:
            return offset, event_type(got) + (first_difference(a, b) or "")
    return None


def _is_decision_point(tree: TreeState, event: TreeEvent) -> ProcessState | None:
    """The Process whose Step produced ``event``, when the event is a decision's first."""
    process = tree.processes.get(event.process_id)
    if process is None:
        return None
    if isinstance(event, StepCommitted):
        return process
    if (
        isinstance(event, ProcessTerminated)
        and event.cause in _FAILURE_CAUSES
        and process.runnable
        and process.terminal_intent is None
    ):
        return process  # decide raised, the Step was refused, or the steps budget was spent
    return None


def find_drift(
    records: Sequence[tuple[int, TreeEvent]], programs: ProgramResolver, *, tree_id: str | None = None
) -> DriftReport:
    """Fold ``records`` (position, event) with ``programs`` and re-decide every recorded Step.

    Returns at the first decision whose events differ from the recorded ones, or when
    the stream stops folding with the current Programs (``error``, e.g. ``step.evolve``).
    """
    tree = TreeState(programs)
    probe = _DecisionProbe(tree, programs, _NoIdentities())
    settled: dict[str, JSON] = {}  # succeeded results by effect id, to read outputs stored by reference
    decisions = 0
    covered = 0  # records[:covered] belong to decisions already compared
    for index, (position, event) in enumerate(records):
        if index >= covered:
            process = _is_decision_point(tree, event)
            if process is not None:
                current = probe.decision(process)
                recorded = [e for _, e in records[index : index + len(current)]]
                decisions += 1
                found = _compare(recorded, current, settled, tree)
                if found is not None:
                    offset, path = found
                    return DriftReport(
                        tree_id or tree.tree_id,
                        index,
                        decisions,
                        Drift(
                            tree_id or tree.tree_id,
                            str(process.process_id),
                            process.committed_steps + 1,
                            position,
                            position + offset,
                            path,
                            [event_json(e) for e in recorded],
                            [event_json(e) for e in current],
                        ),
                    )
                covered = index + len(current)
        if isinstance(event, (EffectSettled, EffectResolved)) and event.status == "succeeded":
            settled[str(event.effect_id)] = event.payload
        try:
            tree.apply(event, position)
        except FoldError as exc:
            return DriftReport(tree_id or tree.tree_id, index, decisions, error=exc)
    return DriftReport(tree_id or tree.tree_id, len(records), decisions)


__all__ = ["Drift", "DriftReport", "event_json", "find_drift", "first_difference"]

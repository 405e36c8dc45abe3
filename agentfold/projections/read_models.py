"""The rows of the materialized read models, as pure functions of one folded tree cut.

Every host question has two answers that must agree (DESIGN.md "Projections"): the
pure projection of a folded tree and a materialized table kept by a follower. This
module is the bridge: :func:`project_tree` turns a folded tree into the entries a
host reads (the JSON documents ``agentfold ... --json`` and the HTTP API return), and
the follower stores exactly these entries. A query answered from the tables and one
answered by folding therefore return the same bytes.

Tables (columns in docs/read-models.md): one row per run, per open round with settled
results, per Delegate start, per current tool input wait, per InputGate waiting for its answer,
per unknown effect.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentfold.domain.canonical import JSON
from agentfold.domain.ids import EffectID, ProcessID
from agentfold.domain.interaction.state import InteractionState
from agentfold.domain.program import ProgramResolver
from agentfold.domain.tree import TreeState
from agentfold.projections.host_views import (
    delegate_attributions,
    gate_inputs,
    pending_tool_inputs,
    run_summary,
    unknown_effects,
)
from agentfold.projections.settled_results import RoundResults, settled_results

Entry = dict[str, Any]


def round_entry(tree_id: str, r: RoundResults) -> Entry:
    """One open round's SettledResults as hosts read it: the seed's JSON plus its digest."""
    return {
        **r.json_value(),
        "tree_id": tree_id,
        "complete": r.complete,
        "digest": r.digest(),
        "references": [str(r.reference(i)) for i in range(r.call_count)],
    }


def unknown_entries(tree: TreeState, programs: ProgramResolver | None = None) -> list[Entry]:
    """Unknown effects of live Processes, with kind, ToolCallRef and the retained request.

    A terminal Process keeps its unknown effects as evidence (``show`` lists them);
    they cannot be resolved any more, so hosts are not asked about them.
    """
    entries: list[Entry] = []
    for entry in unknown_effects(tree, programs):
        process = tree.processes[ProcessID(str(entry["process_id"]))]
        if process.terminal:
            continue
        record = process.effect(EffectID(str(entry["effect_id"])))
        assert record is not None
        entries.append(
            {
                **entry,
                "start_id": tree.start_id,
                "program": process.program.name,
                "replay": record.replay,
                "attempt_id": record.attempt_id,
                "attempts": record.attempts,
                "payload": record.payload,
            }
        )
    return entries


def run_entry(tree: TreeState) -> Entry:
    """A run: status per Process, root output and failure, usage, and the tree's head."""
    summary = run_summary(tree)
    summary["program"] = tree.root.program.name
    summary["version"] = tree.version
    return summary


def delegate_entries(tree: TreeState) -> list[Entry]:
    """Every Interaction's Delegate attributions, Interactions in creation order."""
    out: list[Entry] = []
    for process in tree.processes.values():
        if not process.has_state or not isinstance(process.state, InteractionState):
            continue
        attributions, _ = delegate_attributions(tree, process.process_id)
        out.extend({"tree_id": tree.tree_id, **a.to_json()} for a in attributions)
    return out


@dataclass(frozen=True, slots=True)
class TreeRows:
    """Everything the read models hold about one tree at one version."""

    tree_id: str
    version: int
    run: Entry
    rounds: list[Entry] = field(default_factory=list)
    delegates: list[Entry] = field(default_factory=list)
    pending: list[Entry] = field(default_factory=list)
    unknown: list[Entry] = field(default_factory=list)
    gates: list[Entry] = field(default_factory=list)

    def to_json(self) -> dict[str, JSON]:
        return {
            "tree_id": self.tree_id,
            "version": self.version,
            "run": self.run,
            "rounds": self.rounds,
            "delegates": self.delegates,
            "pending": self.pending,
            "unknown": self.unknown,
            "gates": self.gates,
        }


def project_tree(tree: TreeState, programs: ProgramResolver | None = None) -> TreeRows:
    """The read-model rows of one folded tree.

    Without bound Programs (``tree`` folded by the kernel alone) there are no
    Interaction states, so only the run, its unknown effects and its InputGates (told by
    their waits) are known.
    """
    tree_id = str(tree.tree_id)
    return TreeRows(
        tree_id=tree_id,
        version=tree.version,
        run=run_entry(tree),
        rounds=[round_entry(tree_id, r) for r in settled_results(tree)],
        delegates=delegate_entries(tree),
        pending=[p.to_json() for p in pending_tool_inputs(tree)],
        unknown=unknown_entries(tree, programs),
        gates=[g.to_json() for g in gate_inputs(tree)],
    )


Projector = Callable[[TreeState, ProgramResolver | None], TreeRows]

__all__ = [
    "Entry",
    "Projector",
    "TreeRows",
    "delegate_entries",
    "project_tree",
    "round_entry",
    "run_entry",
    "unknown_entries",
]

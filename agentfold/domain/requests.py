"""What a dispatcher receives (EffectRequest) and returns (Settlement).

An :class:`EffectRequest` is immutable. ``attempt_id`` is present only for a live
dispatch; a request rebuilt from a folded tree (``effect_request``) has none and
authorizes nothing - hosts use it to build a typed settlement for an unknown Effect.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentfold.domain.canonical import JSON, normalize
from agentfold.domain.errors import InvalidInput, NotFound
from agentfold.domain.ids import ChildKey, EffectAttemptID, EffectID, ProcessID, TreeID, TreeIncarnationID
from agentfold.domain.program import Program, ProgramRef, SettlementStatus
from agentfold.domain.tree import TreeState


@dataclass(frozen=True, slots=True)
class Relation:
    process_id: ProcessID
    parent_id: ProcessID | None
    root_id: ProcessID
    depth: int
    child_key: ChildKey | None

    def to_json(self) -> dict[str, JSON]:
        return {
            "process_id": self.process_id,
            "parent_id": self.parent_id,
            "root_id": self.root_id,
            "depth": self.depth,
            "child_key": self.child_key,
        }


@dataclass(frozen=True, slots=True)
class EffectRequest:
    tree_id: TreeID
    incarnation_id: TreeIncarnationID | None
    program: ProgramRef
    relation: Relation
    step: int
    index: int
    effect_id: EffectID
    attempt_id: EffectAttemptID | None
    payload: JSON
    """The dispatcher payload, expanded from the stored one (see Program.expand_request)."""
    stored_payload: JSON

    def to_json(self) -> dict[str, JSON]:
        return {
            "tree_id": self.tree_id,
            "incarnation_id": self.incarnation_id,
            "program": self.program.to_json(),
            "relation": self.relation.to_json(),
            "step": self.step,
            "index": self.index,
            "effect_id": self.effect_id,
            "attempt_id": self.attempt_id,
            "payload": self.stored_payload,
        }


@dataclass(frozen=True, slots=True)
class Settlement:
    """A dispatcher outcome: succeeded or failed (definite), or unknown."""

    status: SettlementStatus
    payload: JSON = None

    @classmethod
    def succeeded(cls, payload: JSON = None) -> Settlement:
        return cls(SettlementStatus.SUCCEEDED, normalize(payload, what="settlement payload"))

    @classmethod
    def failed(cls, payload: JSON = None) -> Settlement:
        return cls(SettlementStatus.FAILED, normalize(payload, what="settlement payload"))

    @classmethod
    def unknown(cls) -> Settlement:
        return cls(SettlementStatus.UNKNOWN, None)


def effect_request(
    tree: TreeState,
    process_id: ProcessID,
    effect_id: EffectID,
    program: Program | None = None,
    attempt_id: EffectAttemptID | None = None,
) -> EffectRequest:
    """Rebuild the request of an Effect retained in a tree's current batch."""
    process = tree.process(process_id)
    record = process.effect(effect_id) if process is not None else None
    if process is None or record is None:
        raise NotFound("engine.effect.not_pending", f"effect {effect_id} is not retained by process {process_id}")
    if record.target != "dispatcher":
        raise InvalidInput("engine.effect.not_dispatcher", f"effect {effect_id} is a framework effect")
    payload = record.payload
    if program is not None and process.has_state:
        payload = program.expand_request(process.state, record.payload)
    assert tree.tree_id is not None and tree.root_id is not None
    return EffectRequest(
        tree_id=tree.tree_id,
        incarnation_id=tree.incarnation if attempt_id is not None else None,
        program=process.program,
        relation=Relation(process.process_id, process.parent_id, process.root_id, process.depth, process.child_key),
        step=record.step,
        index=record.index,
        effect_id=record.effect_id,
        attempt_id=attempt_id,
        payload=payload,
        stored_payload=record.payload,
    )

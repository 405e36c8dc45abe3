"""A transform: a Program whose one dispatcher Effect calls a function of its input and
completes with what it returns (the Scope ``workflow.Transform`` stage, as a whole Program).

The stored Effect payload is ``{"transform": {}}``: the input is already stored with the
Process's start, and ``expand_transform_request`` puts it back into the request the dispatcher
gets, so history holds it once. The output is stored once too (``OutputOf`` the settlement).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agentfold.domain.canonical import JSON
from agentfold.domain.errors import ClassifiedError, Failure, FailureKind, InvalidInput
from agentfold.domain.json_schema import schema_errors
from agentfold.domain.program import (
    Complete,
    Continue,
    Fail,
    OutputOf,
    Program,
    SettlementStatus,
    Signal,
    Step,
    dispatcher_effect,
)

if TYPE_CHECKING:
    from agentfold.domain.requests import EffectRequest

TRANSFORM_FAILED = "transform.failed"


def _state_error(message: str) -> ClassifiedError:
    return ClassifiedError(FailureKind.CONTRACT, "transform.state.invalid", message)


class TransformStrategy:
    """States: ``{"phase": "start"|"calling", "input": ...}``, then ``{"phase": "done"}``."""

    def initial(self, input: JSON) -> dict[str, Any]:
        return {"phase": "start", "input": input}

    def encode_state(self, state: dict[str, Any]) -> JSON:
        return state

    def decode_state(self, data: JSON) -> dict[str, Any]:
        if not isinstance(data, dict) or data.get("phase") not in ("start", "calling", "done"):
            raise _state_error("not a transform state")
        return data

    def evolve(self, state: dict[str, Any], facts: JSON, consumed: Sequence[Signal]) -> dict[str, Any]:
        phase = (facts or {}).get("phase")
        if phase == "calling":
            return {**state, "phase": "calling"}
        if phase == "done":
            return {"phase": "done"}
        raise _state_error(f"unknown transform fact {facts!r}")

    def decide(self, state: dict[str, Any], window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            return Step(0, Continue((dispatcher_effect({"transform": {}}),)), {"phase": "calling"},
                        next_state={**state, "phase": "calling"})
        settlement = window[0] if window else None
        if phase != "calling" or settlement is None or settlement.status is None or settlement.effect_id is None:
            raise _state_error(f"a transform in phase {phase} expected its settlement")
        done = {"phase": "done"}
        payload = settlement.payload if isinstance(settlement.payload, dict) else {}
        if settlement.status is SettlementStatus.SUCCEEDED and "output" in payload:
            output = payload["output"]
            return Step(1, Complete(output, OutputOf(settlement.effect_id, ("output",))), done, next_state=done)
        if settlement.status is SettlementStatus.FAILED:
            message = payload.get("error") if isinstance(payload.get("error"), str) else "the transform failed"
            return Step(1, Fail(Failure(FailureKind.EXECUTION, TRANSFORM_FAILED, str(message))), done, next_state=done)
        return Step(1, Fail(Failure(FailureKind.CONTRACT, "transform.result.invalid",
                                    'a transform\'s result is {"output": ...}')), done, next_state=done)


def expand_transform_request(state: Any, payload: JSON) -> JSON:
    """The dispatcher's request payload: the stored ``{"transform": {}}`` with the input put back."""
    if isinstance(payload, dict) and isinstance(payload.get("transform"), dict) and isinstance(state, dict):
        return {"transform": {"input": state.get("input")}}
    return payload


def check_transform_resolution(program: Program, request: EffectRequest, status: SettlementStatus, payload: JSON) -> None:
    """``Program.check_resolution`` of a transform: a host's succeeded outcome is
    ``{"output": ...}`` valid by the transform's output schema (else the Process would fail,
    ``transform.result.invalid`` or ``engine.output.invalid``). A failed one fails the Process
    with ``transform.failed``, as the function raising would: not checked."""
    if status is not SettlementStatus.SUCCEEDED:
        return
    if not isinstance(payload, dict) or set(payload) != {"output"}:
        raise InvalidInput("engine.effect.settlement_invalid",
                           f'a transform\'s outcome is {{"output": ...}}, what its function returned, not {payload!s:.200}',
                           hint="agentfold resolve EFFECT --output JSON (docs/team.md)")
    problems = schema_errors(payload["output"], program.descriptor.output_schema)
    if problems:
        raise InvalidInput("engine.effect.settlement_invalid",
                           f"the output is not what transform {program.descriptor.name} returns (its output schema): "
                           + "; ".join(problems[:3]),
                           hint="give the value the function returned, or resolve the call as failed with the error's text")


__all__ = ["TRANSFORM_FAILED", "TransformStrategy", "check_transform_resolution", "expand_transform_request"]

"""Coordination programs (the Scope ``coordination`` package; spec section 8.4).

**InputGate**: a Program that waits for one external answer. Its input is the request
(validated by ``request_schema``); its first Step declares a wait with key
``coordination.input`` whose prompt is the request and whose ``response_schema`` is the answer
schema (a bad answer is refused at admission, so it is never committed); it then waits. The one
answer addressed to that wait completes it with the answer Signal itself,
``{"id", "wait_id", "payload"}``, so its identity survives. An answer admitted after the wait
was declared but before the Process adopted it is honoured in the same Step; a duplicate is
deduplicated by the mailbox. Used as a team worker, its answer wakes a waiting collaboration;
re-arm a new gate for each further answer.

**Deadline**: a Program that completes at an absolute instant (its input, RFC 3339 with an
offset), with that instant as its output. Its one dispatcher Effect is the timer
(``adapters.team.DeadlineDispatcher``), replayed under the same identity on recovery, so a
crash never moves the instant. As a team worker or a FirstSuccess candidate it bounds how long
the others may take.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentfold.domain.canonical import JSON
from agentfold.domain.errors import ClassifiedError, Failure, FailureKind, InvalidInput
from agentfold.domain.ids import WaitKey
from agentfold.domain.json_schema import check_schema, schema_errors
from agentfold.domain.program import (
    Complete,
    Continue,
    Descriptor,
    Effect,
    EffectPolicy,
    Fail,
    Replay,
    SettlementStatus,
    Signal,
    Step,
    Target,
    Wait,
    dispatcher_effect,
    wait_effect,
)

INPUT_WAIT_KEY = "coordination.input"
PROTOCOL_INVALID = "coordination.protocol.invalid"
DEFINITION_INVALID = "coordination.definition.invalid"

GATE_OUTPUT_SCHEMA: JSON = {
    "type": "object",
    "required": ["id", "wait_id", "payload"],
    "additionalProperties": False,
    "properties": {"id": {"type": "string"}, "wait_id": {"type": "string"}, "payload": True},
}


def _protocol(message: str) -> ClassifiedError:
    return ClassifiedError(FailureKind.CONTRACT, PROTOCOL_INVALID, message)


def _is_opening(signal: Signal) -> bool:
    return (signal.engine_owned and isinstance(signal.payload, dict)
            and signal.payload.get("operation") == "wait" and signal.payload.get("key") == INPUT_WAIT_KEY)


class InputGateStrategy:
    """decide/evolve of an InputGate Process. States: ``start`` (with the request),
    ``opening``, ``waiting`` (with its wait id), ``completed`` (nothing else kept)."""

    def __init__(self, name: str, description: str, request_schema: JSON, answer_schema: JSON) -> None:
        if answer_schema is None:
            raise InvalidInput(DEFINITION_INVALID, "an InputGate needs an answer_schema",
                               hint="give the JSON schema every answer must match (True accepts any JSON)")
        try:
            check_schema(answer_schema, "#answer")
        except InvalidInput as exc:
            raise InvalidInput(DEFINITION_INVALID, f"the answer schema is invalid: {exc.message}") from exc
        self.descriptor = Descriptor(name, description, request_schema, GATE_OUTPUT_SCHEMA, None)
        self.answer_schema = answer_schema

    def initial(self, input: JSON) -> dict[str, Any]:
        return {"phase": "start", "request": input}

    def encode_state(self, state: dict[str, Any]) -> JSON:
        return state

    def decode_state(self, data: JSON) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise ClassifiedError(FailureKind.CONTRACT, "coordination.state.invalid", "an InputGate state is an object")
        phase = data.get("phase")
        keys = {"start": {"phase", "request"}, "opening": {"phase"}, "waiting": {"phase", "wait_id"},
                "completed": {"phase"}}.get(phase)  # type: ignore[arg-type]
        if keys is None or set(data) != keys or (phase == "waiting" and not isinstance(data["wait_id"], str)):
            raise ClassifiedError(FailureKind.CONTRACT, "coordination.state.invalid",
                                  f"not an InputGate state: {sorted(data)} in phase {phase!r}")
        return data

    def evolve(self, state: dict[str, Any], facts: JSON, consumed: Sequence[Signal]) -> dict[str, Any]:
        phase = (facts or {}).get("phase")
        if phase == "opening":
            return {"phase": "opening"}
        if phase == "waiting":
            opening = next(s for s in consumed if _is_opening(s))
            return {"phase": "waiting", "wait_id": opening.wait_id}
        if phase == "completed":
            return {"phase": "completed"}
        raise ClassifiedError(FailureKind.CONTRACT, "coordination.state.invalid", f"unknown InputGate fact {facts!r}")

    def decide(self, state: dict[str, Any], window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            if window:
                raise _protocol(f"signal {window[0].id} arrived before the gate opened its wait")
            effect = wait_effect(WaitKey(INPUT_WAIT_KEY), prompt=state["request"], response_schema=self.answer_schema)
            return Step(0, Continue((effect,)), {"phase": "opening"}, next_state={"phase": "opening"})
        if phase == "opening":
            if not window or not _is_opening(window[0]):
                raise _protocol("the gate expected the opening of its input wait")
            wait_id = window[0].wait_id
            assert wait_id is not None
            if len(window) > 1 and not window[1].engine_owned and window[1].wait_id == wait_id:
                # An answer admitted before the gate adopted its wait: honoured in the same Step.
                return self._complete(window[:2], window[1])
            return Step(1, Wait(wait_id), {"phase": "waiting"}, next_state={"phase": "waiting", "wait_id": wait_id})
        if phase == "waiting":
            if not window:
                raise _protocol("the gate was scheduled without an answer")
            answer = window[0]
            if answer.engine_owned or answer.wait_id != state["wait_id"]:
                raise _protocol(f"signal {answer.id} is not an answer to the gate's wait {state['wait_id']}")
            return self._complete(window[:1], answer)
        raise ClassifiedError(FailureKind.CONTRACT, "coordination.state.invalid", "a completed gate takes no Steps")

    def _complete(self, consumed: Sequence[Signal], answer: Signal) -> Step:
        problems = schema_errors(answer.payload, self.answer_schema)
        if problems:
            raise _protocol(f"answer {answer.id} does not match the answer schema: {'; '.join(problems[:3])}")
        output = {"id": str(answer.id), "wait_id": str(answer.wait_id), "payload": answer.payload}
        return Step(len(consumed), Complete(output), {"phase": "completed"}, next_state={"phase": "completed"})




# ---------------------------------------------------------------------------
# Deadline


DEADLINE_INTERRUPTED = "coordination.deadline.interrupted"

DEADLINE_SCHEMA: JSON = {"type": "string", "format": "date-time", "minLength": 1}


def parse_instant(value: Any) -> str:
    """An absolute instant in its canonical text: RFC 3339 with an offset, given in UTC
    (``2026-12-03T06:00:00Z``, microseconds kept when present). A time without an offset is
    refused: it names no instant."""
    from datetime import UTC, datetime

    if not isinstance(value, str):
        raise InvalidInput("input.invalid", f"a deadline is an RFC 3339 time, got {type(value).__name__}")
    try:
        instant = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidInput("input.invalid", f"deadline {value[:80]!r} is not an RFC 3339 time",
                           hint="e.g. 2026-12-03T06:00:00Z or 2026-12-03T07:00:00+01:00") from None
    if instant.tzinfo is None or instant.utcoffset() is None:
        raise InvalidInput("input.invalid", f"deadline {value[:80]!r} has no UTC offset: it names no instant",
                           hint="add Z or an offset such as +01:00")
    text = instant.astimezone(UTC).isoformat()
    return text.removesuffix("+00:00") + "Z"


def _is_timer_settlement(signal: Signal) -> bool:
    return signal.engine_owned and signal.wait_id is None and signal.status is not None


class DeadlineStrategy:
    """decide/evolve of a Deadline Process: its input is an absolute instant; its first Step
    declares one dispatcher Effect ``{"deadline": instant}`` (the timer; replay policy
    ``same_identity``, so recovery waits again for the same instant rather than restarting a
    delay); a succeeded settlement completes it with the instant, a failed one (the timer was
    stopped, e.g. by a cancel) fails it with ``coordination.deadline.interrupted``. The Step
    never reads the clock. States: ``{"deadline", "phase"}``, phase ``ready``,
    ``awaiting_timer``, ``completed`` or ``interrupted``."""

    def __init__(self, name: str, description: str) -> None:
        self.descriptor = Descriptor(name, description, DEADLINE_SCHEMA, DEADLINE_SCHEMA, None)

    def initial(self, input: JSON) -> dict[str, Any]:
        return {"deadline": parse_instant(input), "phase": "ready"}

    def encode_state(self, state: dict[str, Any]) -> JSON:
        return state

    def decode_state(self, data: JSON) -> dict[str, Any]:
        if (not isinstance(data, dict) or set(data) != {"deadline", "phase"}
                or data["phase"] not in ("ready", "awaiting_timer", "completed", "interrupted") or not isinstance(data["deadline"], str)):
            raise ClassifiedError(FailureKind.CONTRACT, "coordination.state.invalid", f"not a Deadline state: {data!r}"[:300])
        return data

    def evolve(self, state: dict[str, Any], facts: JSON, consumed: Sequence[Signal]) -> dict[str, Any]:
        phase = (facts or {}).get("phase") if isinstance(facts, dict) else None
        if phase not in ("awaiting_timer", "completed", "interrupted"):
            raise ClassifiedError(FailureKind.CONTRACT, "coordination.state.invalid", f"unknown Deadline fact {facts!r}")
        return {"deadline": state["deadline"], "phase": phase}

    def decide(self, state: dict[str, Any], window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "ready":
            if window:
                raise _protocol(f"signal {window[0].id} arrived before the deadline set its timer")
            facts = {"phase": "awaiting_timer"}
            return Step(0, Continue((dispatcher_effect({"deadline": state["deadline"]}),)), facts,
                        next_state=self.evolve(state, facts, ()))
        if phase == "awaiting_timer":
            if len(window) != 1 or not _is_timer_settlement(window[0]):
                raise _protocol("the deadline expected one settlement of its timer")
            if window[0].status != SettlementStatus.SUCCEEDED:
                return Step(1, Fail(Failure(FailureKind.EXTERNAL, DEADLINE_INTERRUPTED,
                                            f"the timer for {state['deadline']} returned before its deadline")),
                            {"phase": "interrupted"}, next_state={"deadline": state["deadline"], "phase": "interrupted"})
            facts = {"phase": "completed"}
            return Step(1, Complete(state["deadline"]), facts, next_state=self.evolve(state, facts, window))
        raise ClassifiedError(FailureKind.CONTRACT, "coordination.state.invalid", f"a deadline in phase {phase!r} takes no more Steps")


def deadline_policy(effect: Effect) -> EffectPolicy:
    """A timer for an absolute instant may be waited for again under the same identity: it
    has no external side effect. Anything else is never replayed."""
    payload = effect.payload
    if effect.target is Target.DISPATCHER and isinstance(payload, dict) and set(payload) == {"deadline"}:
        try:
            parse_instant(payload["deadline"])
        except InvalidInput:
            return EffectPolicy()
        return EffectPolicy(Replay.SAME_IDENTITY)
    return EffectPolicy()


__all__ = [
    "DEADLINE_INTERRUPTED",
    "DEADLINE_SCHEMA",
    "GATE_OUTPUT_SCHEMA",
    "INPUT_WAIT_KEY",
    "DeadlineStrategy",
    "InputGateStrategy",
    "deadline_policy",
    "parse_instant",
]

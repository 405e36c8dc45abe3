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

import re
from collections.abc import Sequence
from typing import Any

from agentfold.domain.canonical import JSON
from agentfold.domain.errors import ClassifiedError, Failure, FailureKind, InvalidInput
from agentfold.domain.ids import WaitKey
from agentfold.domain.json_schema import accepts_nothing, check_schema, schema_errors
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
    check_description,
    dispatcher_effect,
    wait_effect,
)

INPUT_WAIT_KEY = "coordination.input"
PROTOCOL_INVALID = "coordination.protocol.invalid"
DEFINITION_INVALID = "coordination.definition.invalid"
STATE_INVALID = "coordination.state.invalid"
INPUT_INVALID = "coordination.input.invalid"

GATE_OUTPUT_SCHEMA: JSON = {
    "type": "object",
    "required": ["id", "wait_id", "payload"],
    "additionalProperties": False,
    "properties": {"id": {"type": "string"}, "wait_id": {"type": "string"}, "payload": True},
}


def protocol_error(message: str) -> ClassifiedError:
    return ClassifiedError(FailureKind.CONTRACT, PROTOCOL_INVALID, message)


def state_error(message: str) -> ClassifiedError:
    return ClassifiedError(FailureKind.CONTRACT, STATE_INVALID, message)


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
        if accepts_nothing(answer_schema):
            raise InvalidInput(DEFINITION_INVALID, "the answer schema accepts no answer: the gate could only be canceled",
                               hint="give the JSON schema every answer must match (True accepts any JSON)")
        try:
            check_schema(request_schema, "#input")
        except InvalidInput as exc:
            raise InvalidInput(DEFINITION_INVALID, f"the request schema is invalid: {exc.message}",
                               hint="give the JSON schema every request must match (True accepts any JSON)") from exc
        check_description(description, f"the description of InputGate {name!r}", DEFINITION_INVALID)
        self.descriptor = Descriptor(name, description, request_schema, GATE_OUTPUT_SCHEMA, None)
        self.answer_schema = answer_schema

    def initial(self, input: JSON) -> dict[str, Any]:
        return {"phase": "start", "request": input}

    def encode_state(self, state: dict[str, Any]) -> JSON:
        return state

    def decode_state(self, data: JSON) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise state_error("an InputGate state is an object")
        phase = data.get("phase")
        keys = {"start": {"phase", "request"}, "opening": {"phase"}, "waiting": {"phase", "wait_id"},
                "completed": {"phase"}}.get(phase)  # type: ignore[arg-type]
        if keys is None or set(data) != keys or (phase == "waiting" and not isinstance(data["wait_id"], str)):
            raise state_error(f"not an InputGate state: {sorted(data)} in phase {phase!r}")
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
        raise state_error(f"unknown InputGate fact {facts!r}")

    def decide(self, state: dict[str, Any], window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            if window:
                raise protocol_error(f"signal {window[0].id} arrived before the gate opened its wait")
            effect = wait_effect(WaitKey(INPUT_WAIT_KEY), prompt=state["request"], response_schema=self.answer_schema)
            return Step(0, Continue((effect,)), {"phase": "opening"}, next_state={"phase": "opening"})
        if phase == "opening":
            if not window or not _is_opening(window[0]):
                raise protocol_error("the gate expected the opening of its input wait")
            wait_id = window[0].wait_id
            assert wait_id is not None
            if len(window) > 1 and not window[1].engine_owned and window[1].wait_id == wait_id:
                # An answer admitted before the gate adopted its wait: honoured in the same Step.
                return self._complete(window[:2], window[1])
            return Step(1, Wait(wait_id), {"phase": "waiting"}, next_state={"phase": "waiting", "wait_id": wait_id})
        if phase == "waiting":
            if not window:
                raise protocol_error("the gate was scheduled without an answer")
            answer = window[0]
            if answer.engine_owned or answer.wait_id != state["wait_id"]:
                raise protocol_error(f"signal {answer.id} is not an answer to the gate's wait {state['wait_id']}")
            return self._complete(window[:1], answer)
        raise state_error("a completed gate takes no Steps")

    def _complete(self, consumed: Sequence[Signal], answer: Signal) -> Step:
        problems = schema_errors(answer.payload, self.answer_schema)
        if problems:
            raise protocol_error(f"answer {answer.id} does not match the answer schema: {'; '.join(problems[:3])}")
        output = {"id": str(answer.id), "wait_id": str(answer.wait_id), "payload": answer.payload}
        return Step(len(consumed), Complete(output), {"phase": "completed"}, next_state={"phase": "completed"})




# ---------------------------------------------------------------------------
# Deadline


DEADLINE_INTERRUPTED = "coordination.deadline.interrupted"

DEADLINE_SCHEMA: JSON = {"type": "string", "format": "date-time", "minLength": 1}


_INSTANT = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(?:([Zz])|([+-])(\d{2}):(\d{2}))"
)
_INSTANT_HINT = "e.g. 2026-12-03T06:00:00Z or 2026-12-03T07:00:00+01:00 (RFC 3339, with Z or an offset)"


def _days_from_civil(year: int, month: int, day: int) -> int:
    """Days from 1970-01-01 to a proleptic Gregorian date (pure integer arithmetic)."""
    year -= month <= 2
    era = year // 400
    yoe = year - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    return era * 146097 + yoe * 365 + yoe // 4 - yoe // 100 + doy - 719468


def _civil_from_days(days: int) -> tuple[int, int, int]:
    days += 719468
    era = days // 146097
    doe = days - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + (3 if mp < 10 else -9)
    return yoe + era * 400 + (month <= 2), month, day


def _days_in_month(year: int, month: int) -> int:
    if month == 2:
        return 29 if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0) else 28
    return 30 if month in (4, 6, 9, 11) else 31


def _instant(value: Any) -> tuple[int, str]:
    """(whole seconds since 1970-01-01T00:00:00Z, the fraction's digits) of an RFC 3339 time."""
    def refuse(why: str) -> InvalidInput:
        return InvalidInput(INPUT_INVALID, f"deadline {str(value)[:80]!r} {why}", hint=_INSTANT_HINT)

    if not isinstance(value, str):
        raise InvalidInput(INPUT_INVALID, f"a deadline is an RFC 3339 time, got {type(value).__name__}", hint=_INSTANT_HINT)
    match = _INSTANT.fullmatch(value)
    if match is None:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?", value):
            raise refuse("has no UTC offset: it names no instant")
        raise refuse("is not an RFC 3339 time (YYYY-MM-DDTHH:MM:SS[.fraction] then Z or +HH:MM)")
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    fraction = (match.group(7) or "").rstrip("0")
    if not (1 <= month <= 12 and 1 <= day <= _days_in_month(year, month)):
        raise refuse("names no calendar date")
    if second == 60:
        raise refuse("is a leap second, which cannot be waited for here: use :59 or the next minute")
    if hour > 23 or minute > 59 or second > 59:
        raise refuse("names no time of day")
    offset = 0
    if match.group(9):
        off_hours, off_minutes = int(match.group(10)), int(match.group(11))
        if off_hours > 23 or off_minutes > 59:
            raise refuse("has an offset out of range")
        offset = (off_hours * 3600 + off_minutes * 60) * (1 if match.group(9) == "+" else -1)
    seconds = _days_from_civil(year, month, day) * 86400 + hour * 3600 + minute * 60 + second - offset
    if not _days_from_civil(0, 1, 1) * 86400 <= seconds < _days_from_civil(10000, 1, 1) * 86400:
        raise refuse("is out of range once given in UTC (years 0000 to 9999)")
    return seconds, fraction


def parse_instant(value: Any) -> str:
    """An absolute instant in its canonical text: RFC 3339 given in UTC, ``Z``-suffixed, its
    fraction kept to the digit (trailing zeros dropped): ``2026-12-03T07:00:00.50+01:00`` is
    ``2026-12-03T06:00:00.5Z``. A time without an offset (it names no instant), a leap second,
    an impossible date and other ISO 8601 forms are refused (``coordination.input.invalid``)."""
    seconds, fraction = _instant(value)
    days, rest = divmod(seconds, 86400)
    year, month, day = _civil_from_days(days)
    text = f"{year:04d}-{month:02d}-{day:02d}T{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return text + (f".{fraction}" if fraction else "") + "Z"


def instant_seconds(value: str) -> float:
    """Seconds since 1970-01-01T00:00:00Z of an RFC 3339 time (as ``time.time()`` counts them)."""
    seconds, fraction = _instant(value)
    return seconds + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


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
        check_description(description, f"the description of Deadline {name!r}", DEFINITION_INVALID)
        self.descriptor = Descriptor(name, description, DEADLINE_SCHEMA, DEADLINE_SCHEMA, None)

    def initial(self, input: JSON) -> dict[str, Any]:
        return {"deadline": parse_instant(input), "phase": "ready"}

    def encode_state(self, state: dict[str, Any]) -> JSON:
        return state

    def decode_state(self, data: JSON) -> dict[str, Any]:
        if (not isinstance(data, dict) or set(data) != {"deadline", "phase"}
                or data["phase"] not in ("ready", "awaiting_timer", "completed", "interrupted") or not isinstance(data["deadline"], str)):
            raise state_error(f"not a Deadline state: {data!r}"[:300])
        try:
            canonical = parse_instant(data["deadline"])
        except InvalidInput:
            canonical = None
        if canonical != data["deadline"]:
            raise state_error(f"a Deadline state's instant {data['deadline'][:80]!r} is not one in canonical form")
        return data

    def evolve(self, state: dict[str, Any], facts: JSON, consumed: Sequence[Signal]) -> dict[str, Any]:
        phase = (facts or {}).get("phase") if isinstance(facts, dict) else None
        if phase not in ("awaiting_timer", "completed", "interrupted"):
            raise state_error(f"unknown Deadline fact {facts!r}")
        return {"deadline": state["deadline"], "phase": phase}

    def decide(self, state: dict[str, Any], window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "ready":
            if window:
                raise protocol_error(f"signal {window[0].id} arrived before the deadline set its timer")
            facts = {"phase": "awaiting_timer"}
            return Step(0, Continue((dispatcher_effect({"deadline": state["deadline"]}),)), facts,
                        next_state=self.evolve(state, facts, ()))
        if phase == "awaiting_timer":
            if len(window) != 1 or not _is_timer_settlement(window[0]):
                raise protocol_error("the deadline expected one settlement of its timer")
            transition: Complete | Fail = Complete(state["deadline"])
            facts = {"phase": "completed"}
            if window[0].status != SettlementStatus.SUCCEEDED:
                transition = Fail(Failure(FailureKind.EXTERNAL, DEADLINE_INTERRUPTED,
                                          f"the timer for {state['deadline']} returned before its deadline"))
                facts = {"phase": "interrupted"}
            return Step(1, transition, facts, next_state=self.evolve(state, facts, window))
        raise state_error(f"a deadline in phase {phase!r} takes no more Steps")


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
    "DEFINITION_INVALID",
    "GATE_OUTPUT_SCHEMA",
    "INPUT_INVALID",
    "INPUT_WAIT_KEY",
    "PROTOCOL_INVALID",
    "STATE_INVALID",
    "DeadlineStrategy",
    "InputGateStrategy",
    "deadline_policy",
    "instant_seconds",
    "parse_instant",
    "protocol_error",
    "state_error",
]

"""The team: decision-driven multi-agent work as a decide/evolve Strategy (the Scope
``team`` / collaboration package; scope-interaction-team-agentrun.md section 8).

A coordinator Program consumes a **Turn** and returns a **Decision**; configured workers run
ordinary inputs and outputs. Both are exact Programs of any Strategy, started as child
Processes: turn n is the child ``collaboration.turn.<n>``, a task is the child named by its key.
Per Step, the collaboration starts a turn, opens one child wait (boundary drained, condition
any) over the running coordinator and every running task, records what drained, and when the
coordinator has decided, validates the whole Decision before it declares anything: child starts
for new tasks, signal and cancel controls for started ones. ``continue`` runs the next turn
beside running tasks; ``wait`` first waits for a task to drain, unless an outcome already
arrived while the coordinator ran (it is new to the next turn). A present ``output`` completes
the collaboration; the kernel then cancels every running task.

State: a JSON object (``phase``, the turn ``number``, the working ``state``, ``tasks`` with
their start and outcome, the previous Decision's ``controls`` with their receipts, ...).
Facts: ``{"ops": [...]}``; an op that records what a signal brought names no values, the fold
reads them from the consumed signal (a task's outcome, a Decision), so history holds each
once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentfold.domain.budget import MAX_COUNTER, Budget, Quota
from agentfold.domain.canonical import JSON
from agentfold.domain.errors import ClassifiedError, Failure, FailureKind, InvalidInput
from agentfold.domain.ids import ChildKey, ProcessID, SignalID, WaitKey
from agentfold.domain.json_schema import schema_errors
from agentfold.domain.program import (
    Boundary,
    ChildSpec,
    ChildWaitSpec,
    Complete,
    Continue,
    Descriptor,
    Effect,
    Fail,
    Program,
    Signal,
    SignalRequest,
    Step,
    Transition,
    Wait,
    cancel_child_effect,
    check_reason,
    signal_child_effect,
    start_child_effect,
    wait_children_effect,
)

TURN_KEY_PREFIX = "collaboration.turn."
WAIT_KEY_PREFIX = "collaboration.wait."

_ANY: JSON = True

TURN_SCHEMA: JSON = {
    "type": "object",
    "required": ["number", "state", "workers", "tasks", "controls"],
    "additionalProperties": False,
    "properties": {
        "number": {"type": "integer", "minimum": 1},
        "state": _ANY,
        "workers": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "description", "input_schema", "output_schema"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "input_schema": _ANY,
                    "output_schema": _ANY,
                },
            },
        },
        "tasks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["request"],
                "additionalProperties": False,
                "properties": {
                    "request": {
                        "type": "object",
                        "required": ["key", "worker", "input"],
                        "additionalProperties": False,
                        "properties": {"key": {"type": "string"}, "worker": {"type": "string"}, "input": _ANY},
                    },
                    "start": {"type": "object"},
                    "outcome": {"type": "object"},
                },
            },
        },
        "controls": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["control"],
                "additionalProperties": False,
                "properties": {"control": {"type": "object"}, "result": {"type": "object"}},
            },
        },
    },
}
"""The coordinator's input contract: a coordinator Program's ``input_schema`` must be exactly this."""

DECISION_SCHEMA: JSON = {
    "type": "object",
    "required": ["mode", "state"],
    "additionalProperties": False,
    "properties": {
        "mode": {"enum": ["", "continue", "wait"]},
        "state": _ANY,
        "tasks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "worker", "input"],
                "additionalProperties": False,
                "properties": {"key": {"type": "string"}, "worker": {"type": "string"}, "input": _ANY},
            },
        },
        "controls": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["task"],
                "additionalProperties": False,
                "properties": {
                    "task": {"type": "string"},
                    "signal": {
                        "type": "object",
                        "required": ["id", "payload"],
                        "additionalProperties": False,
                        "properties": {"id": {"type": "string"}, "payload": _ANY, "wait_id": {"type": ["string", "null"]}},
                    },
                    "cancel_reason": {"type": "string"},
                },
            },
        },
        "output": _ANY,
    },
}
"""The coordinator's output contract: a coordinator Program's ``output_schema`` must be exactly this."""

DEFINITION_INVALID = "collaboration.definition.invalid"
DECISION_INVALID = "collaboration.decision.invalid"
STATE_INVALID = "collaboration.state.invalid"
PROTOCOL_INVALID = "collaboration.protocol.invalid"
TURN_LIMIT = "collaboration.limit.turns"
COORDINATOR_UNRESOLVED = "collaboration.coordinator.unresolved_effects"

PHASES = ("ready", "starting_turn", "opening", "waiting", "applying", "completed", "failed")


@dataclass(frozen=True, eq=False)
class Member:
    """One bound participant (Scope's WorkerConfig): its exact Program, the budget granted to
    each of its child Processes (debited from the collaboration's, never refunded) and the
    capabilities they get."""

    program: Program
    budget: Budget = field(default_factory=Budget)
    capabilities: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        return self.program.descriptor.name

    def descriptor_json(self) -> dict[str, JSON]:
        d = self.program.descriptor
        return {"name": d.name, "description": d.description, "input_schema": d.input_schema,
                "output_schema": d.output_schema}


def _definition_error(message: str, hint: str = "") -> InvalidInput:
    return InvalidInput(DEFINITION_INVALID, message, hint=hint)


@dataclass(frozen=True, eq=False)
class TeamDefinition:
    """Immutable collaboration behaviour (the seed's DefinitionConfig), validated on construction."""

    name: str
    coordinator: Member
    workers: tuple[Member, ...]
    description: str = ""
    state_schema: JSON = True
    output_schema: JSON = True
    max_turns: Quota = field(default_factory=Quota)
    max_tasks: Quota = field(default_factory=Quota)
    max_concurrent_tasks: int = 4
    max_controls_per_turn: int = 4

    def __post_init__(self) -> None:
        if self.max_turns.maximum == 0:
            raise _definition_error("max_turns is 0: the collaboration could never run its first turn",
                                    hint="leave it unlimited (None) or allow at least one turn")
        for name in ("max_concurrent_tasks", "max_controls_per_turn"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_COUNTER:
                # (above 2^63-1 the configuration digest's JSON raised a bare TypeError)
                raise _definition_error(f"{name} is {value!r}; it must be an integer from 1 to {MAX_COUNTER}")
        if not self.workers:
            raise _definition_error("a team needs at least one worker", hint="give workers=[TeamMember(program), ...]")
        seen: set[str] = set()
        for worker in self.workers:
            if worker.name in seen:
                raise _definition_error(f"two workers are named {worker.name!r}",
                                        hint="worker names (their Programs' descriptor names) must be unique")
            seen.add(worker.name)
        d = self.coordinator.program.descriptor
        if d.input_schema != TURN_SCHEMA or d.output_schema != DECISION_SCHEMA:
            raise _definition_error(
                f"the coordinator {d.name!r} must take exactly TURN_SCHEMA and return exactly DECISION_SCHEMA",
                hint="build it with input_schema=TURN_SCHEMA and output_schema=DECISION_SCHEMA "
                     "(agentfold.adapters.team)",
            )

    def worker(self, name: str) -> Member | None:
        for worker in self.workers:
            if worker.name == name:
                return worker
        return None

    def descriptor(self) -> Descriptor:
        # No signal schema: the collaboration accepts no unaddressed host input.
        return Descriptor(self.name, self.description, self.state_schema, self.output_schema, None)

    def child_programs(self) -> tuple[Program, ...]:
        programs = [self.coordinator.program]
        for worker in self.workers:
            if all(worker.program is not p for p in programs):
                programs.append(worker.program)
        return tuple(programs)

    def to_json(self) -> dict[str, JSON]:
        """The configuration the Program's digest covers (Programs by their refs)."""

        def member(m: Member) -> dict[str, JSON]:
            return {"program": str(m.program.ref), "budget": m.budget.to_json(),
                    "capabilities": sorted(m.capabilities)}

        return {
            "coordinator": member(self.coordinator),
            "workers": [member(w) for w in self.workers],
            "max_turns": self.max_turns.maximum,
            "max_tasks": self.max_tasks.maximum,
            "max_concurrent_tasks": self.max_concurrent_tasks,
            "max_controls_per_turn": self.max_controls_per_turn,
        }


# ---------------------------------------------------------------------------
# Signals the collaboration consumes


def is_child_start(signal: Signal) -> bool:
    return (signal.engine_owned and signal.wait_id is None and signal.status is None
            and isinstance(signal.payload, dict) and "key" in signal.payload)


def _is_control_receipt(signal: Signal) -> bool:
    return (signal.engine_owned and signal.wait_id is None and signal.status is None
            and isinstance(signal.payload, dict) and "child" in signal.payload)


def is_wait_opened(signal: Signal) -> bool:
    return (signal.engine_owned and isinstance(signal.payload, dict)
            and signal.payload.get("operation") == "wait_children")


def is_satisfied(signal: Signal) -> bool:
    return (signal.engine_owned and signal.wait_id is not None and isinstance(signal.payload, dict)
            and signal.payload.get("operation") == "child_wait_satisfied")


def state_error(message: str) -> ClassifiedError:
    return ClassifiedError(FailureKind.CONTRACT, STATE_INVALID, message)


def protocol_error(message: str) -> ClassifiedError:
    return ClassifiedError(FailureKind.CONTRACT, PROTOCOL_INVALID, message)


# ---------------------------------------------------------------------------
# State


def _running(task: Mapping[str, Any]) -> bool:
    start = task.get("start")
    return isinstance(start, dict) and "process_id" in start and "outcome" not in task


def _process_of(task: Mapping[str, Any]) -> str | None:
    if "outcome" in task:
        return str(task["outcome"]["process_id"])
    start = task.get("start")
    if isinstance(start, dict) and "process_id" in start:
        return str(start["process_id"])
    return None


def _coordinator_outcome(consumed: Sequence[Signal], coordinator: str | None) -> dict[str, Any] | None:
    for signal in consumed:
        if is_satisfied(signal):
            for outcome in signal.payload["outcomes"]:
                if outcome["process_id"] == coordinator:
                    return outcome  # type: ignore[no-any-return]
    return None


def _only(consumed: Sequence[Signal], predicate: Callable[[Signal], bool], what: str) -> Signal:
    for signal in consumed:
        if predicate(signal):
            return signal
    raise state_error(f"the step consumed no {what}")


def apply_op(state: dict[str, Any], op: Mapping[str, Any], consumed: Sequence[Signal]) -> dict[str, Any]:
    """One fact of a Step, applied to a copy of ``state`` (the fold and ``decide`` share it)."""
    s = dict(state)
    name = op.get("op")
    if name == "start_turn":
        if s["number"] == 0:
            s["state"] = s.pop("initial", None)
        s["number"] += 1
        s["unseen"] = False
        s["coordinator"] = None
        s["phase"] = "starting_turn"
    elif name == "turn_started":
        started = _only(consumed, is_child_start, "coordinator start")
        s["coordinator"] = started.payload["process_id"]
    elif name == "open_wait":
        s["waits"] += 1
        s["phase"] = "opening"
    elif name == "waiting":
        s["wait_id"] = _only(consumed, is_wait_opened, "wait opening").wait_id
        s["phase"] = "waiting"
    elif name == "outcomes":
        satisfied = _only(consumed, is_satisfied, "child wait satisfaction")
        tasks = list(s["tasks"])
        running_turn = s["coordinator"] is not None
        by_process = {_process_of(t): i for i, t in enumerate(tasks) if _running(t)}
        for outcome in satisfied.payload["outcomes"]:
            pid = outcome["process_id"]
            if pid == s["coordinator"]:
                continue
            index = by_process.get(pid)
            if index is None:
                raise state_error(f"a child wait outcome names {pid}, which is neither the coordinator nor a running task")
            task = {k: v for k, v in tasks[index].items() if k != "start"}
            task["outcome"] = outcome
            tasks[index] = task
            if running_turn:
                s["unseen"] = True
        s["tasks"] = tasks
        s["wait_id"] = None
    elif name == "apply":
        # The Decision is the coordinator's output, in the consumed satisfaction: not copied here.
        outcome = _coordinator_outcome(consumed, s["coordinator"])
        if outcome is None:
            raise state_error("the step applies a decision but consumed no coordinator outcome")
        decision = outcome["result"].get("output")
        if not isinstance(decision, dict):
            raise state_error("the applied decision is not an object")
        s["coordinator"] = None
        s["state"] = decision.get("state")
        s["mode"] = decision.get("mode")
        s["tasks"] = [*s["tasks"], *({"request": dict(t)} for t in decision.get("tasks") or ())]
        s["controls"] = [{"control": dict(c)} for c in decision.get("controls") or ()]
        s["phase"] = "applying"
    elif name == "applied":
        receipts = [signal for signal in consumed if is_child_start(signal) or _is_control_receipt(signal)]
        tasks = list(s["tasks"])
        controls = list(s["controls"])
        pending_tasks = [i for i, t in enumerate(tasks) if "start" not in t and "outcome" not in t]
        pending_controls = [i for i, c in enumerate(controls) if "result" not in c]
        if len(receipts) != len(pending_tasks) + len(pending_controls):
            raise state_error(
                f"{len(receipts)} settlement(s) for {len(pending_tasks)} start(s) and {len(pending_controls)} control(s)"
            )
        starts, results = receipts[: len(pending_tasks)], receipts[len(pending_tasks):]
        for index, signal in zip(pending_tasks, starts, strict=True):
            payload = signal.payload
            assert isinstance(payload, dict)
            if not is_child_start(signal) or payload.get("key") != tasks[index]["request"]["key"]:
                raise state_error(f"the start of task {tasks[index]['request']['key']!r} is not the next settlement")
            if payload.get("failure") is not None:
                start: dict[str, Any] = {"failure": payload["failure"]}
            else:
                start = {"process_id": payload["process_id"]}
            tasks[index] = {**tasks[index], "start": start}
        for index, signal in zip(pending_controls, results, strict=True):
            if not _is_control_receipt(signal):
                raise state_error(f"the receipt of control {index} is not the next settlement")
            controls[index] = {**controls[index], "result": signal.payload}
        s["tasks"] = tasks
        s["controls"] = controls
    elif name == "complete":
        return {"phase": "completed"}
    elif name == "fail":
        s["phase"] = "failed"
        s["wait_id"] = None
    else:
        raise state_error(f"unknown op {name!r}")
    return s


def check_state(data: Any) -> dict[str, Any]:
    """A decoded state, checked so that a forged or damaged one is refused, not run."""
    if not isinstance(data, dict) or data.get("phase") not in PHASES:
        raise state_error("a collaboration state is an object with a known phase")
    if data["phase"] == "completed":
        if set(data) != {"phase"}:
            raise state_error("a completed collaboration keeps nothing but its phase")
        return data
    number = data.get("number")
    if not isinstance(number, int) or isinstance(number, bool) or number < 0:
        raise state_error("the turn number must be a non-negative integer")
    if (number == 0) != (data["phase"] == "ready"):
        raise state_error(f"phase {data['phase']} does not fit turn number {number}")
    if number == 0 and "initial" not in data:
        raise state_error("a collaboration before its first turn must hold its initial state")
    if number > 0 and "initial" in data:
        raise state_error("the initial state belongs to turn 1 once it started")
    tasks, controls = data.get("tasks"), data.get("controls")
    if not isinstance(tasks, list) or not isinstance(controls, list):
        raise state_error("tasks and controls must be lists")
    keys: set[str] = set()
    for task in tasks:
        if not isinstance(task, dict) or not isinstance(task.get("request"), dict):
            raise state_error("every task holds its request")
        key = task["request"].get("key")
        if key in keys:
            raise state_error(f"task key {key!r} appears twice")
        keys.add(key)
        if "start" in task and "outcome" in task:
            raise state_error(f"task {key!r} holds both a start and an outcome")
    coordinator = data.get("coordinator")
    if data["phase"] in ("opening", "waiting") and coordinator is None and not any(_running(t) for t in tasks):
        raise state_error("a collaboration waits on nothing: no coordinator and no running task")
    if data["phase"] == "waiting" and not data.get("wait_id"):
        raise state_error("a waiting collaboration names its wait")
    waits = data.get("waits")
    if not isinstance(waits, int) or isinstance(waits, bool) or waits < 0:
        raise state_error("waits must be a non-negative integer")
    if not isinstance(data.get("unseen"), bool):
        raise state_error("unseen must be a boolean")
    return data


# ---------------------------------------------------------------------------
# The Strategy


class _Plan:
    def __init__(self, state: dict[str, Any], consumed: Sequence[Signal]) -> None:
        self.state = state
        self.consumed = consumed
        self.ops: list[dict[str, Any]] = []

    def add(self, op: dict[str, Any]) -> None:
        self.state = apply_op(self.state, op, self.consumed)
        self.ops.append(op)

    def step(self, transition: Transition) -> Step:
        return Step(len(self.consumed), transition, {"ops": self.ops}, next_state=self.state)

    def fail(self, failure: Failure) -> Step:
        """End the collaboration; its state keeps its turns and tasks as they were (for inspection)."""
        self.add({"op": "fail"})
        return self.step(Fail(failure))


class CollaborationStrategy:
    """decide/evolve for the collaboration's root Process."""

    def __init__(self, definition: TeamDefinition) -> None:
        self.definition = definition
        self.workers = tuple(w.descriptor_json() for w in definition.workers)

    # -- Strategy contract -------------------------------------------------

    def initial(self, input: JSON) -> dict[str, Any]:
        return {"phase": "ready", "number": 0, "initial": input, "state": None, "mode": None,
                "coordinator": None, "wait_id": None, "waits": 0, "unseen": False, "tasks": [], "controls": []}

    def evolve(self, state: dict[str, Any], facts: JSON, consumed: Sequence[Signal]) -> dict[str, Any]:
        for op in (facts or {}).get("ops", []):
            state = apply_op(state, op, consumed)
        return state

    def encode_state(self, state: dict[str, Any]) -> JSON:
        return state

    def decode_state(self, data: JSON) -> dict[str, Any]:
        return check_state(data)

    def decide(self, state: dict[str, Any], window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase in ("completed", "failed"):
            raise state_error(f"a {phase} collaboration takes no more Steps")
        if phase == "ready":
            if window:
                raise protocol_error(
                    f"signal {window[0].id} arrived before the first turn: the collaboration takes no input "
                    "before it starts"
                )
            plan = _Plan(state, ())
            return self._start_turn(plan)
        predicate: Callable[[Signal], bool]
        expected = 1
        if phase == "starting_turn":
            predicate = is_child_start
        elif phase == "opening":
            predicate = is_wait_opened
        elif phase == "waiting":
            wait_id = state["wait_id"]

            def predicate(s: Signal) -> bool:
                return is_satisfied(s) and s.wait_id == wait_id
        else:  # applying
            expected = sum(1 for t in state["tasks"] if "start" not in t and "outcome" not in t)
            expected += sum(1 for c in state["controls"] if "result" not in c)

            def predicate(s: Signal) -> bool:
                return is_child_start(s) or _is_control_receipt(s)
        taken = list(window[:expected])
        if len(taken) < expected or not all(predicate(s) for s in taken):
            stray = next((s for s in taken if not predicate(s)), None)
            if stray is not None and not stray.engine_owned:
                raise protocol_error(f"unexpected signal {stray.id} while {phase.replace('_', ' ')}")
            raise state_error(f"{phase}: expected {expected} settlement signal(s) at the head of the window")
        plan = _Plan(state, taken)
        if phase == "starting_turn":
            payload = taken[0].payload
            assert isinstance(payload, dict)
            if payload.get("failure") is not None:
                # A coordinator that cannot start ends the collaboration with its own Failure.
                return plan.fail(Failure.from_json(payload["failure"]))
            plan.add({"op": "turn_started"})
            return self._open_wait(plan)
        if phase == "opening":
            plan.add({"op": "waiting"})
            return plan.step(Wait(plan.state["wait_id"]))
        if phase == "waiting":
            return self._record_outcomes(plan, taken[0])
        plan.add({"op": "applied"})
        return self._after_actions(plan)

    # -- turns -------------------------------------------------------------

    def _start_turn(self, plan: _Plan) -> Step:
        number = plan.state["number"] + 1
        limit = self.definition.max_turns
        if not limit.allows(number - 1, 1):
            return plan.fail(Failure(
                FailureKind.EXECUTION, TURN_LIMIT,
                f"the collaboration reached its turn limit ({limit.maximum}) before a completing decision",
            ))
        plan.add({"op": "start_turn"})
        s = plan.state
        turn = {"number": s["number"], "state": s["state"], "workers": list(self.workers),
                "tasks": s["tasks"], "controls": s["controls"]}
        coordinator = self.definition.coordinator
        spec = ChildSpec(ChildKey(f"{TURN_KEY_PREFIX}{number}"), coordinator.program.ref, turn,
                         coordinator.budget, coordinator.capabilities)
        # A Turn repeats the one before with this turn's changes: stored as those changes (each
        # task outcome once, not again in every later Turn), the coordinator gets the same Turn.
        like = ChildKey(f"{TURN_KEY_PREFIX}{number - 1}") if number > 1 else None
        return plan.step(Continue((start_child_effect(spec, input_like=like),)))

    def _open_wait(self, plan: _Plan) -> Step:
        s = plan.state
        children = [_process_of(t) for t in s["tasks"] if _running(t)]
        if s["coordinator"] is not None:
            children.append(s["coordinator"])
        plan.add({"op": "open_wait"})
        # One key per wait: the previous wait is still open while this Step is checked.
        spec = ChildWaitSpec(WaitKey(f"{WAIT_KEY_PREFIX}{plan.state['waits']}"), tuple(ProcessID(str(c)) for c in children),
                             Boundary.SUBTREE_DRAINED, "any")
        return plan.step(Continue((wait_children_effect(spec),)))

    def _record_outcomes(self, plan: _Plan, satisfied: Signal) -> Step:
        coordinator = plan.state["coordinator"]
        outcome = _coordinator_outcome([satisfied], coordinator)
        plan.add({"op": "outcomes"})
        if outcome is None:
            if coordinator is not None:
                return self._open_wait(plan)  # the turn goes on: wait for it (and the other tasks) again
            return self._start_turn(plan)  # we waited for a task after a "wait" decision
        result = outcome["result"]
        termination = result.get("termination") or {}
        if termination.get("failure"):
            # A failed turn ends the collaboration with the coordinator's own Failure, unchanged.
            return plan.fail(Failure.from_json(termination["failure"]))
        # An unsettled coordinator cannot authorize anything, whatever it returned.
        unresolved = outcome.get("subtree_unresolved_effects") or []
        if unresolved:
            return plan.fail(Failure(
                FailureKind.EXTERNAL, COORDINATOR_UNRESOLVED,
                f"coordinator subtree {coordinator} ended with unresolved Effects [{', '.join(unresolved)}]: "
                "it cannot authorize a decision",
            ))
        if result.get("status") != "completed":
            return plan.fail(Failure(
                FailureKind.CONTRACT, DECISION_INVALID,
                f"coordinator {coordinator} ended {result.get('status')} ({termination.get('cause')}) without a decision"
                + (f": {termination['reason']}" if termination.get("reason") else ""),
            ))
        return self._apply(plan, result.get("output"))

    # -- decisions -----------------------------------------------------------

    def _apply(self, plan: _Plan, decision: Any) -> Step:
        problem = self._invalid(plan.state, decision)
        if problem is not None:
            return plan.fail(Failure(FailureKind.CONTRACT, DECISION_INVALID, problem))
        if "output" in decision:
            plan.add({"op": "complete"})
            return plan.step(Complete(decision["output"]))
        plan.add({"op": "apply"})
        effects = self._effects(plan.state)
        if not effects:
            plan.add({"op": "applied"})
            return self._after_actions(plan)
        return plan.step(Continue(tuple(effects)))

    def _effects(self, s: dict[str, Any]) -> list[Effect]:
        d = self.definition
        effects: list[Effect] = []
        for task in s["tasks"]:
            if "start" in task or "outcome" in task:
                continue
            request = task["request"]
            worker = d.worker(request["worker"])
            assert worker is not None
            effects.append(start_child_effect(ChildSpec(
                ChildKey(request["key"]), worker.program.ref, request["input"], worker.budget, worker.capabilities,
            )))
        keyed = {t["request"]["key"]: t for t in s["tasks"]}
        for receipt in s["controls"]:
            control = receipt["control"]
            pid = ProcessID(str(_process_of(keyed[control["task"]])))
            if "signal" in control:
                signal = control["signal"]
                effects.append(signal_child_effect(
                    pid, SignalRequest(SignalID(signal["id"]), signal["payload"], signal.get("wait_id"))
                ))
            else:
                effects.append(cancel_child_effect(pid, control["cancel_reason"]))
        return effects

    def _invalid(self, s: dict[str, Any], decision: Any) -> str | None:
        """Why a Decision is refused (spec 8.2, the whole batch before any action), or None."""
        d = self.definition
        if not isinstance(decision, dict):
            return f"a decision is an object, got {type(decision).__name__}"
        problems = schema_errors(decision, DECISION_SCHEMA)
        if problems:
            return f"the decision does not match DECISION_SCHEMA: {'; '.join(problems[:3])}"
        problems = schema_errors(decision["state"], d.state_schema)
        if problems:
            return f"the decision's state violates the state schema: {'; '.join(problems[:3])}"
        mode = decision["mode"]
        tasks = decision.get("tasks") or []
        controls = decision.get("controls") or []
        if "output" in decision:
            if mode != "" or tasks or controls:
                return "a completing decision (with an output) takes no mode, tasks or controls"
            problems = schema_errors(decision["output"], d.output_schema)
            if problems:
                return f"the decision's output violates the output schema: {'; '.join(problems[:3])}"
            return None
        if mode not in ("continue", "wait"):
            return 'a decision without an output needs mode "continue" or "wait"'
        existing = s["tasks"]
        if not d.max_tasks.allows(len(existing), len(tasks)):
            return (f"{len(tasks)} new task(s) beside {len(existing)} exceed the task limit "
                    f"({d.max_tasks.maximum})")
        running = sum(1 for t in existing if _running(t))
        if running + len(tasks) > d.max_concurrent_tasks:
            return (f"{running} running and {len(tasks)} new task(s) exceed the concurrent task limit "
                    f"({d.max_concurrent_tasks})")
        if len(controls) > d.max_controls_per_turn:
            return f"{len(controls)} controls exceed the per-turn limit ({d.max_controls_per_turn})"
        used = {t["request"]["key"] for t in existing}
        for i, request in enumerate(tasks):
            key = request["key"]
            try:
                ChildKey(key)
            except InvalidInput as exc:
                return f"tasks[{i}]: {exc.message}"
            if key.startswith(TURN_KEY_PREFIX):
                return f"tasks[{i}]: key {key!r} uses the reserved prefix {TURN_KEY_PREFIX!r}"
            worker = d.worker(request["worker"])
            if worker is None:
                return f"tasks[{i}]: unknown worker {request['worker']!r}"
            problems = schema_errors(request["input"], worker.program.descriptor.input_schema)
            if problems:
                return f"tasks[{i}]: the input violates worker {worker.name!r}'s input schema: {'; '.join(problems[:3])}"
            if key in used:
                return f"tasks[{i}]: key {key!r} is already used"
            used.add(key)
        keyed = {t["request"]["key"]: t for t in existing}
        for i, control in enumerate(controls):
            task = keyed.get(control["task"])
            if task is None or _process_of(task) is None:
                return f"controls[{i}]: task {control['task']!r} has no process to control"
            if ("signal" in control) == ("cancel_reason" in control):
                return f"controls[{i}]: give exactly one of signal and cancel_reason"
            try:
                if "signal" in control:
                    signal = control["signal"]
                    SignalRequest(SignalID(signal["id"]), signal["payload"], signal.get("wait_id"))
                else:
                    check_reason(control["cancel_reason"])
            except InvalidInput as exc:
                return f"controls[{i}]: {exc.message}"
        if mode == "wait" and not running and not tasks and not s["unseen"]:
            return 'mode "wait" with no running task, no new task and no unseen outcome would wait forever'
        return None

    def _after_actions(self, plan: _Plan) -> Step:
        s = plan.state
        if s["mode"] == "wait" and not s["unseen"] and any(_running(t) for t in s["tasks"]):
            return self._open_wait(plan)
        return self._start_turn(plan)


__all__ = [
    "DECISION_SCHEMA",
    "TURN_SCHEMA",
    "CollaborationStrategy",
    "Member",
    "TeamDefinition",
]

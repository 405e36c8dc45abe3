"""Programs the conformance suite drives, beyond ``tests.kernel_programs``.

* :func:`gate_program` - parks itself with a ``pause`` Step; after a host resume it
  does one thing (``then``): a dispatcher Effect, effect-free progress, or a child.
  The resume is what makes the next Step possible, so the append that carries the
  resume also carries that Step, its Effect declaration and its dispatch permission:
  a fault injected on that append cuts exactly one of Scope's commit boundaries.
* :func:`sleeper_program` - pauses at once; when resumed it completes with the
  signals it found in its window (it accepts unaddressed host signals).
* :func:`controller_program` - starts a sleeper child, opens an external wait
  ``go`` and, when a host answers it, issues the child controls the answer lists
  (``signal_child`` / ``cancel_child``), records the receipts, then waits for the
  child's terminal result and completes with receipts and outcome.

Every builder is a pure function of its arguments (same arguments, same ProgramRef),
so a fresh Runtime built from fresh objects binds the very same Programs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from agentfold.adapters.dispatch import DispatchContext, FunctionDispatcher
from agentfold.domain.budget import Budget
from agentfold.domain.ids import ChildKey, Digest, ProcessID, SignalID, WaitKey
from agentfold.domain.program import (
    ChildSpec,
    ChildWaitSpec,
    Complete,
    Continue,
    Descriptor,
    Effect,
    EffectPolicy,
    Pause,
    Program,
    Replay,
    Signal,
    SignalRequest,
    Step,
    Wait,
    cancel_child_effect,
    dispatcher_effect,
    signal_child_effect,
    start_child_effect,
    wait_children_effect,
    wait_effect,
)
from agentfold.domain.requests import EffectRequest, Settlement
from tests.kernel_programs import CallLog, JsonStrategy, asker_program, config_digest

IMPL = Digest.of(b"tests.conformance.programs")
OBJECT_SIGNALS = {"type": "object"}

Call = Callable[[EffectRequest, DispatchContext], Settlement]


def counted(log: CallLog, value: int = 7) -> Call:
    """A dispatcher that records each real call in ``log`` and succeeds with ``value``."""

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        log.record(effect_id=request.effect_id, attempt_id=request.attempt_id)
        return Settlement.succeeded({"value": value})

    return call


def lost(log: CallLog) -> Call:
    """A dispatcher that records its call, then loses the outcome (raises): unknown."""

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        log.record(effect_id=request.effect_id, attempt_id=request.attempt_id)
        raise ConnectionResetError("the connection dropped after the request was sent")

    return call


CHILD_GRANT = Budget.of(steps=10, effects=5, signals=10)
"""The grant a parent here gives its child: a permanent debit on a finite parent budget."""


def _settlement(window: Sequence[Signal]) -> Signal | None:
    for signal in window:
        if signal.effect_id is not None:
            return signal
    return None


# ---------------------------------------------------------------------------
# gate


class Gate(JsonStrategy):
    def __init__(self, then: str, child: Program | None) -> None:
        self.then = then
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            return Step(0, Pause("gate"), {"phase": "gated"})
        if self.then == "effect":
            return self._effect(phase, window)
        if self.then == "progress":
            return self._progress(state, phase, window)
        return self._child(phase, window)

    def _effect(self, phase: str, window: Sequence[Signal]) -> Step:
        if phase == "gated":
            return Step(0, Continue((dispatcher_effect({"gate": "call"}),)), {"phase": "calling"})
        if phase == "calling":
            settled = _settlement(window)
            if settled is None:
                return Step(0, Pause("no settlement in window"), {})
            status = settled.status.value if settled.status else None
            return Step(len(window), Complete({"status": status, "result": settled.payload}), {"phase": "done"})
        raise RuntimeError(f"unexpected phase {phase}")

    def _progress(self, state: Any, phase: str, window: Sequence[Signal]) -> Step:
        if phase == "gated":
            return Step(0, Continue(()), {"phase": "progressed", "progress": 1})
        if phase == "progressed":
            return Step(0, Pause("parked after progress"), {"phase": "parked"})
        if phase == "parked":
            return Step(len(window), Complete({"progress": state["progress"]}), {"phase": "done"})
        raise RuntimeError(f"unexpected phase {phase}")

    def _child(self, phase: str, window: Sequence[Signal]) -> Step:
        assert self.child is not None
        if phase == "gated":
            spec = ChildSpec(ChildKey("child"), self.child.ref, None, CHILD_GRANT)
            return Step(0, Continue((start_child_effect(spec),)), {"phase": "starting"})
        if phase == "starting":
            started = window[0].payload["process_id"]
            spec_wait = ChildWaitSpec(WaitKey("child"), (ProcessID(started),))
            return Step(1, Continue((wait_children_effect(spec_wait),)), {"phase": "opening", "child": started})
        if phase == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting"})  # type: ignore[arg-type]
        if phase == "waiting":
            outcome = window[0].payload["outcomes"][0]["result"]
            return Step(1, Complete({"child": outcome["status"], "output": outcome.get("output")}), {"phase": "done"})
        raise RuntimeError(f"unexpected phase {phase}")


def gate_program(then: str, call: Call | None = None, *, replay: Replay = Replay.NEVER) -> Program:
    """A Program that pauses first; after a resume it does ``then`` (effect, progress, child)."""
    name = f"conformance.gate-{then}"
    child = asker_program("conformance.asker") if then == "child" else None
    return Program(
        Descriptor(name, signal_schema=OBJECT_SIGNALS),
        Gate(then, child),
        IMPL,
        config_digest(name + replay.value),
        children=(child,) if child is not None else (),
        policy=lambda effect: EffectPolicy(replay=replay),
        dispatcher=FunctionDispatcher(call) if call is not None else None,
    )


# ---------------------------------------------------------------------------
# sleeper


class Sleeper(JsonStrategy):
    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start":
            return Step(0, Pause("sleeping"), {"phase": "asleep"})
        return Step(
            len(window),
            Complete({"signals": [s.id for s in window], "payloads": [s.payload for s in window]}),
            {"phase": "done"},
        )


def sleeper_program(name: str = "conformance.sleeper") -> Program:
    """Pauses at once; resumed, completes with the signals in its window."""
    return Program(Descriptor(name, signal_schema=OBJECT_SIGNALS), Sleeper(), IMPL, config_digest(name))


# ---------------------------------------------------------------------------
# controller


def control_effect(control: dict[str, Any], child: ProcessID) -> Effect:
    """One child control named by a host answer: ``{"op", "to", ...}`` (``to`` = "child" or a process id)."""
    target = child if control["to"] == "child" else ProcessID(control["to"])
    if control["op"] == "signal":
        return signal_child_effect(target, SignalRequest(SignalID(control["signal_id"]), control.get("payload")))
    return cancel_child_effect(target, control["reason"])


class Controller(JsonStrategy):
    def __init__(self, child: Program) -> None:
        self.child = child

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            spec = ChildSpec(ChildKey("worker"), self.child.ref, None, CHILD_GRANT)
            return Step(0, Continue((start_child_effect(spec),)), {"phase": "starting"})
        if phase == "starting":
            child = window[0].payload["process_id"]
            go = wait_effect(WaitKey("go"), prompt={"controls": "list"}, response_schema={"type": "object"})
            return Step(1, Continue((go,)), {"phase": "opening", "child": child})
        if phase == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting_go", "go": window[0].wait_id})  # type: ignore[arg-type]
        if phase == "waiting_go":
            for index, signal in enumerate(window):
                if signal.wait_id == state["go"]:
                    controls = signal.payload["controls"]
                    effects = tuple(control_effect(c, ProcessID(state["child"])) for c in controls)
                    return Step(index + 1, Continue(effects), {"phase": "controlling", "controls": len(controls)})
            return Step(0, Pause("no answer to go"), {})
        if phase == "controlling":
            count = state["controls"]
            receipts = [s.payload for s in window[:count]]
            spec = ChildWaitSpec(WaitKey("worker-done"), (ProcessID(state["child"]),))
            return Step(
                count, Continue((wait_children_effect(spec),)), {"phase": "opening_child", "receipts": receipts}
            )
        if phase == "opening_child":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting_child"})  # type: ignore[arg-type]
        if phase == "waiting_child":
            outcome = window[0].payload["outcomes"][0]["result"]
            return Step(
                1,
                Complete({"receipts": state["receipts"], "child": outcome["status"], "output": outcome.get("output")}),
                {"phase": "done"},
            )
        raise RuntimeError(f"unexpected phase {phase}")


def controller_program(name: str = "conformance.controller") -> Program:
    """Starts a sleeper child and controls it as the host's answer to ``go`` says."""
    child = sleeper_program()
    return Program(Descriptor(name), Controller(child), IMPL, config_digest(name), children=(child,))


def go(*controls: dict[str, Any]) -> dict[str, Any]:
    """The host's answer to the controller's ``go`` wait."""
    return {"controls": list(controls)}

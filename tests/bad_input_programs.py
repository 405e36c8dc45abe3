"""Programs for the bad-input tests: each parks in the state a refusal needs.

* :func:`listener_program` accepts unaddressed signals (with a signal schema) and parks
  paused between Steps, so its mailbox can be filled and its budget spent without it
  running away;
* :func:`two_waits_program` opens two input waits and waits on the second, then on the
  first, so one wait is open but not current, and later one is already answered;
* :func:`pair_program` declares two dispatcher Effects in one Step; the first succeeds
  and the second raises (its outcome is unknown), so a definite Effect stays retained
  in the batch next to an unknown one;
* :func:`gate_program` declares one dispatcher Effect whose dispatcher blocks until the
  test opens the gate, so the Effect is observably pending.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from agentfold.adapters.dispatch import DispatchContext, FunctionDispatcher
from agentfold.domain.ids import WaitKey
from agentfold.domain.program import (
    Complete,
    Continue,
    Descriptor,
    Pause,
    Program,
    Signal,
    Step,
    Wait,
    dispatcher_effect,
    wait_effect,
)
from agentfold.domain.requests import EffectRequest, Settlement
from tests.kernel_programs import IMPL, JsonStrategy, config_digest

LISTENER_SIGNAL_SCHEMA = {
    "type": "object",
    "required": ["text"],
    "properties": {"text": {"type": "string"}},
}


class Listener(JsonStrategy):
    """Consume every pending signal, then pause until resumed."""

    def initial(self, input: Any) -> Any:
        return {"seen": 0}

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        return Step(len(window), Pause("listening"), {"seen": state["seen"] + len(window)})


def listener_program(name: str = "test.listener") -> Program:
    return Program(Descriptor(name, signal_schema=LISTENER_SIGNAL_SCHEMA), Listener(), IMPL, config_digest(name))


ANSWER_SCHEMA = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}


class TwoWaits(JsonStrategy):
    """Open waits ``first`` and ``second``; wait on ``second``, then on ``first``, then complete."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            effects = (
                wait_effect(WaitKey("first"), response_schema=ANSWER_SCHEMA),
                wait_effect(WaitKey("second"), response_schema=ANSWER_SCHEMA),
            )
            return Step(0, Continue(effects), {"phase": "opening"})
        if phase == "opening":
            first, second = window[0].wait_id, window[1].wait_id
            return Step(2, Wait(second), {"phase": "second", "first": first, "second": second})  # type: ignore[arg-type]
        if phase == "second":
            return Step(len(window), Wait(state["first"]), {"phase": "first"})
        return Step(len(window), Complete({"answers": state.get("answers", 0) + len(window)}), {"phase": "done"})


def two_waits_program(name: str = "test.two_waits") -> Program:
    return Program(Descriptor(name), TwoWaits(), IMPL, config_digest(name))


class Pair(JsonStrategy):
    """One Step with two dispatcher Effects; complete once both are settled."""

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start":
            effects = (dispatcher_effect({"call": "ok"}), dispatcher_effect({"call": "boom"}))
            return Step(0, Continue(effects), {"phase": "running"})
        return Step(len(window), Complete({"settled": len(window)}), {"phase": "done"})


def _pair_call(request: EffectRequest, context: DispatchContext) -> Settlement:
    if request.payload["call"] == "boom":
        raise ConnectionError("the tool's connection dropped mid-call")
    return Settlement.succeeded({"value": 1})


def pair_program(name: str = "test.pair") -> Program:
    return Program(Descriptor(name), Pair(), IMPL, config_digest(name), dispatcher=FunctionDispatcher(_pair_call))


class Gated(JsonStrategy):
    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        if state["phase"] == "start":
            return Step(0, Continue((dispatcher_effect({"call": "gated"}),)), {"phase": "running"})
        return Step(len(window), Complete({"done": True}), {"phase": "done"})


def gate_program(gate: threading.Event, name: str = "test.gate") -> Program:
    """A Program whose only dispatcher Effect stays pending until ``gate`` is set."""

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        if not gate.wait(30):
            raise TimeoutError("the test never opened the gate")
        return Settlement.succeeded({"value": 1})

    return Program(Descriptor(name), Gated(), IMPL, config_digest(name), dispatcher=FunctionDispatcher(call))

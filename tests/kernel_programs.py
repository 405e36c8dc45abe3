"""Small kernel Programs shared by the tests.

Each is a plain decide/evolve Strategy over a JSON state. Dispatchers record every
real call in a :class:`CallLog` (a file, so calls made by a process that later died
are counted outside it).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentfold.adapters.dispatch import DispatchContext, FunctionDispatcher
from agentfold.domain.errors import Failure, FailureKind
from agentfold.domain.ids import ChildKey, Digest, WaitKey
from agentfold.domain.program import (
    ChildSpec,
    ChildWaitSpec,
    Complete,
    Continue,
    Descriptor,
    EffectPolicy,
    Fail,
    Pause,
    Program,
    Replay,
    Signal,
    Step,
    Wait,
    dispatcher_effect,
    start_child_effect,
    wait_children_effect,
    wait_effect,
)
from agentfold.domain.requests import EffectRequest, Settlement

IMPL = Digest.of(b"tests.kernel_programs")


def config_digest(name: str) -> Digest:
    return Digest.of(name.encode())


class JsonStrategy:
    """Base: state is a JSON dict; evolve merges the facts into it."""

    def initial(self, input: Any) -> Any:
        return {"input": input, "phase": "start"}

    def evolve(self, state: Any, facts: Any, consumed: Sequence[Signal]) -> Any:
        return {**state, **(facts or {})}

    def encode_state(self, state: Any) -> Any:
        return state

    def decode_state(self, data: Any) -> Any:
        return data

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:  # pragma: no cover - abstract
        raise NotImplementedError


class CallLog:
    """Appends one JSON line per real dispatcher call to a file (survives process death)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def record(self, **fields: Any) -> None:
        line = json.dumps(fields, sort_keys=True) + "\n"
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line.encode())
                os.fsync(fd)
            finally:
                os.close(fd)

    def calls(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def count(self) -> int:
        return len(self.calls())


# ---------------------------------------------------------------------------
# chain: N dispatcher effects, one per Step, then complete with the sum


class Chain(JsonStrategy):
    def initial(self, input: Any) -> Any:
        return {"n": int(input["n"]), "done": 0, "total": 0}

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        total = state["total"]
        for signal in window:
            if signal.status is not None and signal.status.value == "failed":
                return Step(len(window), Fail(Failure(FailureKind.EXTERNAL, "test.chain.failed", "an effect failed")))
            total += int((signal.payload or {}).get("value", 0))
        done = state["done"] + len(window)
        facts = {"done": done, "total": total}
        if done >= state["n"]:
            return Step(len(window), Complete({"total": total, "effects": done}), facts)
        return Step(len(window), Continue((dispatcher_effect({"index": done}),)), facts)


def chain_program(
    call: Callable[[EffectRequest, DispatchContext], Settlement] | None = None,
    *,
    replay: Replay = Replay.NEVER,
    name: str = "test.chain",
) -> Program:
    def default(request: EffectRequest, context: DispatchContext) -> Settlement:
        return Settlement.succeeded({"value": 1})

    return Program(
        Descriptor(name, input_schema={"type": "object", "required": ["n"]}),
        Chain(),
        IMPL,
        config_digest(name + replay.value),
        policy=lambda effect: EffectPolicy(replay=replay),
        dispatcher=FunctionDispatcher(call or default),
    )


class GatedCall:
    """A chain dispatcher that logs every call (its chain ``index`` and ``effect_id``) and holds
    the call at index ``at`` (every call when None) until ``release`` is set; ``entered`` is set
    once a call is held."""

    def __init__(self, log: CallLog, at: int | None = None) -> None:
        self.log = log
        self.at = at
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, request: EffectRequest, context: DispatchContext) -> Settlement:
        index = request.payload["index"]
        self.log.record(index=index, effect_id=request.effect_id)
        if self.at is None or index == self.at:
            self.entered.set()
            self.release.wait(30)
        return Settlement.succeeded({"value": 1})


def logged_call(log: CallLog, value: int = 1) -> Callable[[EffectRequest, DispatchContext], Settlement]:
    """A dispatcher whose side effect is one line in ``log`` per call."""

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        log.record(effect_id=request.effect_id, attempt_id=request.attempt_id, payload=request.payload)
        return Settlement.succeeded({"value": value})

    return call


# ---------------------------------------------------------------------------
# asker: open an input wait (with a response schema), wait, complete with the answer


class Asker(JsonStrategy):
    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            effect = wait_effect(
                WaitKey("answer"),
                prompt={"question": "name?"},
                response_schema={"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
            )
            return Step(0, Continue((effect,)), {"phase": "opening"})
        if phase == "opening":
            opened = window[0]
            return Step(1, Wait(opened.wait_id), {"phase": "waiting", "wait_id": opened.wait_id})  # type: ignore[arg-type]
        if phase == "waiting":
            for index, signal in enumerate(window):
                if signal.wait_id == state["wait_id"]:
                    return Step(index + 1, Complete({"hello": signal.payload["name"]}), {"phase": "done"})
            return Step(0, Pause("no answer in window"), {})
        raise RuntimeError(f"unexpected phase {phase}")


def asker_program(name: str = "test.asker") -> Program:
    return Program(Descriptor(name), Asker(), IMPL, config_digest(name))


# ---------------------------------------------------------------------------
# parent: start children of one program, wait for them (all, terminal_result), complete with outputs


class Parent(JsonStrategy):
    def __init__(self, child: Program, count: int, boundary: str = "terminal_result", condition: str = "all") -> None:
        self.child = child
        self.count = count
        self.boundary = boundary
        self.condition = condition

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            effects = tuple(
                start_child_effect(ChildSpec(ChildKey(f"child-{i}"), self.child.ref, (state["input"] or {}).get("child")))
                for i in range(self.count)
            )
            return Step(0, Continue(effects), {"phase": "starting"})
        if phase == "starting":
            started = [s.payload["process_id"] for s in window if "process_id" in (s.payload or {})]
            if not started:
                return Step(len(window), Complete({"started": 0}), {"phase": "done"})
            spec = ChildWaitSpec(WaitKey("children"), tuple(started), self.boundary, self.condition)  # type: ignore[arg-type]
            return Step(len(window), Continue((wait_children_effect(spec),)), {"phase": "opening", "children": started})
        if phase == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting"})  # type: ignore[arg-type]
        if phase == "waiting":
            outcomes = window[0].payload["outcomes"]
            return Step(
                1,
                Complete({"outcomes": [{"status": o["result"]["status"], "output": o["result"].get("output")} for o in outcomes]}),
                {"phase": "done"},
            )
        raise RuntimeError(f"unexpected phase {phase}")


def parent_program(child: Program, count: int = 2, name: str = "test.parent", **kwargs: Any) -> Program:
    return Program(
        Descriptor(name), Parent(child, count, **kwargs), IMPL, config_digest(name + str(count)), children=(child,)
    )

"""The Programs the crash tests drive, built identically in the worker and in the test.

A crashed tree is recovered by another process, which must bind the very same
ProgramRef: every builder here is a pure function of its arguments, and every
dispatcher records its real calls in a :class:`~tests.kernel_programs.CallLog` file
so the test counts calls made by a process that later died.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import FunctionDispatcher
from agentfold.domain.ids import ChildKey, WaitKey
from agentfold.domain.program import (
    Boundary,
    ChildSpec,
    ChildWaitSpec,
    Complete,
    Continue,
    Descriptor,
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
from tests.kernel_programs import (
    IMPL,
    CallLog,
    Chain,
    JsonStrategy,
    chain_program,
    config_digest,
    logged_call,
    parent_program,
)

PROGRAMS = ("chain", "chain-same", "ask-call", "prep-parent", "parent-same")


# ---------------------------------------------------------------------------
# ask-call: open an input wait, and once answered make one dispatcher call with the answer


class AskThenCall(JsonStrategy):
    """Admitting the answer commits the next Step and its dispatch permission in one append."""

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
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting", "wait_id": window[0].wait_id})  # type: ignore[arg-type]
        if phase == "waiting":
            answer = window[0]
            name = answer.payload["name"]
            return Step(1, Continue((dispatcher_effect({"greet": name}),)), {"phase": "calling", "name": name})
        if phase == "calling":
            value = (window[0].payload or {}).get("value")
            return Step(1, Complete({"hello": state["name"], "value": value}), {"phase": "done"})
        raise RuntimeError(f"unexpected phase {phase}")


# ---------------------------------------------------------------------------
# prep-parent: one dispatcher call, then start two chain children (so the children
# start in an append of their own, after the first one), wait for both, collect outputs


class PreparingParent(JsonStrategy):
    def __init__(self, child: Program, count: int) -> None:
        self.child = child
        self.count = count

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        phase = state["phase"]
        if phase == "start":
            return Step(0, Continue((dispatcher_effect({"prepare": True}),)), {"phase": "preparing"})
        if phase == "preparing":
            prepared = (window[0].payload or {}).get("value")
            effects = tuple(
                start_child_effect(ChildSpec(ChildKey(f"child-{i}"), self.child.ref, {"n": 1})) for i in range(self.count)
            )
            return Step(1, Continue(effects), {"phase": "starting", "prepared": prepared})
        if phase == "starting":
            started = [s.payload["process_id"] for s in window]
            spec = ChildWaitSpec(WaitKey("children"), tuple(started), Boundary.TERMINAL_RESULT, "all")
            return Step(len(window), Continue((wait_children_effect(spec),)), {"phase": "opening"})
        if phase == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting"})  # type: ignore[arg-type]
        if phase == "waiting":
            outcomes = window[0].payload["outcomes"]
            return Step(
                1,
                Complete({
                    "prepared": state["prepared"],
                    "children": [o["result"].get("output") for o in outcomes],
                }),
                {"phase": "done"},
            )
        raise RuntimeError(f"unexpected phase {phase}")


class DecideLoggedChain(Chain):
    """The chain, writing one line per ``decide`` call to ``<call log>.decides`` (the state's
    ``done`` and the window's length, which name the Step): a test counts the Steps decided in
    a process that later died. Recovery must never call ``decide`` for a committed Step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def decide(self, state: Any, window: Sequence[Signal]) -> Step:
        with self.path.open("a") as out:
            out.write(json.dumps([state["done"], len(window)]) + "\n")
        return super().decide(state, window)


def decides(log_path: str | Path) -> list[tuple[int, int]]:
    """The Steps the decide-logged chain decided, in order, across every process."""
    path = Path(f"{log_path}.decides")
    if not path.exists():
        return []
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()]  # type: ignore[misc]


def build(kind: str, log_path: str | Path) -> Program:
    """The Program named ``kind`` whose dispatchers log to ``log_path``."""
    log = CallLog(log_path)
    if kind == "chain":
        program = chain_program(logged_call(log), name="crash.chain")
        return dataclasses.replace(program, strategy=DecideLoggedChain(Path(f"{log_path}.decides")))
    if kind == "chain-same":
        return chain_program(logged_call(log), replay=Replay.SAME_IDENTITY, name="crash.chain")
    if kind == "ask-call":
        name = "crash.ask-call"
        return Program(
            Descriptor(name), AskThenCall(), IMPL, config_digest(name), dispatcher=FunctionDispatcher(logged_call(log, 7))
        )
    if kind == "prep-parent":
        child = chain_program(logged_call(log), name="crash.child")
        name = "crash.prep-parent"
        return Program(
            Descriptor(name),
            PreparingParent(child, 2),
            IMPL,
            config_digest(name),
            children=(child,),
            dispatcher=FunctionDispatcher(logged_call(log, 5)),
        )
    if kind == "parent-same":  # a parent waiting for one child whose calls may be made again
        child = chain_program(logged_call(log), replay=Replay.SAME_IDENTITY, name="crash.child-same")
        return parent_program(child, count=1, name="crash.parent-same")
    raise ValueError(f"unknown program {kind!r}; expected one of {PROGRAMS}")


def catalog(kind: str, log_path: str | Path) -> Catalog:
    return Catalog([build(kind, log_path)])

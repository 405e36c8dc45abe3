"""Real Python tools and models for the Interaction tests.

Every tool implements the ``agentfold.adapters.tools.Tool`` protocol and runs for real on the
runtime's dispatch threads. A :class:`CallLog` shared by the tools of one test counts
the real calls and records the order in which calls start and end, so a test can
prove concurrency limits and "ran exactly once". A call can be *held* running with a
:class:`Gate` (``threading.Event``s): the test learns when the call entered, and
releases it when it wants; a held call honours its Process's cancellation by raising
``DispatchCancelled`` (its outcome is then unknown), unless told to ignore it.

Models: ``agentfold.adapters.models.ScriptedModel`` does the scripting; :class:`GatedModel`
wraps it to hold a given model call open.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentfold.adapters.dispatch import DispatchCancelled
from agentfold.adapters.models import ModelRequest, ScriptedModel
from agentfold.adapters.tools import ToolInvocation, ToolOutput
from agentfold.domain.canonical import JSON

WAIT = 15.0
"""Upper bound of every blocking wait in these tests: a broken behaviour fails, never hangs."""


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


# ---------------------------------------------------------------------------
# Chat helpers


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def call(call_id: str, name: str, arguments: JSON = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": call_id, "name": name}
    if arguments is not None:
        body["arguments"] = json.dumps(arguments, sort_keys=True)
    return body


def tool_round(*calls: dict[str, Any], reason: str = "tool_calls", text: str = "") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "tool_calls": list(calls)}
    if text:
        message["content"] = [{"type": "text", "text": text}]
    return {"finish_reason": reason, "message": message}


def final(text: str, reason: str = "stop") -> dict[str, Any]:
    return {"finish_reason": reason, "message": {"role": "assistant", "content": [{"type": "text", "text": text}]}}


def chat_input(*texts: str) -> dict[str, Any]:
    return {"messages": [user(t) for t in texts]}


def text_of(message: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in message.get("content", []))


def shape(messages: Sequence[dict[str, Any]]) -> list[tuple[str, Any]]:
    """A compact view of a message list: role plus text, call ids or result ids."""
    out: list[tuple[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append(("tool", [r["id"] for r in m["tool_results"]]))
        elif m.get("tool_calls"):
            out.append((m["role"], [c["id"] for c in m["tool_calls"]]))
        else:
            out.append((m["role"], text_of(m)))
    return out


# ---------------------------------------------------------------------------
# Call log, gates


@dataclass
class CallLog:
    """Thread-safe record of real tool calls: starts and ends in order."""

    events: list[tuple[str, str, str]] = field(default_factory=list)  # (start|end, tool, call id)
    invocations: list[ToolInvocation] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, tool: str, invocation: ToolInvocation) -> None:
        with self.lock:
            self.events.append(("start", tool, invocation.call.id))
            self.invocations.append(invocation)

    def end(self, tool: str, invocation: ToolInvocation) -> None:
        with self.lock:
            self.events.append(("end", tool, invocation.call.id))

    def count(self, tool: str | None = None, call_id: str | None = None) -> int:
        with self.lock:
            return sum(
                1 for kind, t, c in self.events
                if kind == "start" and (tool is None or t == tool) and (call_id is None or c == call_id)
            )

    def started(self) -> list[str]:
        with self.lock:
            return [c for kind, _, c in self.events if kind == "start"]

    def max_active(self, among: Sequence[str] | None = None) -> int:
        """The largest number of calls (optionally only ``among`` these ids) running at once."""
        active = 0
        peak = 0
        with self.lock:
            for kind, _, c in self.events:
                if among is not None and c not in among:
                    continue
                active += 1 if kind == "start" else -1
                peak = max(peak, active)
        return peak

    def overlapped(self, call_id: str) -> list[str]:
        """Calls that were running at some moment while ``call_id`` ran."""
        running: set[str] = set()
        seen: set[str] = set()
        inside = False
        with self.lock:
            for kind, _, c in self.events:
                if kind == "start":
                    if inside:
                        seen.add(c)
                    if c == call_id:
                        inside = True
                        seen |= running
                    running.add(c)
                else:
                    running.discard(c)
                    if c == call_id:
                        inside = False
        seen.discard(call_id)
        return sorted(seen)


@dataclass
class Gate:
    """Holds one call running: ``entered`` is set when it starts, ``release`` lets it finish."""

    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    honour_cancel: bool = True


Behaviour = Callable[[ToolInvocation, JSON], ToolOutput]


def _default(name: str) -> Behaviour:
    def behave(invocation: ToolInvocation, arguments: JSON) -> ToolOutput:
        return ToolOutput.text(f"{name}:{invocation.call.id}", {"arguments": arguments})

    return behave


class ProbeTool:
    """A real tool that logs every call and can be held running per call id."""

    def __init__(
        self,
        name: str,
        log: CallLog,
        behave: Behaviour | None = None,
        *,
        description: str = "",
        parameters: JSON = None,
        concurrency: Callable[[Any, JSON], tuple[str, bool]] | None = None,
        direct_result: bool = False,
        advertise: Callable[[ToolInvocation, ToolOutput], list[str]] | None = None,
    ) -> None:
        self.name = name
        self.description = description
        self.parameters: JSON = parameters if parameters is not None else {"type": "object"}
        self.direct_result = direct_result
        self.log = log
        self.behave = behave or _default(name)
        self.gates: dict[str, Gate] = {}
        if concurrency is not None:
            self.concurrency = concurrency
        if advertise is not None:
            self.advertise = advertise

    def hold(self, call_id: str, *, honour_cancel: bool = True) -> Gate:
        gate = Gate(honour_cancel=honour_cancel)
        self.gates[call_id] = gate
        return gate

    def call(self, invocation: ToolInvocation, arguments: JSON) -> ToolOutput:
        self.log.start(self.name, invocation)
        try:
            gate = self.gates.get(invocation.call.id)
            if gate is not None and not (invocation.continuation is not None and gate.release.is_set()):
                gate.entered.set()
                deadline = time.monotonic() + WAIT
                while not gate.release.wait(0.005):
                    cancelled = invocation.context is not None and invocation.context.cancelled.is_set()
                    if cancelled and gate.honour_cancel:
                        raise DispatchCancelled("the tool call saw its process stop")
                    if time.monotonic() > deadline:
                        raise TimeoutError("the test never released this call")
            return self.behave(invocation, arguments)
        finally:
            self.log.end(self.name, invocation)


def keyed(key_of: Callable[[JSON], str]) -> Callable[[Any, JSON], tuple[str, bool]]:
    """A pure concurrency classifier: concurrent, with a resource key read from the arguments."""

    def classify(call: Any, arguments: JSON) -> tuple[str, bool]:
        return key_of(arguments), True

    return classify


def concurrent_any(call: Any, arguments: JSON) -> tuple[str, bool]:
    return "", True


# ---------------------------------------------------------------------------
# Models


class GatedModel:
    """A ScriptedModel whose listed model call sequences are held open until released."""

    def __init__(self, responses: Sequence[dict[str, Any]], hold: Sequence[int] = ()) -> None:
        self.scripted = ScriptedModel(responses)
        self.gates = {seq: Gate() for seq in hold}
        self.calls = 0
        self.lock = threading.Lock()
        self.on_call: Callable[[ModelRequest], None] | None = None

    @property
    def requests(self) -> list[ModelRequest]:
        return self.scripted.requests

    def call(self, request: ModelRequest) -> dict[str, Any]:
        with self.lock:
            self.calls += 1
        if self.on_call is not None:
            self.on_call(request)
        gate = self.gates.get(request.model_call_sequence)
        if gate is not None:
            gate.entered.set()
            if not gate.release.wait(WAIT):
                raise TimeoutError("the test never released this model call")
        return self.scripted.call(request)


# ---------------------------------------------------------------------------
# A plain parent Program that starts one child under a key of its choice


class _KeyedParent:
    """Start one child under ``key``, wait for it, complete with its outcome."""

    def __init__(self, child: Any, key: str, child_input: JSON) -> None:
        self.child = child
        self.key = key
        self.child_input = child_input

    def initial(self, input: JSON) -> dict[str, Any]:
        return {"phase": "start"}

    def evolve(self, state: Any, facts: JSON, consumed: Sequence[Any]) -> Any:
        return {**state, **(facts or {})}

    def encode_state(self, state: Any) -> JSON:
        return state

    def decode_state(self, data: JSON) -> Any:
        return data

    def decide(self, state: Any, window: Sequence[Any]) -> Any:
        from agentfold.domain.ids import ChildKey, WaitKey
        from agentfold.domain.program import (
            ChildSpec,
            ChildWaitSpec,
            Complete,
            Continue,
            Step,
            Wait,
            start_child_effect,
            wait_children_effect,
        )

        phase = state["phase"]
        if phase == "start":
            spec = ChildSpec(ChildKey(self.key), self.child.ref, self.child_input)
            return Step(0, Continue((start_child_effect(spec),)), {"phase": "starting"})
        if phase == "starting":
            pid = window[0].payload["process_id"]
            return Step(1, Continue((wait_children_effect(ChildWaitSpec(WaitKey("child"), (pid,))),)), {"phase": "opening"})
        if phase == "opening":
            return Step(1, Wait(window[0].wait_id), {"phase": "waiting"})
        return Step(1, Complete(window[0].payload["outcomes"][0]["result"]), {"phase": "done"})


def keyed_parent(child: Any, key: str, child_input: JSON) -> Any:
    from agentfold.domain.ids import Digest
    from agentfold.domain.program import Descriptor, Program

    return Program(
        Descriptor("tests.keyed-parent"),
        _KeyedParent(child, key, child_input),
        Digest.of(b"tests.keyed-parent"),
        Digest.of(key.encode()),
        children=(child,),
    )


class RecordingTool:
    """A real tool that records the arguments of every call it runs and answers ``answer``."""

    description = "Records its calls."

    def __init__(self, name: str, parameters: JSON, answer: str) -> None:
        self.name = name
        self.parameters = parameters
        self.answer = answer
        self.ran: list[JSON] = []
        self._lock = threading.Lock()

    def call(self, invocation: ToolInvocation, arguments: JSON) -> ToolOutput:
        with self._lock:
            self.ran.append(arguments)
        return ToolOutput.text(self.answer)


def one_tool_round(tool: RecordingTool, calls: Sequence[tuple[str, JSON]]) -> dict[str, tuple[str, bool]]:
    """Run an Interaction whose model makes ``calls`` (id, arguments) of ``tool`` in one round,
    then answers; the model's view of each call's result: {call id: (text, is_error)}."""
    from agentfold.adapters.eventstore import EventStore
    from agentfold.adapters.interaction import InteractionConfig, compile_interaction
    from agentfold.adapters.runtime import Runtime

    model = ScriptedModel([tool_round(*(call(cid, tool.name, args) for cid, args in calls)), final("done")])
    program = compile_interaction(
        InteractionConfig(name=f"round.{tool.name}", model=model, tools=[tool], max_concurrent_tool_calls=2)
    )
    store = EventStore("memory:")
    try:
        with Runtime(store) as runtime:
            assert runtime.start(program, chat_input("go")).result(WAIT).status == "completed"
    finally:
        store.close()
    return {
        r["id"]: (text_of(r["output"]), bool(r.get("is_error")))
        for m in model.requests[1].messages if m["role"] == "tool" for r in m["tool_results"]
    }

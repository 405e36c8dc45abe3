"""Tools and dispatch: behaviour the mutation audit of 2026-12-05 ("tools") found undefended.
Each test failed with its mutant planted and passes without it.

- docs/interaction.md ("Observers"): ``tool_observer.on_tool_started/on_tool_settled`` see each
  attempt; their exceptions are caught and counted (``observation_failures``) and never change a
  settlement. The outcome an observer is told is the attempt's own (adapters/tools.py: succeeded,
  failed, rejected; none for an input request or an unknown outcome).
- adapters/tools.py, the outcome precedence: a ToolFailure in the error chain comes before an
  input request.
- docs/python.md (the dispatcher's ``context``): ``context.cancelled`` is set when the run is
  being canceled or its owner is stopping; adapters/dispatch.py: a TimerDispatcher called
  directly and told to stop settles ``stopped`` at once.
Real runtimes on memory and SQLite stores, real tools; the model is a ScriptedModel.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.tools import ToolFailure, ToolInputRequired, ToolInvocation, ToolOutput
from agentfold.domain.canonical import JSON
from agentfold.domain.program import Program
from agentfold.domain.requests import EffectRequest, Settlement
from tests.kernel_programs import chain_program

WAIT = 20.0


def _round(*names: str) -> dict[str, Any]:
    calls = [{"id": f"c-{name}", "name": name, "arguments": "{}"} for name in names]
    return {"message": {"role": "assistant", "content": None, "tool_calls": calls}, "finish_reason": "tool_calls"}


APPROVAL: JSON = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
FINAL = {"message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}


class _Tool:
    """A tool that counts its calls and behaves as told: returns, or raises what it is given."""

    description = "Does one thing."
    parameters: JSON = {"type": "object"}

    def __init__(self, name: str, raises: BaseException | None = None) -> None:
        self.name = name
        self.raises = raises
        self.calls = 0
        self._lock = threading.Lock()

    @staticmethod
    def concurrency(call: Any, arguments: JSON) -> tuple[str, bool]:
        return "", True  # the whole round runs at once, so an unknown call holds none back

    def call(self, invocation: ToolInvocation, arguments: JSON) -> ToolOutput:
        with self._lock:
            self.calls += 1
        if self.raises is not None:
            raise self.raises
        return ToolOutput.text(f"{self.name} done")


class _Observer:
    def __init__(self, raise_on_start: bool = False) -> None:
        self.raise_on_start = raise_on_start
        self.started: list[str] = []
        self.settled: dict[str, tuple[str | None, bool, str]] = {}
        self._lock = threading.Lock()

    def on_tool_started(self, invocation: ToolInvocation) -> None:
        with self._lock:
            self.started.append(invocation.call.id)
        if self.raise_on_start:
            raise RuntimeError("an observer bug must not change anything")

    def on_tool_settled(self, invocation: ToolInvocation, settlement: Any) -> None:
        with self._lock:
            self.settled[invocation.call.id] = (settlement.disposition, settlement.input_required, settlement.failure)


def _tool_dispatcher(program: Program) -> Any:
    return program.strategy.definition.tool_program.dispatcher  # type: ignore[attr-defined]


def test_a_tool_observer_is_told_each_attempts_own_outcome() -> None:
    """A returned output is ``succeeded``, a ToolFailure its own kind (``rejected`` / ``failed``),
    an unknown outcome no disposition with the error's text, an input request no disposition and
    ``input_required``. Kills T10 (a ToolFailure observed as ``succeeded``: monitoring counted
    refusals as successes) and T20 (an input request observed as a bare unknown)."""
    tools = [
        _Tool("ok"),
        _Tool("refuse", ToolFailure("rejected", "not allowed")),
        _Tool("fail", ToolFailure("failed", "it broke")),
        _Tool("lost", OSError("connection reset")),
        _Tool("ask", ToolInputRequired({"question": "approve?"}, APPROVAL, {"asked": True})),
    ]
    observer = _Observer()
    model = ScriptedModel([_round("ok", "refuse", "fail", "lost", "ask"), FINAL])
    program = compile_interaction(InteractionConfig(
        name="tools.observed", model=model, tools=tools, tool_observer=observer, max_concurrent_tool_calls=5))
    store = EventStore("memory:")
    try:
        with Runtime(store) as runtime:
            run = runtime.start(program, {"messages": [{"role": "user", "content": "go"}]})
            runtime.wait_idle(run.tree_id, timeout=WAIT)
    finally:
        store.close()
    assert [t.calls for t in tools] == [1, 1, 1, 1, 1]
    assert sorted(observer.started) == ["c-ask", "c-fail", "c-lost", "c-ok", "c-refuse"]
    assert observer.settled == {
        "c-ok": ("succeeded", False, ""),
        "c-refuse": ("rejected", False, ""),
        "c-fail": ("failed", False, ""),
        "c-lost": (None, False, "OSError: connection reset"),
        "c-ask": (None, True, ""),
    }
    assert _tool_dispatcher(program).observation_failures.counts == {}


def test_an_observer_raising_when_a_tool_starts_changes_no_outcome_and_is_counted() -> None:
    """The observer's exception in ``on_tool_started`` is counted; the tool still runs once and
    the model reads its output. Kills T15 (the start callback not isolated: every call of a run
    with a faulty observer recorded unknown without running, for a host to resolve)."""
    tool = _Tool("ok")
    observer = _Observer(raise_on_start=True)
    model = ScriptedModel([_round("ok"), FINAL])
    program = compile_interaction(InteractionConfig(
        name="tools.observer_start", model=model, tools=[tool], tool_observer=observer))
    store = EventStore("memory:")
    try:
        with Runtime(store) as runtime:
            run = runtime.start(program, {"messages": [{"role": "user", "content": "go"}]})
            runtime.wait_idle(run.tree_id, timeout=WAIT)
            assert tool.calls == 1
            assert run.result(WAIT).status == "completed"
    finally:
        store.close()
    [tool_message] = [m for m in model.requests[1].messages if m["role"] == "tool"]
    assert [(r["id"], r["output"]["content"][0]["text"], bool(r.get("is_error")))
            for r in tool_message["tool_results"]] == [("c-ok", "ok done", False)]
    assert observer.settled == {"c-ok": ("succeeded", False, "")}
    counts = _tool_dispatcher(program).observation_failures
    assert counts.counts == {"tool_started": 1}
    assert "an observer bug must not change anything" in counts.last["tool_started"]


def test_a_call_in_flight_is_told_to_stop_when_its_owner_releases_the_tree(tmp_path: Path) -> None:
    """docs/python.md (the dispatcher's ``context``): ``context.cancelled`` is set when "the run is
    being canceled or its owner is stopping". ``Runtime.release`` stops the owner: a call in
    flight is told at once. Kills R4 (the owner line's stop not setting its flights' flags: the
    call ran on unaware, to its own timeout, after its owner had let go of the tree)."""
    entered = threading.Event()
    told: list[bool] = []

    def waits_for_stop(request: EffectRequest, context: DispatchContext) -> Settlement:
        entered.set()
        told.append(context.cancelled.wait(10))
        return Settlement.succeeded({"value": 1})

    program = chain_program(waits_for_stop, name="tools.release")
    store = EventStore(f"sqlite:///{tmp_path / 'release.db'}")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            run = runtime.start(program, {"n": 1})
            assert entered.wait(WAIT)
            runtime.release(run.tree_id)
            deadline = time.monotonic() + 3
            while not told and time.monotonic() < deadline:
                time.sleep(0.005)
            assert told == [True]
    finally:
        store.close()


def test_a_tool_failure_beside_an_input_request_in_one_error_is_the_definite_result() -> None:
    """adapters/tools.py, the outcome precedence: a ToolFailure anywhere in the error chain (rule
    3) comes before an input request (rule 4). A tool that ends with both in one exception group
    gives the model its refusal; no wait is opened. Kills T21 (the input request taken first: the
    run waited for a human's answer to a call that had already refused)."""
    from agentfold.adapters.host import Host

    both = ExceptionGroup("ended", [
        ToolInputRequired({"question": "approve?"}, APPROVAL, {"asked": True}),
        ToolFailure("rejected", "not allowed"),
    ])
    tool = _Tool("guarded", both)
    model = ScriptedModel([_round("guarded"), FINAL])
    program = compile_interaction(InteractionConfig(name="tools.precedence", model=model, tools=[tool]))
    store = EventStore("memory:")
    try:
        with Runtime(store) as runtime:
            run = runtime.start(program, {"messages": [{"role": "user", "content": "go"}]})
            runtime.wait_idle(run.tree_id, timeout=WAIT)
            assert Host(runtime).pending(run.tree_id) == []
            assert run.result(WAIT).status == "completed"
    finally:
        store.close()
    assert tool.calls == 1
    [tool_message] = [m for m in model.requests[1].messages if m["role"] == "tool"]
    assert [(r["id"], r["output"]["content"][0]["text"], bool(r.get("is_error")))
            for r in tool_message["tool_results"]] == [("c-guarded", "not allowed", True)]


def test_a_timer_called_directly_and_told_to_stop_before_its_instant_settles_stopped_at_once() -> None:
    """adapters/dispatch.py ``TimerDispatcher.dispatch``, for a caller that calls the dispatcher
    itself: when the context is cancelled before the instant, the outcome is ``stopped`` (a
    definite failure), at once, never ``fired``. Kills D2 (a stopped timer reported as fired:
    a deadline that was canceled counted as reached)."""
    from agentfold.adapters.dispatch import TimerDispatcher

    class InAMinute(TimerDispatcher):
        def due(self, request: EffectRequest) -> float:
            return self.clock() + 60.0

    context = DispatchContext()
    threading.Timer(0.05, context.cancelled.set).start()
    began = time.monotonic()
    settlement = InAMinute().dispatch(None, context)  # type: ignore[arg-type]  # due() never reads it
    assert time.monotonic() - began < 5
    assert settlement == InAMinute().stopped(None)  # type: ignore[arg-type]
    assert settlement.status.value == "failed" and "stopped" in settlement.payload["error"]

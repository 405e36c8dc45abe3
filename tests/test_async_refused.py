"""The API is synchronous: async dispatchers, tools and models are refused when built.

Nothing in agentfold awaits. An ``async def`` dispatcher (or tool, or model) used to be
accepted; each call then only built a coroutine, Python printed "coroutine ... was never
awaited", and the Effect was recorded unknown although nothing ran. Now the Program
(or FunctionDispatcher, or Interaction) refuses it with ``program.invalid`` (or the
Interaction's codes, tests/interaction/test_build_refusals.py). A plain function that
returns a coroutine anyway keeps today's recorded outcome (unknown), but the coroutine
is closed: no "never awaited" warning leaks.
"""

from __future__ import annotations

import functools
import gc
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from agentfold.adapters.dispatch import DispatchContext, FunctionDispatcher
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ModelRequest, ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.tools import ToolInvocation, ToolOutput
from agentfold.domain.canonical import JSON
from agentfold.domain.errors import InvalidInput
from agentfold.domain.ids import Digest
from agentfold.domain.program import Complete, Continue, Descriptor, Program, Step, dispatcher_effect
from agentfold.domain.requests import EffectRequest, Settlement
from tests.kernel_programs import JsonStrategy


class OneCall(JsonStrategy):
    """One dispatcher Effect, then complete."""

    def initial(self, input: JSON) -> Any:
        return {}

    def decide(self, state: Any, window: Any) -> Step:
        if not window:
            return Step(0, Continue((dispatcher_effect({"x": 1}),)))
        return Step(1, Complete({"ok": True}))


def program(name: str, dispatcher: object) -> Program:
    return Program(Descriptor(name), OneCall(), Digest.of(name.encode()), Digest.of(b"-"),
                   dispatcher=dispatcher)


async def async_dispatch(request: EffectRequest, context: DispatchContext) -> Settlement:
    return Settlement.succeeded(1)


class AsyncCallable:
    async def __call__(self, request: EffectRequest, context: DispatchContext) -> Settlement:
        return Settlement.succeeded(1)


class AsyncDispatcher:
    async def dispatch(self, request: EffectRequest, context: DispatchContext) -> Settlement:
        return Settlement.succeeded(1)


class NotADispatcher:
    pass


@pytest.mark.parametrize(
    "fn", [async_dispatch, AsyncCallable(), functools.partial(async_dispatch)], ids=["function", "callable", "partial"]
)
def test_function_dispatcher_refuses_an_async_function(fn: Any) -> None:
    with pytest.raises(InvalidInput) as caught:
        FunctionDispatcher(fn)
    assert caught.value.code == "program.invalid"
    assert caught.value.message.endswith("is an async function")
    assert "synchronous" in caught.value.hint and "asyncio.run" in caught.value.hint


def test_function_dispatcher_refuses_what_is_not_a_function() -> None:
    with pytest.raises(InvalidInput) as caught:
        FunctionDispatcher(None)
    assert caught.value.code == "program.invalid"
    assert "got NoneType" in caught.value.message


def test_a_program_refuses_a_dispatcher_whose_dispatch_is_async() -> None:
    with pytest.raises(InvalidInput) as caught:
        program("async.method", AsyncDispatcher())
    assert caught.value.code == "program.invalid"
    assert caught.value.message == (
        "program async.method: its dispatcher's dispatch (AsyncDispatcher.dispatch) is an async function"
    )
    assert "synchronous" in caught.value.hint


@pytest.mark.parametrize(
    ("dispatcher", "message", "hint"),
    [
        (async_dispatch, "its dispatcher is an async function, not a Dispatcher", "asyncio.run"),
        (NotADispatcher(), "its dispatcher (of type NotADispatcher) has no dispatch(request, context) method",
         "FunctionDispatcher(fn)"),
        (lambda request, context: Settlement.succeeded(1),
         "its dispatcher (of type function) has no dispatch(request, context) method", "FunctionDispatcher(fn)"),
    ],
    ids=["async-function", "object", "plain-function"],
)
def test_a_program_refuses_a_dispatcher_without_dispatch(dispatcher: object, message: str, hint: str) -> None:
    """It used to be accepted; every call was then an unknown Effect (AttributeError)."""
    with pytest.raises(InvalidInput) as caught:
        program("no.dispatch", dispatcher)
    assert caught.value.code == "program.invalid"
    assert caught.value.message == f"program no.dispatch: {message}"
    assert hint in caught.value.hint


@contextmanager
def no_unawaited_coroutine_warning() -> Iterator[None]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
        gc.collect()
    leaked = [str(w.message) for w in caught if "never awaited" in str(w.message)]
    assert leaked == []


def unknown_after_run(prog: Program, input: JSON) -> tuple[list[dict[str, Any]], str]:
    store = EventStore("memory:")
    try:
        with Runtime(store) as runtime:
            run = runtime.start(prog, input)
            runtime.wait_idle(run.tree_id, timeout=30)
            host = Host(runtime)
            return [u["diagnostic"] for u in host.unknown(run.tree_id)], host.run(run.tree_id)["status"]
    finally:
        store.close()


def test_a_plain_function_that_returns_a_coroutine_stays_unknown_without_a_warning() -> None:
    """Today's recorded outcome (unknown, ``dispatcher returned coroutine``) is kept; the
    coroutine is closed, so Python prints no "never awaited" warning."""

    def returns_coroutine(request: EffectRequest, context: DispatchContext) -> Any:
        return async_dispatch(request, context)

    with no_unawaited_coroutine_warning():
        diagnostics, status = unknown_after_run(program("returns.coroutine", FunctionDispatcher(returns_coroutine)), {})
    assert diagnostics == [{"kind": "contract", "code": "engine.dispatch.settlement.invalid",
                            "message": "dispatcher returned coroutine"}]
    assert status == "running"


class ReturnsCoroutine:
    """A Dispatcher class of the user's own (not FunctionDispatcher) whose plain dispatch
    returns a coroutine: the runtime closes it."""

    def dispatch(self, request: EffectRequest, context: DispatchContext) -> Any:
        return async_dispatch(request, context)


def test_a_dispatcher_class_that_returns_a_coroutine_stays_unknown_without_a_warning() -> None:
    with no_unawaited_coroutine_warning():
        diagnostics, status = unknown_after_run(program("class.returns.coroutine", ReturnsCoroutine()), {})
    assert diagnostics == [{"kind": "contract", "code": "engine.dispatch.settlement.invalid",
                            "message": "dispatcher returned coroutine"}]
    assert status == "running"


class CoroutineTool:
    name = "coro"
    description = "A plain call that returns a coroutine."
    parameters: JSON = {"type": "object"}

    def call(self, invocation: ToolInvocation, arguments: JSON) -> Any:
        async def later() -> ToolOutput:
            return ToolOutput.text("never")

        return later()


def test_a_tool_that_returns_a_coroutine_stays_unknown_without_a_warning() -> None:
    model = ScriptedModel([
        {"message": {"role": "assistant", "content": None,
                     "tool_calls": [{"id": "c1", "name": "coro", "arguments": "{}"}]}, "finish_reason": "tool_calls"},
        {"message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"},
    ])
    interaction = compile_interaction(InteractionConfig(name="coro.tool", model=model, tools=[CoroutineTool()]))
    with no_unawaited_coroutine_warning():
        diagnostics, _ = unknown_after_run(interaction, {"messages": [{"role": "user", "content": "go"}]})
    assert diagnostics == [{"kind": "external", "code": "engine.dispatch.failed",
                            "message": "TypeError: tool coro returned coroutine, not a ToolOutput"}]


class CoroutineModel:
    def call(self, request: ModelRequest) -> Any:
        async def later() -> dict[str, Any]:
            return {}

        return later()


def test_a_model_that_returns_a_coroutine_stays_unknown_without_a_warning() -> None:
    interaction = compile_interaction(InteractionConfig(name="coro.model", model=CoroutineModel()))
    with no_unawaited_coroutine_warning():
        diagnostics, _ = unknown_after_run(interaction, {"messages": [{"role": "user", "content": "go"}]})
    assert len(diagnostics) == 1
    assert diagnostics[0]["code"] == "engine.dispatch.failed"
    assert diagnostics[0]["message"].startswith("ModelError: invalid model response")


def test_the_refused_callables_never_reach_a_store() -> None:
    """Refused when built: there is no Program to start, so nothing is recorded."""
    store = EventStore("memory:")
    try:
        with Runtime(store) as runtime:
            with pytest.raises(InvalidInput):
                runtime.start(program("never.started", FunctionDispatcher(async_dispatch)), {})
            assert Host(runtime).runs() == []
    finally:
        store.close()


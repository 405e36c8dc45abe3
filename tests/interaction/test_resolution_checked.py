"""``Runtime.resolve_unknown_effect`` asks the Program whether it can use a host's outcome.

The Python runtime is the lowest surface a host resolves an unknown Effect through. Before
``Program.check_resolution``, it checked the kernel's rules only (a definite status, bounded
JSON): a settlement built by hand for an Interaction's model call (``{"answer": 1}``), a tool
output in a form the settle helpers would have rewritten, or a transform's output its schema
refuses was recorded, and the run then failed for good on it. Each is now refused before
anything is appended (the Effect stays unknown, the store does not move), and the outcome
built with the settle helpers (what ``Host.resolve``, ``agentfold resolve`` and the HTTP API
record) still completes the run. A ``failed`` outcome, the documented way for a host to fail
the call, is not checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.interaction import InteractionConfig, compile_interaction
from agentfold.adapters.models import ScriptedModel
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.team import TransformConfig, transform
from agentfold.adapters.tools import ToolInvocation, ToolOutput
from agentfold.domain.errors import InvalidInput
from agentfold.domain.events import EffectResolved
from agentfold.domain.ids import EffectID
from agentfold.domain.interaction.settle import settle_model_result, settle_tool_result
from agentfold.domain.program import Program
from agentfold.domain.requests import Settlement, effect_request

FINAL = {"finish_reason": "stop", "message": {"role": "assistant", "content": [{"type": "text", "text": "done"}]}}


class FlakyLookup:
    """A tool whose call raises an error that is no ToolFailure: its outcome is unknown."""

    name = "lookup"
    description = "Looks something up."
    parameters: Any = {"type": "object"}

    def call(self, invocation: ToolInvocation, arguments: Any) -> ToolOutput:
        raise RuntimeError("the lookup service dropped the connection")


class Crash(BaseException):
    """Not an Exception: it escapes the transform's dispatcher, which leaves the call unknown."""


def _crash(value: Any) -> Any:
    raise Crash("the worker died")


def model_program() -> Program:
    return compile_interaction(InteractionConfig(
        name="test.checked_model", model=ScriptedModel([{"error": "HTTP 502 from the provider"}, FINAL])))


def tool_program() -> Program:
    asks = {"finish_reason": "tool_calls", "message": {"role": "assistant", "tool_calls": [
        {"id": "c1", "name": "lookup", "arguments": "{}"}]}}
    return compile_interaction(InteractionConfig(
        name="test.checked_tool", model=ScriptedModel([asks, FINAL]), tools=[FlakyLookup()]))


def transform_program() -> Program:
    return transform(TransformConfig("test.checked_transform", _crash, output_schema={"type": "integer"}))


@contextlib.contextmanager
def running(tmp_path: Path, program: Program, name: str) -> Iterator[tuple[Runtime, EventStore]]:
    """A Runtime binding ``program`` on a fresh SQLite store, and the store."""
    store = EventStore(f"sqlite:///{tmp_path / name}")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            yield runtime, store
    finally:
        store.close()


def _parked(runtime: Runtime, program: Program, value: Any) -> tuple[Any, EffectID]:
    handle = runtime.start(program, value)
    tree = runtime.wait_idle(handle.tree_id)
    [effect] = list(tree.unknown_ids)
    return handle, effect


def _refused(runtime: Runtime, store: EventStore, handle: Any, effect: EffectID, settlement: Settlement,
             code: str, words: str) -> None:
    before = store.load(handle.tree_id).state.version
    with pytest.raises(InvalidInput) as raised:
        runtime.resolve_unknown_effect(effect, settlement)
    assert raised.value.code == code, raised.value
    assert words in raised.value.message, raised.value.message
    after = store.load(handle.tree_id).state
    assert after.version == before, "a refused outcome appended events"
    assert effect in after.unknown_ids


def _helpers_outcome_completes(runtime: Runtime, store: EventStore, handle: Any, program: Program, effect: EffectID,
                               settle: Callable[[Program, Any, Any], Settlement], value: Any) -> None:
    """Resolve ``effect`` with what ``settle`` (a settle helper) builds from ``value`` for the
    Effect's own Program and request: the run completes."""
    tree = store.load(handle.tree_id, Catalog([program]).resolve).state
    found = tree.find_effect(effect)
    assert found is not None
    owner = Catalog([program]).resolve(found[0].program)
    assert owner is not None
    runtime.resolve_unknown_effect(effect, settle(owner, effect_request(tree, found[0].process_id, effect, owner), value))
    result = runtime.result(handle.tree_id, timeout=30)
    assert result.status == "completed", result


def test_a_hand_built_model_outcome_is_refused_and_the_helpers_one_completes_the_run(tmp_path: Path) -> None:
    program = model_program()
    with running(tmp_path, program, "model.db") as (runtime, store):
        handle, effect = _parked(runtime, program, {"messages": [{"role": "user", "content": "hi"}]})
        _refused(runtime, store, handle, effect, Settlement.succeeded({"answer": 1}),
                 "interaction.settlement.invalid", '{"model_result": {"response"')
        # The right envelope around a response the Interaction would fail the run on.
        _refused(runtime, store, handle, effect,
                 Settlement.succeeded({"model_result": {"response": {"finish_reason": "eos", "message": {
                     "role": "assistant", "content": [{"type": "text", "text": "x"}]}}}}),
                 "interaction.settlement.invalid", "unknown finish reason 'eos'")
        _helpers_outcome_completes(runtime, store, handle, program, effect, settle_model_result, FINAL)


def test_a_tool_output_the_helpers_would_rewrite_is_refused_and_theirs_completes_the_run(tmp_path: Path) -> None:
    program = tool_program()
    with running(tmp_path, program, "tool.db") as (runtime, store):
        handle, effect = _parked(runtime, program, {"messages": [{"role": "user", "content": "look it up"}]})
        # Plain text where the stored form is a list of text parts: the round's end would read it wrong.
        plain = {"tool_result": {"completion": {"disposition": "succeeded", "output": {"content": "found it"}}}}
        _refused(runtime, store, handle, effect, Settlement.succeeded(plain),
                 "interaction.settlement.invalid", "build it with them")
        _refused(runtime, store, handle, effect, Settlement.succeeded({"tool_result": {"completion": {
            "disposition": "maybe", "output": {}}}}), "interaction.settlement.invalid", "disposition must be one of")
        _refused(runtime, store, handle, effect, Settlement.succeeded({"result": "found it"}),
                 "interaction.settlement.invalid", '{"tool_result": {"completion"')
        _helpers_outcome_completes(runtime, store, handle, program, effect, settle_tool_result, "found it")


def test_a_failed_tool_outcome_is_the_hosts_to_give_and_fails_the_call(tmp_path: Path) -> None:
    program = tool_program()
    with running(tmp_path, program, "failed.db") as (runtime, _store):
        handle, effect = _parked(runtime, program, {"messages": [{"role": "user", "content": "look it up"}]})
        runtime.resolve_unknown_effect(effect, Settlement.failed("the lookup was never made"))
        result = runtime.result(handle.tree_id, timeout=30)
        assert result.status == "failed", result
        assert "interaction.host.failed" in str(result.termination), result.termination


def test_a_transform_outcome_outside_its_output_schema_is_refused(tmp_path: Path) -> None:
    program = transform_program()
    with running(tmp_path, program, "transform.db") as (runtime, store):
        handle, effect = _parked(runtime, program, 20)
        _refused(runtime, store, handle, effect, Settlement.succeeded({"result": 40}),
                 "engine.effect.settlement_invalid", 'a transform\'s outcome is {"output": ...}')
        _refused(runtime, store, handle, effect, Settlement.succeeded({"output": "forty"}),
                 "engine.effect.settlement_invalid", "its output schema")
        runtime.resolve_unknown_effect(effect, Settlement.succeeded({"output": 40}))
        result = runtime.result(handle.tree_id, timeout=30)
        assert result.status == "completed" and result.output == 40, result


def test_a_check_that_raises_refuses_the_outcome_and_records_nothing(tmp_path: Path) -> None:
    def broken(program: Program, request: Any, status: Any, payload: Any) -> None:
        raise KeyError("phase")

    program = dataclasses.replace(transform_program(), check_resolution=broken)
    with running(tmp_path, program, "broken.db") as (runtime, store):
        handle, effect = _parked(runtime, program, 20)
        _refused(runtime, store, handle, effect, Settlement.succeeded({"output": 40}),
                 "engine.effect.settlement_invalid", "KeyError")
        # A failed outcome is the Program's check to refuse too.
        _refused(runtime, store, handle, effect, Settlement.failed({"error": "it died"}),
                 "engine.effect.settlement_invalid", "refused the outcome of effect")


def test_a_request_that_cannot_be_rebuilt_refuses_the_outcome_and_the_owner_goes_on(tmp_path: Path) -> None:
    """The check runs on the request the dispatcher got, rebuilt by the Program's
    ``expand_request``: when that raises, the outcome is refused; the owner of the run is not
    stopped by it (it was: the resolution's error reached the owner's cycle)."""
    from agentfold.domain.workflow import expand_transform_request

    broken = {"on": True}

    def expand(state: Any, payload: Any) -> Any:
        if broken["on"]:
            raise LookupError("the input's blob store is unreachable")
        return expand_transform_request(state, payload)

    program = dataclasses.replace(transform(TransformConfig("test.checked_expand", lambda v: v * 2)),
                                  expand_request=expand)
    with running(tmp_path, program, "expand.db") as (runtime, store):
        handle, effect = _parked(runtime, program, 20)  # the request could not be built: unknown
        _refused(runtime, store, handle, effect, Settlement.succeeded({"output": 40}),
                 "engine.effect.settlement_invalid", "LookupError")
        broken["on"] = False
        runtime.resolve_unknown_effect(effect, Settlement.succeeded({"output": 40}))
        result = runtime.result(handle.tree_id, timeout=30)
        assert result.status == "completed" and result.output == 40, result


class DownSummarizer:
    """A context processor whose preparation raises: its outcome is unknown (kind ``context``)."""

    def prepare_context(self, request: Any) -> Any:
        raise RuntimeError("the summarizer is down")


@pytest.mark.parametrize("given", [
    [{"role": "user", "content": "hi (summarized)"}],
    {"messages": [{"role": "user", "content": "hi (summarized)"}]},
    {"prepared_context": {"messages": [{"role": "user", "content": "hi (summarized)"}]}},
], ids=["a-list", "messages", "the-settlement"])
def test_a_context_preparation_is_resolved_with_the_prepared_messages(tmp_path: Path, given: Any) -> None:
    """``Host.resolve`` (as ``agentfold resolve`` and the HTTP API) builds a context
    preparation's outcome with ``settle_prepared_context``: the messages are stored as the
    helper writes them, and the check does not refuse them (it did, for text content)."""
    from agentfold.adapters.host import Host

    program = compile_interaction(InteractionConfig(
        name="test.checked_context", model=ScriptedModel([FINAL]), context_processor=DownSummarizer(),
        max_model_calls=2))
    with running(tmp_path, program, "context.db") as (runtime, store):
        host = Host(runtime)
        handle, effect = _parked(runtime, program, {"messages": [{"role": "user", "content": "hi"}]})
        [entry] = host.unknown(str(handle.tree_id))
        assert entry["kind"] == "context", entry
        with pytest.raises(InvalidInput) as raised:
            host.resolve(effect, output="hi (summarized)")
        assert raised.value.code == "host.resolution_invalid", raised.value
        assert "list of messages" in raised.value.message, raised.value.message
        host.resolve(effect, output=given)
        result = runtime.result(handle.tree_id, timeout=30)
        assert result.status == "completed", result
        [resolved] = [r.event for r in store.read(handle.tree_id)
                  if isinstance(r.event, EffectResolved) and r.event.effect_id == effect]
        assert resolved.payload == {"prepared_context": {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi (summarized)"}]}]}}, resolved.payload


def test_a_settlement_built_with_a_status_that_is_text_is_refused(tmp_path: Path) -> None:
    program = transform_program()
    with running(tmp_path, program, "status.db") as (runtime, store):
        handle, effect = _parked(runtime, program, 20)
        # Settlement("succeeded", ...) raised a bare AttributeError ('str' object has no attribute 'definite').
        _refused(runtime, store, handle, effect, Settlement("succeeded", {"output": 40}),  # type: ignore[arg-type]
                 "engine.effect.settlement_invalid", "a succeeded or failed Settlement")


def test_a_check_that_raises_system_exit_refuses_and_the_owner_goes_on(tmp_path: Path) -> None:
    calls = {"n": 0}

    def exits(program: Program, request: Any, status: Any, payload: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise SystemExit(3)

    program = dataclasses.replace(transform_program(), check_resolution=exits)
    with running(tmp_path, program, "exit.db") as (runtime, store):
        handle, effect = _parked(runtime, program, 20)
        _refused(runtime, store, handle, effect, Settlement.succeeded({"output": 40}),
                 "engine.effect.settlement_invalid", "SystemExit")
        assert runtime.owns(handle.tree_id)  # the owner did not stop (it did: engine.runtime.failed)
        runtime.resolve_unknown_effect(effect, Settlement.succeeded({"output": 40}))
        result = runtime.result(handle.tree_id, timeout=30)
        assert result.status == "completed" and result.output == 40, result

"""The coordination InputGate (reference section 8.4, scenario 36; Scope
``coordination/input_gate_test.go``), as a root Program on real stores.

Adaptations: Scope commits an invalid answer and then fails the gate with
``coordination.protocol.invalid``; our gate's wait carries the answer schema as its
``response_schema``, so the Runtime refuses a bad answer at admission (classified error,
nothing stored) and the protocol failure remains for an answer that reaches the Step by
another way (checked on the Strategy directly). Scope's "restore" is a new Runtime folding the
stored events (``WriterActivated``); the "early answer" interleaving (answer admitted after
the wait was declared, before the gate's Step adopted it) is produced by driving the real
Kernel by hand, as in tests/interaction/test_scenarios.py (scenario 20).
"""

from __future__ import annotations

from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.runtime import RandomIds, index_head, utc_now
from agentfold.adapters.team import InputGateConfig, compile_input_gate
from agentfold.domain.errors import AgentfoldError, ClassifiedError, InvalidInput
from agentfold.domain.ids import SignalID, StartID, TreeID, WaitID
from agentfold.domain.kernel import Kernel, start_tree
from agentfold.domain.program import Complete, Signal, SignalRequest, Wait
from agentfold.domain.tree import TreeState
from tests.interaction.support import open_runtime, recover
from tests.interaction.tools import WAIT, wait_until
from tests.team import programs as P


def waiting_gate(runtime: Any, handle: Any) -> Any:
    wait_until(lambda: runtime.capture(handle.tree_id).root.current_wait is not None, "the gate to wait")
    return runtime.capture(handle.tree_id).root


def stream_length(store: EventStore, tree_id: Any) -> int:
    return len(store.read(tree_id))


def test_s36_the_gate_waits_with_its_request_and_completes_with_the_answer_signal(store_url: str) -> None:
    """The gate declares the wait ``coordination.input`` with the request as its prompt and the
    answer schema as its response schema; the addressed answer completes it with the Signal
    itself ``{"id", "wait_id", "payload"}``; the same answer again is not accepted twice; the
    completed gate keeps nothing but its phase. Usage: 3 Steps, 1 Effect, 2 signals (Scope's
    ``CommittedSteps: 3, PreparedEffects: 1, AcceptedSignals: 2``)."""
    gate = P.gate()
    store = EventStore(store_url)
    try:
        with open_runtime(store, gate) as runtime:
            handle = runtime.start(gate, "request")
            root = waiting_gate(runtime, handle)
            wait = root.waits[root.current_wait]
            assert (str(wait.key), wait.prompt, wait.response_schema) == ("coordination.input", "request", P.TEXT)
            answer = SignalRequest("signal:answer", "answer", root.current_wait)
            assert runtime.deliver_signals(root.process_id, [answer]) is True
            result = handle.result(WAIT)
            length = stream_length(store, handle.tree_id)
            assert runtime.deliver_signals(root.process_id, [answer]) is False
            with pytest.raises(AgentfoldError) as caught:  # the same id with another payload
                runtime.deliver_signals(root.process_id, [SignalRequest("signal:answer", "other", root.current_wait)])
            assert caught.value.code == "engine.signal.conflict"
            assert stream_length(store, handle.tree_id) == length
            final = runtime.capture(handle.tree_id).root
    finally:
        store.close()
    assert result.status == "completed"
    assert result.output == {"id": "signal:answer", "wait_id": str(root.current_wait), "payload": "answer"}
    assert result.usage == {"steps": 3, "effects": 1, "signals": 2}
    assert final.state == {"phase": "completed"}


@pytest.mark.parametrize("restore", [False, True], ids=["same_writer", "restored"])
def test_s36_an_early_answer_is_honoured_once_and_keeps_its_identity_across_recovery(store_url: str, restore: bool) -> None:
    """Scope TestInputGatePreservesIdentityAcrossRecoveryAndEarlyAnswer.

    The gate has declared its wait but not adopted it when the answer is admitted; the same
    answer again admits nothing. Same writer: the Kernel drives the gate to its end. Restored:
    the history so far is stored and a new Runtime recovers the tree and drives it. Either way
    the gate completes with the answer's id, wait id and payload, having accepted 2 signals
    (the opening and the answer) and prepared 1 Effect.
    """
    gate = P.gate()
    catalog = Catalog([gate])
    ids = RandomIds()
    started = start_tree(gate, "request", start_id=StartID(f"start:early-{restore}"),
                         root_id=ids.root_process_id(), incarnation_id=ids.incarnation_id())
    tree = TreeState(catalog.resolve)
    tree.apply(started)
    kernel = Kernel(tree, catalog.resolve, ids)
    events: list[Any] = [started]
    events.extend(kernel.advance(max_events=1).events)  # the Step declaring the wait (opened at once)
    root = tree.root
    [wait_id] = list(root.waits)
    assert root.current_wait is None and not root.waits[wait_id].closed
    answer = SignalRequest("signal:early-answer", "answer", wait_id)
    admitted = kernel.admit_signals(root.process_id, [answer])
    assert admitted
    events.extend(admitted)
    assert kernel.admit_signals(root.process_id, [answer]) == []
    if not restore:
        events.extend(kernel.advance().events)
        assert tree.root.status == "completed"
    store = EventStore(store_url)
    try:
        store.append(started.tree_id, 0, events, previous_digest=None, timestamp=utc_now(),
                     head=index_head(tree, started.tree_id, events, utc_now()))
        with open_runtime(store, catalog=catalog) as runtime:
            if restore:
                recover(runtime, started.tree_id)
            result = runtime.result(started.tree_id, WAIT)
    finally:
        store.close()
    assert result.status == "completed"
    assert result.output == {"id": "signal:early-answer", "wait_id": str(wait_id), "payload": "answer"}
    assert result.usage["effects"] == 1 and result.usage["signals"] == 2


def test_s36_an_invalid_answer_is_refused_at_admission_and_nothing_is_stored(store_url: str) -> None:
    """Scope TestInputGateDoesNotCommitAnInvalidOrCanceledAnswer (invalid-schema). A bad answer
    (``123`` for a string schema) is refused with a classified error; the stream is unchanged
    and the gate still waits; a valid answer afterwards completes it."""
    gate = P.gate()
    store = EventStore(store_url)
    try:
        with open_runtime(store, gate) as runtime:
            handle = runtime.start(gate, "request")
            root = waiting_gate(runtime, handle)
            runtime.wait_idle(handle.tree_id)
            before = stream_length(store, handle.tree_id)
            with pytest.raises(AgentfoldError) as caught:
                runtime.deliver_signals(root.process_id, [SignalRequest("signal:bad", 123, root.current_wait)])
            assert caught.value.code == "engine.signal.schema" and caught.value.message
            assert stream_length(store, handle.tree_id) == before
            assert runtime.capture(handle.tree_id).root.current_wait == root.current_wait
            assert runtime.deliver_signals(root.process_id, [SignalRequest("signal:good", "ok", root.current_wait)])
            result = handle.result(WAIT)
    finally:
        store.close()
    assert result.status == "completed" and result.output["id"] == "signal:good"


def test_a_host_answer_is_checked_before_anything_is_stored() -> None:
    """``Host.answer`` / ``answer_gate`` (and the CLI and HTTP ``answer``): an answer that breaks the
    gate's schema or is above 1 MiB (as a tool's answer) is refused, nothing stored; a wait that is
    not the gate's current one is refused; the good answer completes the gate."""
    gate = P.gate()
    store = EventStore("memory:")
    try:
        with open_runtime(store, gate) as runtime:
            handle = runtime.start(gate, "request")
            waiting_gate(runtime, handle)
            runtime.wait_idle(handle.tree_id)
            host = Host(runtime)
            [entry] = host.gates(str(handle.tree_id))
            before = stream_length(store, handle.tree_id)
            cases = [(123, entry["wait_id"], "engine.signal.schema"),
                     ("x" * (1024 * 1024 + 1), entry["wait_id"], "payload.too_large"),
                     ("ok", "wait:" + "0" * 64, "engine.signal.rejected")]
            for answer, wait_id, code in cases:
                with pytest.raises(AgentfoldError) as caught:
                    host.answer_gate(entry["process_id"], wait_id, answer)
                assert caught.value.code == code, (code, caught.value)
            assert stream_length(store, handle.tree_id) == before
            assert host.answer_gate(entry["process_id"], entry["wait_id"], "ok", signal_id="signal:ok")
            result = handle.result(WAIT)
    finally:
        store.close()
    assert result.status == "completed" and result.output["payload"] == "ok"


def test_s36_an_unaddressed_signal_is_refused_at_admission(store_url: str) -> None:
    """Spec 8.4: "unaddressed signals are rejected at admission" (the gate has no signal schema)."""
    gate = P.gate()
    store = EventStore(store_url)
    try:
        with open_runtime(store, gate) as runtime:
            handle = runtime.start(gate, "request")
            root = waiting_gate(runtime, handle)
            runtime.wait_idle(handle.tree_id)
            before = stream_length(store, handle.tree_id)
            with pytest.raises(AgentfoldError) as caught:
                runtime.deliver_signals(root.process_id, [SignalRequest("signal:loose", "answer")])
            assert caught.value.code == "engine.signal.rejected"
            assert stream_length(store, handle.tree_id) == before
            assert not runtime.capture(handle.tree_id).root.terminal
    finally:
        store.close()


def test_s36_a_request_that_breaks_the_request_schema_is_refused_and_nothing_is_stored(store_url: str) -> None:
    """The gate's input is its request, validated by ``request_schema`` at start."""
    gate = P.gate()
    store = EventStore(store_url)
    try:
        with open_runtime(store, gate) as runtime:
            with pytest.raises(AgentfoldError) as caught:
                runtime.start(gate, 5, start_id="start:bad-request")
            assert caught.value.code and caught.value.message
        assert store.head(TreeID.for_start("start:bad-request")) is None  # type: ignore[arg-type]
    finally:
        store.close()


def test_s36_a_canceled_gate_ends_without_an_output(store_url: str) -> None:
    """Scope TestInputGateDoesNotCommitAnInvalidOrCanceledAnswer (canceled): a waiting gate
    canceled by its host ends canceled, with no output."""
    gate = P.gate()
    with open_runtime(store_url, gate) as runtime:
        handle = runtime.start(gate, "request")
        root = waiting_gate(runtime, handle)
        assert runtime.cancel(root.process_id, "cancel before an answer")
        result = handle.result(WAIT)
    assert result.status == "canceled" and result.output is None


def test_s36_an_answer_reaching_the_step_unchecked_is_a_protocol_failure() -> None:
    """``coordination.protocol.invalid`` (contract): an answer that fails the answer schema, or
    a signal not addressed to the gate's wait, refused by the Strategy itself."""
    strategy = P.gate().strategy
    waiting = strategy.decode_state({"phase": "waiting", "wait_id": "wait:gate"})
    for signal in (Signal(SignalID("signal:bad"), 123, WaitID("wait:gate")),
                   Signal(SignalID("signal:elsewhere"), "answer", WaitID("wait:other")),
                   Signal(SignalID("signal:loose"), "answer")):
        with pytest.raises(ClassifiedError) as caught:
            strategy.decide(waiting, [signal])
        assert (caught.value.failure.kind.value, caught.value.failure.code) == ("contract", "coordination.protocol.invalid")


def test_s36_restore_derives_waiting_from_the_wait_id_and_a_completed_gate_keeps_only_its_phase() -> None:
    """Scope TestInputGateRestoreDerivesWaitingFromWaitIdentity and
    TestCompletedInputGateLeavesItsAnswerToTheEngine: a restored waiting state consumes the
    addressed answer and completes with it; contradictory states are refused with contract
    ``coordination.state.invalid``.
    Adaptation: our phases are ``start``/``opening``/``waiting``/``completed``."""
    strategy = P.gate().strategy
    waiting = strategy.decode_state({"phase": "waiting", "wait_id": "wait:gate"})
    step = strategy.decide(waiting, [Signal(SignalID("signal:answer"), "answer", WaitID("wait:gate"))])
    assert isinstance(step.transition, Complete) and step.consumed == 1
    assert step.transition.output == {"id": "signal:answer", "wait_id": "wait:gate", "payload": "answer"}
    assert strategy.decode_state({"phase": "completed"}) == {"phase": "completed"}
    for bad in ({"phase": "waiting"}, {"phase": "completed", "wait_id": "wait:answer"},
                {"phase": "completed", "request": "request"}, {"phase": "ready", "wait_id": "wait:gate"},
                {"phase": "waiting", "wait_id": 5}, "waiting"):
        with pytest.raises(ClassifiedError) as caught:
            strategy.decode_state(bad)
        assert (caught.value.failure.kind.value, caught.value.failure.code) == ("contract", "coordination.state.invalid"), bad


def test_s36_the_gate_adopts_its_opening_and_then_waits() -> None:
    """The opening Step: the engine-owned opening of ``coordination.input`` makes the gate Wait on
    that wait id; a window without the opening is a protocol failure."""
    strategy = P.gate().strategy
    opening = strategy.decode_state({"phase": "opening"})
    opened = Signal(SignalID("signal:engine:opened"), {"operation": "wait", "key": "coordination.input"},
                    WaitID("wait:gate"))
    step = strategy.decide(opening, [opened])
    assert isinstance(step.transition, Wait) and step.consumed == 1
    assert step.next_state == {"phase": "waiting", "wait_id": "wait:gate"}
    with pytest.raises(ClassifiedError) as caught:
        strategy.decide(opening, [Signal(SignalID("signal:answer"), "answer", WaitID("wait:gate"))])
    assert caught.value.failure.code == "coordination.protocol.invalid"


@pytest.mark.parametrize("schema", [None, {"type": 5}, False, {"enum": []}])  # the last two accept no answer
def test_s36_a_gate_without_a_valid_answer_schema_is_refused(schema: Any) -> None:
    """Scope TestInputGateRejectsMissingAnswerSchema: ``coordination.definition.invalid``."""
    with pytest.raises(InvalidInput) as caught:
        compile_input_gate(InputGateConfig("test.gate", answer_schema=schema))
    assert caught.value.code == "coordination.definition.invalid"


@pytest.mark.parametrize("change", [{"request_schema": {"type": 5}}, {"description": 5}, {"description": "\udc80"}])
def test_a_gate_with_an_invalid_request_schema_or_description_is_refused_as_its_definition(change: dict[str, Any]) -> None:
    # The request schema was schema.invalid while the answer schema was coordination.definition.invalid;
    # a description that is no text was accepted.
    with pytest.raises(InvalidInput) as caught:
        compile_input_gate(InputGateConfig("test.gate", answer_schema=True, **change))
    assert caught.value.code == "coordination.definition.invalid", caught.value
    with pytest.raises(InvalidInput) as caught:
        compile_input_gate({"name": "test.gate", "answer_schema": True})  # type: ignore[arg-type]
    assert caught.value.code == "coordination.definition.invalid"


def test_an_answer_to_a_gate_from_a_process_without_its_program_says_it_is_an_input_gate(
    durable_store_url: str,
) -> None:
    # The refusal said "its tool input waits cannot be read" of an InputGate (found by a docs walk).
    from tests.test_cli import agentfold

    gate = P.gate()
    store = EventStore(durable_store_url)
    try:
        with open_runtime(store, gate) as runtime:
            handle = runtime.start(gate, "request")
            root = waiting_gate(runtime, handle)
    finally:
        store.close()
    refused = agentfold("--json", "answer", str(root.process_id), str(root.current_wait), '"yes"',
                        store=durable_store_url)  # the plain script: the gate's Program is not bound
    assert refused.code == 2, refused.stderr
    error = refused.error()
    assert error["code"] == "engine.program.unavailable"
    assert "InputGate waits cannot be read" in error["message"] and "tool input" not in error["message"]

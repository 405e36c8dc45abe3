"""Bad input gets a classified error and appends nothing (issue 2, acceptance 6).

Every refusal goes through the public Python API (Runtime methods and domain value
constructors) on every store backend. Each test asserts the exception class, its
stable ``code``, that the message names the faulty value, and that the store is
byte-for-byte unchanged: same heads, same versions, same events, same notification
log position.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.budget import Budget, Quota
from agentfold.domain.canonical import MAX_PAYLOAD_BYTES
from agentfold.domain.errors import AgentfoldError, EngineCode, InvalidInput, NotFound, Rejected, ResourceLimitExceeded
from agentfold.domain.events import ProcessTerminated, TreeLimits, event_body
from agentfold.domain.ids import (
    ChildKey,
    Digest,
    EffectAttemptID,
    EffectID,
    ProcessID,
    SignalID,
    StartID,
    TreeID,
    WaitID,
    WaitKey,
    effect_id,
    wait_id_for,
)
from agentfold.domain.program import SettlementStatus, SignalRequest
from agentfold.domain.requests import Settlement
from agentfold.domain.tree import TreeState
from tests.bad_input_programs import gate_program, listener_program, pair_program, two_waits_program
from tests.kernel_programs import asker_program, chain_program

# ---------------------------------------------------------------------------
# Helpers


def store_contents(store: EventStore) -> tuple[Any, ...]:
    """Everything an append could change: heads, every tree's events, the notification log."""
    heads = sorted((h.tree_id, h.version, h.status, h.head_digest) for h in store.heads())
    events = {
        tree_id: [(r.position, type(r.event).__name__, event_body(r.event)) for r in store.read(TreeID(tree_id))]
        for tree_id, *_ in heads
    }
    return heads, events, store.max_notification_id()


def refused(
    runtime: Runtime,
    call: Callable[[], Any],
    error: type[AgentfoldError],
    code: str,
    *names: object,
    settle: bool = True,
) -> AgentfoldError:
    """``call`` raises exactly ``error`` with ``code``, names every value in ``names``, appends nothing.

    With ``settle`` the owner is first allowed to finish anything it might still append
    (off when a test holds a dispatch open on purpose).
    """
    store = runtime.store
    before = store_contents(store)
    with pytest.raises(AgentfoldError) as caught:
        call()
    exc = caught.value
    assert type(exc) is error, f"{type(exc).__name__}: {exc}"
    assert exc.code == code, str(exc)
    for name in names:
        assert str(name) in exc.message, f"{name!r} not named in {exc.message!r}"
    if settle:
        for head in store.heads():
            runtime.wait_idle(TreeID(head.tree_id))
    assert store_contents(store) == before
    return exc


def appends_nothing(runtime: Runtime, call: Callable[[], Any]) -> Any:
    before = store_contents(runtime.store)
    value = call()
    for head in runtime.store.heads():
        runtime.wait_idle(TreeID(head.tree_id))
    assert store_contents(runtime.store) == before
    return value


@pytest.fixture
def store(store_url: str) -> Iterator[EventStore]:
    events = EventStore(store_url)
    yield events
    events.close()


@pytest.fixture
def runtime(store: EventStore) -> Iterator[Runtime]:
    with Runtime(store) as rt:
        yield rt


def started(runtime: Runtime, program: Any, input: Any = None, **kwargs: Any) -> TreeState:
    """Start ``program`` and return its tree once the owner has nothing left to do."""
    handle = runtime.start(program, input, **kwargs)
    return runtime.wait_idle(handle.tree_id)


def big(limit: int = MAX_PAYLOAD_BYTES) -> dict[str, str]:
    return {"blob": "x" * limit}


# ---------------------------------------------------------------------------
# Invalid ids (domain value constructors)


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        (ProcessID, "bad id"),
        (SignalID, "a/b"),
        (SignalID, "s" * 257),
        (SignalID, "héllo"),
        (SignalID, ""),
        (StartID, "start id"),
        (ChildKey, "kid\n"),
        (WaitID, "wait?"),
        (WaitKey, "key,with,commas"),
        (EffectID, "effect/1"),
        (TreeID, "tree:xyz"),
        (Digest, "sha256:ABC"),
        (EffectAttemptID, "attempt:" + "g" * 32),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_invalid_identities_are_refused_with_the_faulty_text(kind: type, value: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        kind(value)
    assert caught.value.code == "identity.invalid"
    assert repr(value[:80]) in caught.value.message
    assert kind.kind in caught.value.message


def test_a_non_string_identity_is_refused() -> None:
    with pytest.raises(InvalidInput) as caught:
        ProcessID(42)  # type: ignore[arg-type]
    assert (caught.value.code, "int" in caught.value.message) == ("identity.invalid", True)


def test_a_host_signal_request_cannot_use_the_engine_owned_namespace() -> None:
    with pytest.raises(InvalidInput) as caught:
        SignalRequest(SignalID("signal:engine:forged"), {"text": "hi"})
    assert caught.value.code == "signal.invalid"
    assert "signal:engine:forged" in caught.value.message


@pytest.mark.parametrize(
    ("payload", "code", "named"),
    [
        (big(), "payload.too_large", str(MAX_PAYLOAD_BYTES)),
        # a bare string of escaped characters: 6 bytes each once encoded (it was not measured)
        ("\x01" * (MAX_PAYLOAD_BYTES // 5), "payload.too_large", str(MAX_PAYLOAD_BYTES)),
        ({"x": float("nan")}, "payload.invalid", "$.x"),
        ({"x": [1, float("inf")]}, "payload.invalid", "$.x[1]"),
        ({"x": {1, 2}}, "payload.invalid", "$.x"),
        ({"x": 1 << 70}, "payload.invalid", "$.x"),
        ({1: "non-string key"}, "payload.invalid", "$"),
    ],
    ids=["oversize", "oversize-escaped-string", "nan", "infinity", "set", "huge-int", "int-key"],
)
def test_signal_payloads_are_bounded_json(payload: Any, code: str, named: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        SignalRequest(SignalID("s1"), payload)
    assert caught.value.code == code
    assert named in caught.value.message


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(InvalidInput) as caught:
        Budget.of(steps=-1)
    assert caught.value.code == "budget.invalid" and "-1" in caught.value.message
    with pytest.raises(InvalidInput):
        Quota(True)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Invalid ids and unknown names through the Runtime


def test_runtime_refuses_invalid_ids_and_appends_nothing(runtime: Runtime) -> None:
    tree = started(runtime, listener_program())
    request = [SignalRequest(SignalID("s1"), {"text": "a"})]
    refused(runtime, lambda: runtime.deliver_signals("bad id", request), InvalidInput, "identity.invalid", "bad id")
    refused(runtime, lambda: runtime.pause("bad/id"), InvalidInput, "identity.invalid", "bad/id")
    refused(runtime, lambda: runtime.cancel(""), InvalidInput, "identity.invalid")
    refused(
        runtime,
        lambda: runtime.resolve_unknown_effect("effect 1", Settlement.succeeded()),
        InvalidInput,
        "identity.invalid",
        "effect 1",
    )
    refused(
        runtime,
        lambda: runtime.start(listener_program(), None, start_id="start id"),
        InvalidInput,
        "identity.invalid",
        "start id",
    )
    refused(
        runtime,
        lambda: runtime.deliver_signals(tree.root_id, [SignalRequest(SignalID("signal:engine:x"), {"text": "a"})]),
        InvalidInput,
        "signal.invalid",
        "signal:engine:x",
    )


def test_runtime_refuses_unknown_processes_and_effects_and_appends_nothing(runtime: Runtime) -> None:
    started(runtime, listener_program())
    ghost = ProcessID("process:ghost")
    request = [SignalRequest(SignalID("s1"), {"text": "a"})]
    refused(runtime, lambda: runtime.deliver_signals(ghost, request), NotFound, "engine.process.not_found", ghost)
    refused(runtime, lambda: runtime.kill(ghost), NotFound, "engine.process.not_found", ghost)
    missing = effect_id(ghost, 1, 0)
    refused(
        runtime,
        lambda: runtime.resolve_unknown_effect(missing, Settlement.succeeded()),
        NotFound,
        "engine.effect.not_pending",
        missing,
    )


# ---------------------------------------------------------------------------
# Start: oversize and non-JSON input, input schema, start-id reuse


@pytest.mark.parametrize(
    ("input", "code", "named"),
    [
        (big(), "payload.too_large", str(MAX_PAYLOAD_BYTES)),
        ({"x": float("nan")}, "payload.invalid", "$.x"),
        ({"x": object()}, "payload.invalid", "$.x"),
        ([1 << 64], "payload.invalid", "$[0]"),
    ],
    ids=["oversize", "nan", "object", "huge-int"],
)
def test_start_refuses_input_that_is_not_bounded_json(runtime: Runtime, input: Any, code: str, named: str) -> None:
    refused(runtime, lambda: runtime.start(listener_program(), input, start_id="s-1"), InvalidInput, code, named)
    assert runtime.store.head(TreeID.for_start(StartID("s-1"))) is None


def test_start_accepts_input_just_under_the_payload_limit(runtime: Runtime) -> None:
    # {"blob":"xxx..."} is 11 bytes of framing around the string.
    tree = started(runtime, listener_program(), big(MAX_PAYLOAD_BYTES - 11))
    assert tree.root.status == "paused"


def test_start_refuses_input_that_violates_the_program_input_schema(runtime: Runtime) -> None:
    program = chain_program()
    refused(
        runtime,
        lambda: runtime.start(program, {"m": 1}, start_id="chain-1"),
        InvalidInput,
        "engine.start.input_invalid",
        "'n'",
        program.descriptor.name,
    )
    assert runtime.store.head(TreeID.for_start(StartID("chain-1"))) is None


def test_start_id_reuse_with_a_different_input_or_program_is_a_conflict(runtime: Runtime) -> None:
    program = listener_program()
    handle = runtime.start(program, {"a": 1}, start_id="once")
    runtime.wait_idle(handle.tree_id)
    refused(
        runtime,
        lambda: runtime.start(program, {"a": 2}, start_id="once"),
        Rejected,
        "engine.start.conflict",
        "once",
    )
    refused(
        runtime,
        lambda: runtime.start(listener_program("test.other"), {"a": 1}, start_id="once"),
        Rejected,
        "engine.start.conflict",
        "once",
    )
    again = appends_nothing(runtime, lambda: runtime.start(program, {"a": 1}, start_id="once"))
    assert (again.tree_id, again.root_process_id) == (handle.tree_id, handle.root_process_id)


# ---------------------------------------------------------------------------
# Signals: conflicts, deduplication, schema, atomic batches


def test_a_signal_id_with_different_content_is_a_conflict(runtime: Runtime) -> None:
    pid = started(runtime, listener_program()).root_id
    assert runtime.deliver_signals(pid, [SignalRequest(SignalID("s1"), {"text": "a"})]) is True
    refused(
        runtime,
        lambda: runtime.deliver_signals(pid, [SignalRequest(SignalID("s1"), {"text": "b"})]),
        Rejected,
        "engine.signal.conflict",
        "s1",
    )
    other_wait = wait_id_for(effect_id(pid, 1, 0))
    refused(
        runtime,
        lambda: runtime.deliver_signals(pid, [SignalRequest(SignalID("s1"), {"text": "a"}, other_wait)]),
        Rejected,
        "engine.signal.conflict",
        "s1",
    )


def test_an_identical_signal_again_is_accepted_false_and_appends_nothing(runtime: Runtime) -> None:
    pid = started(runtime, listener_program()).root_id
    assert runtime.deliver_signals(pid, [SignalRequest(SignalID("s1"), {"text": "a"})]) is True
    again = appends_nothing(
        runtime, lambda: runtime.deliver_signals(pid, [SignalRequest(SignalID("s1"), {"text": "a"})])
    )
    assert again is False


def test_a_batch_is_admitted_all_or_nothing(runtime: Runtime) -> None:
    pid = started(runtime, listener_program()).root_id
    runtime.deliver_signals(pid, [SignalRequest(SignalID("s1"), {"text": "a"})])
    batch = [SignalRequest(SignalID("s2"), {"text": "new"}), SignalRequest(SignalID("s1"), {"text": "changed"})]
    refused(runtime, lambda: runtime.deliver_signals(pid, batch), Rejected, "engine.signal.conflict", "s1")
    twice = [SignalRequest(SignalID("s3"), {"text": "a"}), SignalRequest(SignalID("s3"), {"text": "a"})]
    refused(runtime, lambda: runtime.deliver_signals(pid, twice), Rejected, "engine.signal.conflict", "s3")
    assert "s2" not in runtime.capture(pid).root.signal_index


def test_unaddressed_input_must_satisfy_the_program_signal_schema(runtime: Runtime) -> None:
    pid = started(runtime, listener_program()).root_id
    refused(
        runtime,
        lambda: runtime.deliver_signals(pid, [SignalRequest(SignalID("s1"), {"text": 7})]),
        InvalidInput,
        "engine.signal.schema",
        "$.text",
    )


def test_a_program_without_a_signal_schema_refuses_unaddressed_input(runtime: Runtime) -> None:
    pid = started(runtime, pair_program()).root_id  # blocked on its unknown effect, not waiting
    refused(
        runtime,
        lambda: runtime.deliver_signals(pid, [SignalRequest(SignalID("s1"), {"text": "a"})]),
        Rejected,
        "engine.signal.rejected",
        pid,
    )


# ---------------------------------------------------------------------------
# Waits: only the current, open wait may be answered, with its response schema


def test_an_answer_must_satisfy_the_wait_response_schema(runtime: Runtime) -> None:
    root = started(runtime, asker_program()).root
    wait = root.current_wait
    assert wait is not None
    refused(
        runtime,
        lambda: runtime.deliver_signals(root.process_id, [SignalRequest(SignalID("a1"), {"name": 5}, wait)]),
        InvalidInput,
        "engine.signal.schema",
        wait,
        "$.name",
    )


def test_an_answer_to_a_wait_that_is_not_current_is_rejected(runtime: Runtime) -> None:
    root = started(runtime, two_waits_program()).root
    first, second = list(root.waits)
    assert root.current_wait == second
    refused(
        runtime,
        lambda: runtime.deliver_signals(root.process_id, [SignalRequest(SignalID("f1"), {"name": "a"}, first)]),
        Rejected,
        "engine.signal.rejected",
        first,
        root.process_id,
    )


def test_an_answer_to_a_wait_that_does_not_exist_is_rejected(runtime: Runtime) -> None:
    root = started(runtime, asker_program()).root
    nowhere = wait_id_for(effect_id(root.process_id, 9, 0))
    refused(
        runtime,
        lambda: runtime.deliver_signals(root.process_id, [SignalRequest(SignalID("a1"), {"name": "a"}, nowhere)]),
        Rejected,
        "engine.signal.rejected",
        nowhere,
    )


def test_a_wait_that_was_already_answered_takes_no_second_answer(runtime: Runtime) -> None:
    root = started(runtime, two_waits_program()).root
    first, second = list(root.waits)
    assert runtime.deliver_signals(root.process_id, [SignalRequest(SignalID("s1"), {"name": "a"}, second)])
    assert runtime.wait_idle(runtime.tree_of_process(root.process_id)).root.current_wait == first
    refused(
        runtime,
        lambda: runtime.deliver_signals(root.process_id, [SignalRequest(SignalID("s2"), {"name": "b"}, second)]),
        Rejected,
        "engine.signal.rejected",
        second,
    )
    # The same answer again, by its identity, is a no-op.
    again = appends_nothing(
        runtime,
        lambda: runtime.deliver_signals(root.process_id, [SignalRequest(SignalID("s1"), {"name": "a"}, second)]),
    )
    assert again is False


def test_one_batch_cannot_answer_the_same_wait_twice(runtime: Runtime) -> None:
    root = started(runtime, asker_program()).root
    wait = root.current_wait
    batch = [SignalRequest(SignalID("a1"), {"name": "a"}, wait), SignalRequest(SignalID("a2"), {"name": "b"}, wait)]
    refused(runtime, lambda: runtime.deliver_signals(root.process_id, batch), Rejected, "engine.signal.rejected", wait)


def test_unaddressed_input_is_refused_while_an_external_wait_is_current(runtime: Runtime) -> None:
    root = started(runtime, asker_program()).root
    refused(
        runtime,
        lambda: runtime.deliver_signals(root.process_id, [SignalRequest(SignalID("chat"), {"name": "a"})]),
        Rejected,
        "engine.signal.rejected",
        root.current_wait,
    )


# ---------------------------------------------------------------------------
# Finished processes


def test_a_finished_process_admits_no_input_and_no_control(runtime: Runtime) -> None:
    root = started(runtime, asker_program()).root
    wait = root.current_wait
    pid = root.process_id
    assert runtime.deliver_signals(pid, [SignalRequest(SignalID("a1"), {"name": "ada"}, wait)])
    assert runtime.result(runtime.tree_of_process(pid), timeout=30).status == "completed"
    late = [SignalRequest(SignalID("a2"), {"name": "bob"}, wait)]
    refused(runtime, lambda: runtime.deliver_signals(pid, late), Rejected, "engine.process.finished", pid)
    for control in (runtime.pause, runtime.resume, runtime.cancel, runtime.kill, runtime.deadline):
        refused(runtime, lambda c=control: c(pid), Rejected, "engine.process.finished", pid)  # type: ignore[misc]
    # Resending the admitted answer is still recognised as a duplicate, not refused.
    assert (
        appends_nothing(
            runtime, lambda: runtime.deliver_signals(pid, [SignalRequest(SignalID("a1"), {"name": "ada"}, wait)])
        )
        is False
    )


def test_unknown_effects_of_a_canceled_process_stay_unresolved(runtime: Runtime) -> None:
    root = started(runtime, pair_program()).root
    unknown = root.unknown_effects()[0].effect_id
    assert runtime.cancel(root.process_id)
    assert runtime.result(runtime.tree_of_process(root.process_id), timeout=30).status == "canceled"
    refused(
        runtime,
        lambda: runtime.resolve_unknown_effect(unknown, Settlement.succeeded(), process_id=root.process_id),
        Rejected,
        "engine.process.finished",
        root.process_id,
    )


# ---------------------------------------------------------------------------
# Resolutions: only an unknown effect, only with a definite, bounded settlement


def test_resolving_an_effect_that_is_not_unknown_is_refused(runtime: Runtime) -> None:
    root = started(runtime, pair_program()).root
    definite, unknown = (r.effect_id for r in root.batch)
    pid = root.process_id
    refused(
        runtime,
        lambda: runtime.resolve_unknown_effect(definite, Settlement.failed(), process_id=pid),
        Rejected,
        "engine.effect.not_pending",
        definite,
        "succeeded",
    )
    refused(
        runtime,
        lambda: runtime.resolve_unknown_effect(definite, Settlement.failed()),
        NotFound,
        "engine.effect.not_pending",
        definite,
    )
    runtime.resolve_unknown_effect(unknown, Settlement.failed({"why": "never arrived"}))
    assert runtime.result(runtime.tree_of_process(pid), timeout=30).status == "completed"
    refused(
        runtime,
        lambda: runtime.resolve_unknown_effect(unknown, Settlement.succeeded(), process_id=pid),
        NotFound,
        "engine.effect.not_pending",
        unknown,
    )


def test_resolving_a_pending_effect_is_refused(runtime: Runtime) -> None:
    gate = threading.Event()
    try:
        handle = runtime.start(gate_program(gate), None)
        pid = handle.root_process_id
        tree = runtime.capture(handle.tree_id)
        pending = tree.root.in_flight()
        assert len(pending) == 1
        eid = pending[0].effect_id
        refused(
            runtime,
            lambda: runtime.resolve_unknown_effect(eid, Settlement.succeeded(), process_id=pid),
            Rejected,
            "engine.effect.not_pending",
            eid,
            "pending",
            settle=False,
        )
    finally:
        gate.set()
    assert handle.result(timeout=30).status == "completed"


@pytest.mark.parametrize(
    "settlement",
    [Settlement.unknown(), {"status": "succeeded"}, SettlementStatus.SUCCEEDED],
    ids=["unknown-status", "dict", "bare-status"],
)
def test_a_resolution_must_be_a_definite_settlement(runtime: Runtime, settlement: Any) -> None:
    root = started(runtime, pair_program()).root
    unknown = root.unknown_effects()[0].effect_id
    refused(
        runtime,
        lambda: runtime.resolve_unknown_effect(unknown, settlement),
        InvalidInput,
        "engine.effect.settlement_invalid",
        "succeeded or failed",
    )


@pytest.mark.parametrize(
    ("payload", "code", "named"),
    [(big(), "payload.too_large", "resolution payload"), ({"x": float("nan")}, "payload.invalid", "$.x")],
    ids=["oversize", "nan"],
)
def test_a_resolution_payload_is_bounded_json(runtime: Runtime, payload: Any, code: str, named: str) -> None:
    root = started(runtime, pair_program()).root
    unknown = root.unknown_effects()[0].effect_id
    raw = Settlement(SettlementStatus.SUCCEEDED, payload)  # bypasses the normalizing constructors
    refused(runtime, lambda: runtime.resolve_unknown_effect(unknown, raw), InvalidInput, code, named)
    with pytest.raises(InvalidInput) as caught:
        Settlement.succeeded(payload)
    assert caught.value.code == code


def test_replaying_an_effect_whose_policy_forbids_it_is_refused(runtime: Runtime) -> None:
    root = started(runtime, pair_program()).root
    unknown = root.unknown_effects()[0].effect_id
    refused(
        runtime,
        lambda: runtime.replay_unknown_effect(unknown),
        Rejected,
        "engine.effect.replay_forbidden",
        unknown,
    )


# ---------------------------------------------------------------------------
# Pause and resume in the wrong state


def test_resume_of_a_process_that_is_not_paused_is_refused(runtime: Runtime) -> None:
    root = started(runtime, asker_program()).root
    refused(
        runtime,
        lambda: runtime.resume(root.process_id),
        Rejected,
        "engine.process.control_invalid",
        root.process_id,
        "waiting",
    )


def test_pausing_a_paused_process_changes_nothing(runtime: Runtime) -> None:
    root = started(runtime, listener_program()).root
    assert root.status == "paused"
    assert appends_nothing(runtime, lambda: runtime.pause(root.process_id, "again")) is False


def test_pause_is_refused_while_a_terminal_intent_is_pending(runtime: Runtime) -> None:
    gate = threading.Event()
    try:
        handle = runtime.start(gate_program(gate), None)
        pid = handle.root_process_id
        assert runtime.cancel(pid)  # the dispatch is in flight, so the cancel stays pending
        refused(
            runtime,
            lambda: runtime.pause(pid),
            Rejected,
            "engine.process.control_invalid",
            pid,
            "cancel",
            settle=False,
        )
    finally:
        gate.set()
    assert handle.result(timeout=30).status == "canceled"


# ---------------------------------------------------------------------------
# Budgets and capacity


def test_the_signals_budget_refuses_the_signal_that_would_exceed_it(runtime: Runtime) -> None:
    pid = started(runtime, listener_program(), budget=Budget.of(signals=2)).root_id
    assert runtime.deliver_signals(pid, [SignalRequest(SignalID("s1"), {"text": "a"})])
    pair = [SignalRequest(SignalID("s2"), {"text": "b"}), SignalRequest(SignalID("s3"), {"text": "c"})]
    refused(runtime, lambda: runtime.deliver_signals(pid, pair), ResourceLimitExceeded, EngineCode.LIMIT_SIGNALS, pid)
    assert runtime.deliver_signals(pid, pair[:1])
    refused(
        runtime,
        lambda: runtime.deliver_signals(pid, [SignalRequest(SignalID("s3"), {"text": "c"})]),
        ResourceLimitExceeded,
        EngineCode.LIMIT_SIGNALS,
        pid,
    )
    assert runtime.capture(pid).root.usage["signals"] == 2


def test_the_mailbox_capacity_refuses_signals_beyond_it(runtime: Runtime) -> None:
    pid = started(runtime, listener_program(), limits=TreeLimits(max_pending_signals=1)).root_id
    assert runtime.deliver_signals(pid, [SignalRequest(SignalID("s1"), {"text": "a"})])
    refused(
        runtime,
        lambda: runtime.deliver_signals(pid, [SignalRequest(SignalID("s2"), {"text": "b"})]),
        ResourceLimitExceeded,
        EngineCode.LIMIT_SIGNALS,
        pid,
    )


@pytest.mark.parametrize(
    ("budget", "code", "usage"),
    [
        (Budget.of(steps=2), EngineCode.LIMIT_STEPS, {"steps": 2, "effects": 2, "signals": 2}),
        (Budget.of(effects=1), EngineCode.LIMIT_EFFECTS, {"steps": 1, "effects": 1, "signals": 1}),
    ],
    ids=["steps", "effects"],
)
def test_a_spent_steps_or_effects_budget_fails_the_process_durably(
    runtime: Runtime, budget: Budget, code: str, usage: dict[str, int]
) -> None:
    """Not a refusal: the kernel persists the failure as the process's termination."""
    handle = runtime.start(chain_program(), {"n": 5}, budget=budget)
    result = handle.result(timeout=30)
    assert result.status == "failed"
    assert result.termination is not None
    assert result.termination["failure"]["code"] == code
    assert result.termination["failure"]["kind"] == "execution"
    assert result.usage == usage
    last = runtime.store.read(handle.tree_id)[-1].event
    assert isinstance(last, ProcessTerminated)
    assert last.failure is not None and last.failure.code == code
    # The failure is final: later input is refused and appends nothing.
    refused(
        runtime,
        lambda: runtime.cancel(handle.root_process_id),
        Rejected,
        "engine.process.finished",
        handle.root_process_id,
    )


# ---------------------------------------------------------------------------
# A runtime that does not own the tree


def test_bad_input_through_a_runtime_that_does_not_own_the_tree_appends_nothing(store: EventStore) -> None:
    asker = asker_program()
    with Runtime(store, Catalog([asker])) as first:
        root = started(first, asker).root
    with Runtime(store, Catalog([asker])) as second:
        wait = root.current_wait
        refused(
            second,
            lambda: second.deliver_signals(root.process_id, [SignalRequest(SignalID("a1"), {"name": 5}, wait)]),
            InvalidInput,
            "engine.signal.schema",
            wait,
        )


def test_restarting_a_finished_tree_with_the_same_start_id_appends_nothing(store: EventStore) -> None:
    program = chain_program()
    with Runtime(store) as first:
        first.start(program, {"n": 1}, start_id="done").result(timeout=30)
    with Runtime(store) as second:
        handle = appends_nothing(second, lambda: second.start(program, {"n": 1}, start_id="done"))
        assert handle.result(timeout=30).status == "completed"

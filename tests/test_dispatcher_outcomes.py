"""Whatever a Dispatcher does, its Effect ends settled: definite, or unknown with a diagnostic
that says why (docs/guarantees.md "Unknown outcomes are never guessed"; docs/events.md
"EffectSettled"), and it is never called again by itself.

Found by an audit of the guarantees against the tests: a dispatcher that raised
``asyncio.CancelledError`` (a dispatcher bridging to an event loop whose task was
cancelled), which is not an ``Exception``, ended its thread without a settlement: the
Effect stayed in flight under a live owner for good, the run never moved, and nobody else
could recover it while the owner held its lease.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import EngineCode, Rejected
from agentfold.domain.events import EffectResolved, EffectSettled
from agentfold.domain.program import Replay
from agentfold.domain.requests import EffectRequest, Settlement, SettlementStatus
from agentfold.domain.tree import EffectRecord, TreeState
from tests.kernel_programs import chain_program


def raises(exc: BaseException) -> Callable[[EffectRequest, DispatchContext], Settlement]:
    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        raise exc

    return call


def returns(value: Any) -> Callable[[EffectRequest, DispatchContext], Settlement]:
    return lambda request, context: value


CASES = {
    "raises an Exception": (raises(ValueError("the API said no")), EngineCode.DISPATCH_FAILED, "external",
                            "ValueError: the API said no"),
    "raises asyncio.CancelledError": (raises(asyncio.CancelledError("task cancelled")), EngineCode.DISPATCH_CANCELED,
                                      "external", "CancelledError: task cancelled"),
    "raises SystemExit": (raises(SystemExit(3)), EngineCode.DISPATCH_PANICKED, "panic", "SystemExit: 3"),
    "returns None": (returns(None), EngineCode.DISPATCH_SETTLEMENT_INVALID, "contract", "NoneType"),
    "returns a payload that is not JSON": (returns(Settlement(SettlementStatus.SUCCEEDED, {"when": object()})),
                                           EngineCode.DISPATCH_SETTLEMENT_INVALID, "contract", "$.when is not JSON"),
    "reports an unknown outcome": (returns(Settlement.unknown()), EngineCode.DISPATCH_FAILED, "external",
                                   "unknown outcome"),
}


def unknown_of(tree: TreeState) -> list[EffectRecord]:
    return [e for p in tree.processes.values() for e in p.unknown_effects()]


@pytest.mark.parametrize("case", list(CASES))
def test_every_outcome_of_a_dispatcher_settles_its_effect_and_the_host_can_finish_the_run(
    store_url: str, case: str
) -> None:
    behave, code, kind, says = CASES[case]
    calls: list[int] = []

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        calls.append(1)
        return behave(request, context)

    program = chain_program(call, name="outcome.chain")
    with Runtime(EventStore(store_url), Catalog([program]), poll_interval=0) as runtime:
        handle = runtime.start(program, {"n": 1}, start_id="outcome-1")
        tree = runtime.wait_idle(handle.tree_id, timeout=20)  # before the fix: timed out, the Effect in flight
        (unknown,) = unknown_of(tree)
        assert unknown.diagnostic is not None
        assert (unknown.diagnostic.code, unknown.diagnostic.kind.value) == (code, kind), unknown.diagnostic
        assert says in unknown.diagnostic.message, unknown.diagnostic.message
        assert handle.status() == "running"  # parked on the unknown, never guessed
        time.sleep(0.3)
        assert calls == [1]  # never called again by itself
        runtime.resolve_unknown_effect(unknown.effect_id, Settlement.succeeded({"value": 5}))
        result = handle.result(timeout=20)
        assert result.status == "completed" and result.output == {"total": 5, "effects": 1}, result
        assert calls == [1]


def test_a_dispatcher_that_ignores_cancellation_is_recorded_unknown_after_the_grace_and_its_late_result_dropped(
    durable_store_url: str,
) -> None:
    """docs/guarantees.md "What is NOT guaranteed": a dispatcher that does not return within
    the cancellation grace period is recorded unknown (``engine.dispatch.canceled``) and
    abandoned; what it returns afterwards is never appended."""
    entered, release = threading.Event(), threading.Event()

    def stubborn(request: EffectRequest, context: DispatchContext) -> Settlement:
        entered.set()
        release.wait(30)  # ignores context.cancelled
        return Settlement.succeeded({"value": 1})

    program = chain_program(stubborn, name="stubborn.chain")
    store = EventStore(durable_store_url)
    with Runtime(store, Catalog([program]), poll_interval=0, cancel_grace=0.5) as runtime:
        handle = runtime.start(program, {"n": 1}, start_id="stubborn-1")
        assert entered.wait(20)
        began = time.monotonic()
        assert runtime.cancel(handle.root_process_id, reason="the user gave up")
        result = handle.result(timeout=20)
        took = time.monotonic() - began
        assert result.status == "canceled", result
        assert took >= 0.5, took  # it waited the grace period for the dispatcher
        settled = [r.event for r in store.read(handle.tree_id) if isinstance(r.event, EffectSettled)]
        assert [(str(e.status), e.diagnostic.code if e.diagnostic else None) for e in settled] == [
            ("unknown", EngineCode.DISPATCH_CANCELED)
        ], settled
        assert settled[0].effect_id in result.termination["unresolved_effect_ids"], result.termination  # type: ignore[index]
        version = store.head(handle.tree_id).version  # type: ignore[union-attr]
        release.set()  # the late result
        time.sleep(0.5)
        assert store.head(handle.tree_id).version == version  # type: ignore[union-attr]
        assert [type(r.event).__name__ for r in store.read(handle.tree_id)][-1] == "ProcessTerminated"


def test_a_host_replays_an_unknown_same_identity_effect_under_its_id_and_only_a_definite_outcome_is_stored(
    durable_store_url: str,
) -> None:
    """Scope's ReplayUnknownEffect (docs/guarantees.md "External calls"): the call is made
    again under the Effect's id with a new attempt id while the stored unknown stays
    authoritative; an uncertain outcome appends nothing and leaves it unknown; a definite
    one is stored as ``EffectResolved`` by ``replay`` with the replay's attempt id."""
    seen: list[tuple[str, str | None]] = []
    answers = iter(["raise", "raise", "ok"])  # the call, an uncertain replay, a definite replay

    def flaky(request: EffectRequest, context: DispatchContext) -> Settlement:
        seen.append((request.effect_id, request.attempt_id))
        if next(answers) == "raise":
            raise ConnectionResetError("the connection dropped mid-request")
        return Settlement.succeeded({"value": 7})

    program = chain_program(flaky, replay=Replay.SAME_IDENTITY, name="replay.chain")
    store = EventStore(durable_store_url)
    with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
        handle = runtime.start(program, {"n": 1}, start_id="replay-1")
        (unknown,) = unknown_of(runtime.wait_idle(handle.tree_id, timeout=20))
        version = store.head(handle.tree_id).version  # type: ignore[union-attr]
        with pytest.raises(Rejected) as refused:
            runtime.replay_unknown_effect(unknown.effect_id)
        assert refused.value.code == "engine.effect.outcome_unknown", refused.value
        assert store.head(handle.tree_id).version == version  # type: ignore[union-attr]
        assert [e.effect_id for e in unknown_of(runtime.capture(handle.tree_id))] == [unknown.effect_id]
        settlement = runtime.replay_unknown_effect(unknown.effect_id)
        assert settlement.payload == {"value": 7}
        result = handle.result(timeout=20)
        assert result.status == "completed" and result.output == {"total": 7, "effects": 1}, result
        # GET /metrics counts every call: the first and the uncertain replay unknown, the last one succeeded.
        assert runtime.calls_settled.snapshot() == {"unknown": 2, "succeeded": 1}
    assert [eid for eid, _ in seen] == [unknown.effect_id] * 3  # one Effect id for every call
    assert len({attempt for _, attempt in seen}) == 3  # a new attempt id each time
    (resolved,) = [r.event for r in store.read(handle.tree_id) if isinstance(r.event, EffectResolved)]
    assert (resolved.effect_id, resolved.resolved_by, resolved.attempt_id) == (unknown.effect_id, "replay", seen[2][1])


def test_while_a_replay_is_in_flight_another_replay_or_a_resolution_of_that_effect_is_refused(
    durable_store_url: str,
) -> None:
    """Scope's ReplayUnknownEffect: a concurrent replay or resolution is ErrEffectNotPending
    (``engine.effect.not_pending``), so a double click never makes a second call, and a
    host's answer never races the replay's."""
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def flaky_then_slow(request: EffectRequest, context: DispatchContext) -> Settlement:
        calls.append(request.effect_id)
        if len(calls) == 1:
            raise ConnectionResetError("dropped")
        entered.set()
        release.wait(30)
        return Settlement.succeeded({"value": 2})

    program = chain_program(flaky_then_slow, replay=Replay.SAME_IDENTITY, name="replay.busy")
    store = EventStore(durable_store_url)
    with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
        handle = runtime.start(program, {"n": 1}, start_id="replay-busy")
        (unknown,) = unknown_of(runtime.wait_idle(handle.tree_id, timeout=20))
        replayed: list[Settlement] = []
        first = threading.Thread(target=lambda: replayed.append(runtime.replay_unknown_effect(unknown.effect_id)))
        first.start()
        assert entered.wait(20)
        version = store.head(handle.tree_id).version  # type: ignore[union-attr]
        for attempt in (lambda: runtime.replay_unknown_effect(unknown.effect_id),
                        lambda: runtime.resolve_unknown_effect(unknown.effect_id, Settlement.succeeded({"value": 9}))):
            with pytest.raises(Rejected) as refused:
                attempt()
            assert refused.value.code == "engine.effect.not_pending" and "in flight" in refused.value.message
        assert store.head(handle.tree_id).version == version  # nothing recorded meanwhile
        release.set()
        first.join(30)
        assert [s.payload for s in replayed] == [{"value": 2}]
        assert handle.result(timeout=20).output == {"total": 2, "effects": 1}
    assert len(calls) == 2  # the call, and one replay

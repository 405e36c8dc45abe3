"""Unknown outcomes, their resolution and replay, and recovery: behaviour the mutation audit of
2026-12-05 ("unknown") found undefended. Each test failed with its mutant and passes without it.

The product's promise (docs/guarantees.md "External calls: at most once per Effect id" and
"Unknown outcomes are never guessed"): a call is made again only under ``same_identity``, as
declared AND as the Program says when asked again; an outcome the runtime cannot know is
recorded unknown, never guessed, and waits for a host; a host's input is recorded or refused,
never dropped while the host is told it was taken.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext, FunctionDispatcher
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import AgentfoldError, EngineCode, Rejected
from agentfold.domain.events import ControlRequested, EffectResolved, EffectSettled
from agentfold.domain.program import Descriptor, Effect, EffectPolicy, Program, Replay
from agentfold.domain.requests import EffectRequest, Settlement
from agentfold.domain.tree import EffectRecord, TreeState
from tests.kernel_programs import IMPL, Chain, chain_program, config_digest, parent_program

WAIT = 20.0


def unknown_of(tree: TreeState) -> list[EffectRecord]:
    return [e for p in tree.processes.values() for e in p.unknown_effects()]


def in_flight_of(tree: TreeState) -> list[tuple[Any, EffectRecord]]:
    return [(p.process_id, e) for p in tree.processes.values() for e in p.in_flight()]


def stored(store: EventStore, tree_id: Any, kind: type) -> list[Any]:
    return [r.event for r in store.read(tree_id) if isinstance(r.event, kind)]


def version_of(store: EventStore, tree_id: Any) -> int:
    head = store.head(tree_id)
    assert head is not None
    return head.version


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'unknown.db'}"


@pytest.fixture
def opened(url: str) -> Iterator[Callable[[], EventStore]]:
    """EventStores on the test's SQLite file, closed at the end (each runtime gets its own)."""
    stores: list[EventStore] = []

    def open_store() -> EventStore:
        stores.append(EventStore(url))
        return stores[-1]

    yield open_store
    for store in stores:
        store.close()


class Policy:
    """A replay policy the test changes between two owners (policies are code: a new release
    of the Program may say otherwise, or fail to answer, under the same ProgramRef)."""

    def __init__(self) -> None:
        self.replay = Replay.SAME_IDENTITY
        self.raises = False

    def __call__(self, effect: Effect) -> EffectPolicy:
        if self.raises:
            raise ConnectionError("the policy's feature-flag service is down")
        return EffectPolicy(replay=self.replay)


def chain_with(policy: Policy, call: Callable[[EffectRequest, DispatchContext], Settlement], name: str) -> Program:
    """``chain_program`` whose replay policy is ``policy`` (asked each time)."""
    return Program(
        Descriptor(name, input_schema={"type": "object", "required": ["n"]}),
        Chain(), IMPL, config_digest(name), policy=policy, dispatcher=FunctionDispatcher(call),
    )


class Calls:
    """A dispatcher that logs every call; the first call raises (its outcome is unknown) when
    ``first_raises``, or is held until ``release`` when ``hold_first``; later calls succeed."""

    def __init__(self, *, first_raises: bool = False, hold_first: bool = False) -> None:
        self.first_raises, self.hold_first = first_raises, hold_first
        self.made: list[str] = []
        self.lock = threading.Lock()
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, request: EffectRequest, context: DispatchContext) -> Settlement:
        with self.lock:
            self.made.append(str(request.effect_id))
            first = len(self.made) == 1
        if first and self.first_raises:
            raise ConnectionResetError("the connection dropped mid-request")
        if first and self.hold_first:
            self.entered.set()
            self.release.wait(30)
        return Settlement.succeeded({"value": 1})


# ---------------------------------------------------------------------------
# A host's replay (Runtime.replay_unknown_effect)


def test_a_replay_of_an_effect_its_program_no_longer_says_same_identity_is_refused_without_a_call(
    opened: Callable[[], EventStore],
) -> None:
    # Mutant: Runtime._replay without its `replay_allowed(program, record)` check (only the
    # declaration's policy asked): the Program, asked now, says never, and the call was made again.
    policy, calls = Policy(), Calls(first_raises=True)
    program = chain_with(policy, calls, "unknown.replay_policy_changed")
    store = opened()
    with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
        handle = runtime.start(program, {"n": 1}, start_id="policy-changed")
        [unknown] = unknown_of(runtime.wait_idle(handle.tree_id, timeout=WAIT))
        assert unknown.replay == "same_identity"  # declared so
        policy.replay = Replay.NEVER  # ... and the Program says otherwise now
        version = version_of(store, handle.tree_id)
        with pytest.raises(Rejected) as refused:
            runtime.replay_unknown_effect(unknown.effect_id)
        assert refused.value.code == "engine.effect.replay_forbidden", refused.value
        assert "does not say same_identity for it now" in refused.value.message
        assert calls.made == [unknown.effect_id]  # the first call only: never made again
        assert version_of(store, handle.tree_id) == version
        assert [e.effect_id for e in unknown_of(runtime.capture(handle.tree_id))] == [unknown.effect_id]


def test_a_replay_names_an_effect_still_in_flight_and_is_refused_without_a_second_call(
    opened: Callable[[], EventStore],
) -> None:
    # Mutant: Runtime._replay checking only that the effect exists (not that it is unknown and
    # unresolved): a replay naming its process (which skips the index of unknown effects)
    # called the dispatcher a second time while the first call was still running.
    calls = Calls(hold_first=True)
    program = chain_program(calls, replay=Replay.SAME_IDENTITY, name="unknown.replay_in_flight")
    store = opened()
    with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
        handle = runtime.start(program, {"n": 1}, start_id="in-flight")
        try:
            assert calls.entered.wait(WAIT)
            [(process_id, record)] = in_flight_of(runtime.capture(handle.tree_id))
            with pytest.raises(Rejected) as refused:
                runtime.replay_unknown_effect(record.effect_id, process_id=process_id)
            assert refused.value.code == "engine.effect.not_pending", refused.value
            time.sleep(0.2)  # a second call would have started by now
            assert calls.made == [record.effect_id]
        finally:
            calls.release.set()
        assert handle.result(timeout=WAIT).output == {"total": 1, "effects": 1}
    assert calls.made == [record.effect_id]


def test_a_replay_after_the_run_was_canceled_is_refused_without_a_call(opened: Callable[[], EventStore]) -> None:
    # Mutant: Runtime._replay without its finished-or-finishing check: the run had ended
    # (canceled, the unknown effect kept as evidence), and the replay still made the call
    # (then could not record it). The call count is what a user pays for.
    calls = Calls(first_raises=True)
    program = chain_program(calls, replay=Replay.SAME_IDENTITY, name="unknown.replay_after_cancel")
    store = opened()
    with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
        handle = runtime.start(program, {"n": 1}, start_id="canceled")
        [unknown] = unknown_of(runtime.wait_idle(handle.tree_id, timeout=WAIT))
        assert runtime.cancel(handle.root_process_id, reason="the user gave up")
        result = handle.result(timeout=WAIT)
        assert result.status == "canceled"
        assert unknown.effect_id in result.termination["unresolved_effect_ids"]  # type: ignore[index]
        version = version_of(store, handle.tree_id)
        with pytest.raises(Rejected) as refused:
            runtime.replay_unknown_effect(unknown.effect_id)
        assert refused.value.code == "engine.process.finished", refused.value
        assert calls.made == [unknown.effect_id]
        assert version_of(store, handle.tree_id) == version


# ---------------------------------------------------------------------------
# Recovery


def test_recovery_records_unknown_without_a_call_when_the_programs_policy_fails_to_answer(
    opened: Callable[[], EventStore],
) -> None:
    # Mutant: replay_allowed answering True when the Program's policy raises. "The policy is
    # asked again each time" (docs/guarantees.md): a policy that cannot answer is no
    # same_identity, and the call in flight when its owner went away must not be made again.
    policy, calls = Policy(), Calls(hold_first=True)
    program = chain_with(policy, calls, "unknown.policy_raises_at_recovery")
    try:
        first = Runtime(opened(), Catalog([program]))
        handle = first.start(program, {"n": 1}, start_id="policy-raises")
        assert calls.entered.wait(WAIT)
        first.close()  # the owner goes away with its call in flight (the call is abandoned)
        policy.raises = True
        store = opened()
        with Runtime(store, Catalog([program]), poll_interval=0) as second:
            [recovered] = second.recover(str(handle.tree_id))
            [unknown] = unknown_of(second.wait_idle(recovered.tree_id, timeout=WAIT))
            assert unknown.diagnostic is not None and unknown.diagnostic.code == EngineCode.DISPATCH_INTERRUPTED
            assert calls.made == [unknown.effect_id]  # not called again
    finally:
        calls.release.set()


# ---------------------------------------------------------------------------
# Calls the runtime cannot make or cannot know


def test_a_program_deployed_without_a_dispatcher_leaves_its_calls_unknown_for_a_host(
    opened: Callable[[], EventStore],
) -> None:
    # docs/kernel-adaptations.md: the dispatch permission is committed and the Effect settles
    # unknown at once (engine.dispatch.failed, "no dispatcher is bound to this program"), the
    # run waits for a host. Mutant: that settlement not submitted: the Effect stayed in flight
    # under a live owner for good (wait_idle never returned, nothing listed it).
    program = Program(Descriptor("unknown.no_dispatcher", input_schema={"type": "object", "required": ["n"]}),
                      Chain(), IMPL, config_digest("unknown.no_dispatcher"))
    store = opened()
    with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
        handle = runtime.start(program, {"n": 1}, start_id="no-dispatcher")
        [unknown] = unknown_of(runtime.wait_idle(handle.tree_id, timeout=5))
        assert unknown.diagnostic is not None
        assert (unknown.diagnostic.code, unknown.diagnostic.message) == (
            EngineCode.DISPATCH_FAILED, "no dispatcher is bound to this program")
        assert store.head(handle.tree_id).unknown_effect_ids == (unknown.effect_id,)  # type: ignore[union-attr]
        runtime.resolve_unknown_effect(unknown.effect_id, Settlement.succeeded({"value": 4}))
        assert handle.result(timeout=WAIT).output == {"total": 4, "effects": 1}


def test_a_dispatcher_that_raises_after_its_process_was_canceled_is_recorded_canceled(
    opened: Callable[[], EventStore],
) -> None:
    # docs/events.md: engine.dispatch.canceled for a call canceled; the Dispatcher port says a
    # dispatcher should stop promptly when told. Mutant: any exception recorded
    # engine.dispatch.failed, also one raised because the call was told to stop.
    entered = threading.Event()

    def aborts_when_told(request: EffectRequest, context: DispatchContext) -> Settlement:
        entered.set()
        context.cancelled.wait(30)
        raise ConnectionAbortedError("the request was aborted")

    program = chain_program(aborts_when_told, name="unknown.aborts")
    store = opened()
    with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
        handle = runtime.start(program, {"n": 1}, start_id="aborts")
        assert entered.wait(WAIT)
        assert runtime.cancel(handle.root_process_id)
        assert handle.result(timeout=WAIT).status == "canceled"
    [settled] = stored(store, handle.tree_id, EffectSettled)
    assert settled.status == "unknown"
    assert settled.diagnostic is not None
    assert (settled.diagnostic.code, settled.diagnostic.message) == (
        EngineCode.DISPATCH_CANCELED, "ConnectionAbortedError: the request was aborted")


def test_a_call_in_flight_when_its_owners_append_conflicts_is_not_made_a_second_time(
    opened: Callable[[], EventStore],
) -> None:
    # An owner whose append meets a version conflict reloads the tree and launches the dispatch
    # permissions it committed without learning it (a lost reply, tests/test_lost_reply.py).
    # Mutant: the calls it has in flight launched too: a second call of the same Effect, made
    # while the first was still running (a pause sent by another host raced the owner's own).
    calls = Calls(hold_first=True)
    program = chain_program(calls, name="unknown.conflict_in_flight")
    owner_store, other_store = opened(), opened()
    owner = Runtime(owner_store, Catalog([program]))
    other = Runtime(other_store, Catalog([program]), poll_interval=0, adopt_on_admit=False)
    real_append = owner_store.append
    raced: dict[str, Any] = {}

    def append_after_another_host(tree_id: Any, expected: int, events: Any, **kwargs: Any) -> Any:
        if not raced and any(isinstance(e, ControlRequested) for e in events):
            raced["other"] = other.pause(owner_store.head(tree_id).root_process_id,  # type: ignore[union-attr]
                                         "paused by another host")
        return real_append(tree_id, expected, events, **kwargs)  # now a genuine conflict

    owner_store.append = append_after_another_host  # type: ignore[method-assign,assignment]
    try:
        handle = owner.start(program, {"n": 1}, start_id="conflict")
        assert calls.entered.wait(WAIT)
        [(_, record)] = in_flight_of(owner.capture(handle.tree_id))
        owner.pause(handle.root_process_id, "paused by the owner's host")
        assert raced == {"other": True}
        time.sleep(0.3)  # a second call would have started by now
        assert calls.made == [record.effect_id]
        calls.release.set()
        assert owner.wait_idle(handle.tree_id, timeout=WAIT).root.status == "paused"
        assert owner.resume(handle.root_process_id)
        assert handle.result(timeout=WAIT).output == {"total": 1, "effects": 1}
        assert calls.made == [record.effect_id]
    finally:
        calls.release.set()
        owner.close()
        other.close()


# ---------------------------------------------------------------------------
# A host's resolution


def test_a_resolution_whose_append_raced_another_hosts_input_is_still_recorded(
    opened: Callable[[], EventStore],
) -> None:
    # A host that does not drive the run records its input at the run's version; another
    # host's input committed first: a version conflict. Mutant: the conflict swallowed (the
    # request returned as if recorded): the host was told it resolved the effect and nothing
    # was stored; the run stayed parked on it (a cancel sent this way was lost the same way).
    calls = Calls(first_raises=True)
    program = chain_program(calls, name="unknown.resolve_race")
    with Runtime(opened(), Catalog([program]), poll_interval=0) as starter:
        handle = starter.start(program, {"n": 1}, start_id="resolve-race")
        [unknown] = unknown_of(starter.wait_idle(handle.tree_id, timeout=WAIT))
    host_store, store = opened(), opened()
    host = Runtime(host_store, Catalog([program]), poll_interval=0, adopt_on_admit=False)
    other = Runtime(opened(), Catalog([program]), poll_interval=0, adopt_on_admit=False)
    real_append = host_store.append
    raced: dict[str, Any] = {}

    def append_after_another_host(tree_id: Any, expected: int, events: Any, **kwargs: Any) -> Any:
        if not raced:
            raced["other"] = other.pause(handle.root_process_id, "paused by another host")
        return real_append(tree_id, expected, events, **kwargs)

    host_store.append = append_after_another_host  # type: ignore[method-assign,assignment]
    try:
        host.resolve_unknown_effect(unknown.effect_id, Settlement.succeeded({"value": 5}))
        assert raced == {"other": True}
        [resolved] = stored(store, handle.tree_id, EffectResolved)
        assert (resolved.effect_id, resolved.status, resolved.payload, resolved.resolved_by) == (
            unknown.effect_id, "succeeded", {"value": 5}, "host")
        assert [type(e).__name__ for e in (r.event for r in store.read(handle.tree_id))][-2:] == [
            "ControlRequested", "EffectResolved"]
    finally:
        host.close()
        other.close()


def test_a_resolution_naming_another_process_of_the_run_is_refused_and_appends_nothing(
    opened: Callable[[], EventStore],
) -> None:
    # Mutant: resolvable() without its check that the effect belongs to the process named: a
    # host that named the wrong process (the run's root, for its child's call) had its
    # resolution recorded all the same.
    calls = Calls(first_raises=True)
    child = chain_program(calls, name="unknown.child")
    program = parent_program(child, count=1, name="unknown.parent")
    store = opened()
    with Runtime(store, Catalog([program, child]), poll_interval=0) as runtime:
        handle = runtime.start(program, {"child": {"n": 1}}, start_id="two-processes")
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        [unknown] = unknown_of(tree)
        [owner] = [p.process_id for p in tree.processes.values() if p.unknown_effects()]
        assert owner != handle.root_process_id
        version = version_of(store, handle.tree_id)
        with pytest.raises(AgentfoldError) as refused:
            runtime.resolve_unknown_effect(unknown.effect_id, Settlement.succeeded({"value": 2}),
                                           process_id=handle.root_process_id)
        assert refused.value.code == "engine.effect.not_pending", refused.value
        assert version_of(store, handle.tree_id) == version
        assert stored(store, handle.tree_id, EffectResolved) == []
        runtime.resolve_unknown_effect(unknown.effect_id, Settlement.succeeded({"value": 2}), process_id=owner)
        result = handle.result(timeout=WAIT)
    assert result.output == {"outcomes": [{"status": "completed", "output": {"total": 2, "effects": 1}}]}


def test_a_settlement_built_by_hand_with_a_text_status_is_recorded_unknown_as_invalid(
    opened: Callable[[], EventStore],
) -> None:
    # docs/events.md: a Dispatcher that returns something that is not a valid Settlement is
    # recorded unknown (engine.dispatch.settlement.invalid, kind contract): never read as the
    # outcome its text names. Mutant: only the type of the object checked, not its status: the
    # owner line failed on it and the call stayed in flight (the run never moved).
    def by_hand(request: EffectRequest, context: DispatchContext) -> Settlement:
        return Settlement("succeeded", {"value": 1})  # type: ignore[arg-type]

    program = chain_program(by_hand, name="unknown.by_hand")
    store = opened()
    with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
        handle = runtime.start(program, {"n": 1}, start_id="by-hand")
        [unknown] = unknown_of(runtime.wait_idle(handle.tree_id, timeout=5))
        assert unknown.diagnostic is not None
        assert (unknown.diagnostic.kind.value, unknown.diagnostic.code) == (
            "contract", EngineCode.DISPATCH_SETTLEMENT_INVALID)
        runtime.resolve_unknown_effect(unknown.effect_id, Settlement.succeeded({"value": 1}))
        assert handle.result(timeout=WAIT).output == {"total": 1, "effects": 1}


def test_a_late_outcome_of_an_abandoned_call_leaves_the_rest_of_the_run_driven(
    opened: Callable[[], EventStore],
) -> None:
    # A call that ignored its cancellation past the grace period is recorded unknown and
    # abandoned; what it returns afterwards is dropped (docs/guarantees.md). Mutant:
    # settle_dispatch not checking that the effect is still pending: the late outcome was
    # applied to the settled effect, the fold refused it, and the tree's owner line failed: the
    # sibling still working was never driven again and the run never completed.
    stubborn_entered, stubborn_release = threading.Event(), threading.Event()
    sibling_entered, sibling_release = threading.Event(), threading.Event()

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        if request.relation.child_key == "child-0":
            stubborn_entered.set()
            stubborn_release.wait(30)  # ignores context.cancelled
            return Settlement.succeeded({"value": 100})
        sibling_entered.set()
        sibling_release.wait(30)
        return Settlement.succeeded({"value": 1})

    child = chain_program(call, name="unknown.late_child")
    program = parent_program(child, count=2, name="unknown.late_parent")
    store = opened()
    with Runtime(store, Catalog([program, child]), poll_interval=0, cancel_grace=0.3) as runtime:
        try:
            handle = runtime.start(program, {"child": {"n": 1}}, start_id="late-outcome")
            assert stubborn_entered.wait(WAIT) and sibling_entered.wait(WAIT)
            [stubborn] = [p.process_id for p in runtime.capture(handle.tree_id).processes.values()
                          if p.child_key == "child-0"]
            assert runtime.cancel(stubborn, reason="this one is not needed")
            deadline = time.monotonic() + WAIT
            while runtime.capture(handle.tree_id).processes[stubborn].status != "canceled":
                assert time.monotonic() < deadline, "the stubborn child was never recorded canceled"
                time.sleep(0.02)
            stubborn_release.set()  # the late outcome
            time.sleep(0.3)
            sibling_release.set()
            result = handle.result(timeout=WAIT)
        finally:
            stubborn_release.set()
            sibling_release.set()
    assert result.output == {"outcomes": [{"status": "canceled", "output": None},
                                          {"status": "completed", "output": {"total": 1, "effects": 1}}]}
    settled = [(e.status, e.diagnostic.code if e.diagnostic else None) for e in stored(store, handle.tree_id, EffectSettled)]
    assert sorted(settled) == [("succeeded", None), ("unknown", EngineCode.DISPATCH_CANCELED)]


def test_an_unknown_effect_of_a_paused_process_is_listed_for_the_host_and_resolvable(
    opened: Callable[[], EventStore], url: str,
) -> None:
    # docs/guarantees.md: an unknown Effect parks the tree and `agentfold unknown` lists it.
    # A host paused the run while its call was under way, and the call then failed: its
    # outcome is unknown all the same and the host must be told. Mutant: the listings
    # skipping a paused Process's unknown effects (`agentfold unknown` said "nothing waits for
    # a host" while the effect waited for one).
    from tests.test_cli import agentfold, ok

    calls = Calls(hold_first=True)

    def fails_after_the_pause(request: EffectRequest, context: DispatchContext) -> Settlement:
        calls(request, context)
        raise ConnectionResetError("the connection dropped mid-request")

    program = chain_program(fails_after_the_pause, name="unknown.paused")
    store = opened()
    with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
        handle = runtime.start(program, {"n": 1}, start_id="paused-unknown")
        try:
            assert calls.entered.wait(WAIT)
            assert runtime.pause(handle.root_process_id, "a host looks into it")
        finally:
            calls.release.set()
        tree = runtime.wait_idle(handle.tree_id, timeout=WAIT)
        assert tree.root.status == "paused"
        [unknown] = unknown_of(tree)
    listed = ok(agentfold("unknown", "--json", store=url)).json()["unknown_effects"]
    assert [(e["effect_id"], e["process_id"], e["process_status"]) for e in listed] == [
        (unknown.effect_id, handle.root_process_id, "paused")]
    with Runtime(opened(), Catalog([program]), poll_interval=0) as host:
        host.resolve_unknown_effect(unknown.effect_id, Settlement.succeeded({"value": 6}))
        assert host.resume(handle.root_process_id)
        assert host.result(handle.tree_id, timeout=WAIT).output == {"total": 6, "effects": 1}

"""Scope's 40 kernel conformance scenarios (scope-kernel.md §10), adapted to appends.

Every test runs on memory, SQLite and PostgreSQL (the ``store_url`` fixture).

How Scope's commit protocol maps onto ours (DESIGN.md, ``agentfold.adapters.runtime``):

* Scope commits a whole prospective TreeSnapshot per boundary; we append a list of
  events at an expected version. A "pending boundary" is the append holding an
  ``EffectDispatched``, a "settled boundary" the one holding its ``EffectSettled``, a
  "resolved boundary" the one holding its ``EffectResolved``; "checkpoints" are the
  appends holding ``StepCommitted``/``ProcessStarted``/``SignalAdmitted``/
  ``ControlRequested``/``ProcessTerminated``. ``ErrCommitConflict`` and
  ``ErrTreeIncarnationConflict`` are both a :class:`VersionConflict` (the stream
  version is the only precondition); a writer that meets another incarnation's
  ``WriterActivated`` stops :class:`~agentfold.domain.errors.Fenced`.
* The steady-state batching (settlement + next Step + next dispatch permission in one
  append) and the adoption of a Step in the append of the input that made it possible
  mean that one append can carry several of Scope's boundaries. Where a scenario needs
  one boundary on its own, the Program parks first and the host input that unparks it
  (a resume or an answer) opens the append under test; each test says so.
* "Crash before commit": the :class:`FaultyStore` cuts the append before it writes;
  "crash after commit, before acknowledgement": the append is written and the caller
  gets the crash error instead of the acknowledgement. Either way the runtime instance
  stops driving the tree (``RuntimeStopped``; Scope's RuntimeError) and a NEW Runtime
  over the same store recovers it (``Runtime.recover``: ``WriterActivated``).
* Scope's probe runs under every test: each successful append is immediately repeated
  verbatim and the identical retry must succeed without changing the stream.
* Where Scope requires two Engines to race for one tree, our owner lease would refuse
  the second runtime before the store is asked; those tests give the racing runtimes a
  lease manager that grants everything (a lost lease), so the store's version fence
  alone must decide.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import VersionConflict
from agentfold.adapters.runtime import RandomIds, Runtime, RuntimeStopped
from agentfold.domain.budget import Allocation, Budget
from agentfold.domain.canonical import canonical_bytes
from agentfold.domain.errors import AgentfoldError, Fenced, StoreFailure
from agentfold.domain.events import (
    ControlRequested,
    EffectDeclared,
    EffectDispatched,
    EffectResolved,
    EffectSettled,
    ProcessStarted,
    ProcessTerminated,
    SignalAdmitted,
    StepCommitted,
    TreeLimits,
    TreeStarted,
    WriterActivated,
)
from agentfold.domain.ids import EffectID, ProcessID, SignalID, StartID, TreeID, child_process_id, effect_id
from agentfold.domain.kernel import Kernel
from agentfold.domain.program import Program, SettlementStatus, SignalRequest
from agentfold.domain.requests import Settlement
from agentfold.domain.tree import TreeState
from tests.conformance.programs import (
    controller_program,
    counted,
    gate_program,
    go,
    lost,
    sleeper_program,
)
from tests.conformance.support import (
    CRASH_CODE,
    ActivationWithoutCasStore,
    BlindLoadStore,
    ConflictSwallowingStore,
    Env,
    NonIdempotentStore,
    child_of,
    holding,
    of_type,
    process_json,
    run_in_thread,
)
from tests.kernel_programs import asker_program, chain_program, parent_program


@pytest.fixture
def env(store_url: str, tmp_path: Path) -> Any:
    environment = Env(store_url, tmp_path)
    yield environment
    environment.close()
    assert not environment.probe_failures, environment.probe_failures


def broken_env(store_url: str, tmp_path: Path, broken: Callable[[Any], Any]) -> Env:
    return Env(store_url, tmp_path, broken=broken)


# ---------------------------------------------------------------------------
# small helpers


def expect_conflict(submit: Callable[[], Any], what: str) -> None:
    """The store must refuse ``submit`` with a version conflict (as an AssertionError otherwise)."""
    try:
        submit()
    except VersionConflict:
        return
    raise AssertionError(f"{what} was accepted; the store must refuse it with a version conflict")


def head_fingerprint(env: Env, tree_id: TreeID) -> tuple[int, str, int]:
    head = env.view.head(tree_id)
    assert head is not None
    return head.version, head.head_digest, len(env.view.read(tree_id))


def expect_stopped(call: Callable[[], Any], code: str = CRASH_CODE) -> AgentfoldError:
    """The call fails because this runtime stopped driving the tree (Scope's RuntimeError)."""
    with pytest.raises((RuntimeStopped, Fenced)) as caught:
        call()
    assert caught.value.code == code, caught.value
    return caught.value


def chain(env: Env, call: Any = None, name: str = "conformance.chain") -> Program:
    return chain_program(call or counted(env.log), name=name)


def the_unknown(tree: TreeState) -> EffectID:
    ids = [r.effect_id for p in tree.processes.values() for r in p.unknown_effects()]
    assert len(ids) == 1, f"expected one unknown effect, found {ids}"
    return ids[0]


def answer(tree: TreeState, pid: ProcessID, sid: str, payload: Any) -> SignalRequest:
    process = tree.processes[pid]
    assert process.current_wait is not None, f"{pid} is {process.status} without a current wait"
    return SignalRequest(SignalID(sid), payload, process.current_wait)


# ===========================================================================
# A. Effect boundaries and the terminal head


def scenario_unknown_then_resolved(env: Env) -> tuple[TreeID, EffectID, Any]:
    program = chain(env, lost(env.log), name="conformance.chain-lost")
    runtime, faulty = env.runtime(program)
    handle = runtime.start(program, {"n": 1})
    eid = the_unknown(runtime.wait_idle(handle.tree_id))
    runtime.resolve_unknown_effect(eid, Settlement.succeeded({"value": 5}))
    result = handle.result(10)
    assert (result.status, result.output) == ("completed", {"total": 5, "effects": 1})

    boundaries = [
        [
            type(e).__name__
            for e in call.events
            if getattr(e, "effect_id", None) == eid and not isinstance(e, EffectDeclared)
        ]
        for call in faulty.calls
    ]
    assert boundaries == [["EffectDispatched"], ["EffectSettled"], ["EffectResolved"]], boundaries
    settled = of_type(faulty.calls[1].events, EffectSettled, effect_id=eid)[0]
    assert settled.status == "unknown" and settled.diagnostic is not None
    assert of_type(faulty.calls[-1].events, ProcessTerminated, status="completed")
    head = env.view.head(handle.tree_id)
    assert head is not None and (head.status, head.classification) == ("completed", "terminal")
    loaded = env.load(handle.tree_id)
    assert loaded.root.status == "completed" and loaded.root.output == {"total": 5, "effects": 1}
    assert env.log.count() == 1
    return handle.tree_id, eid, faulty


def test_s01_unknown_outcome_resolved_by_host_commits_pending_settled_resolved_then_terminal(env: Env) -> None:
    """Scope 1: a dispatcher whose outcome is lost (it raises), resolved by the host.

    The effect's boundaries are exactly three appends: the one holding its dispatch
    permission, the one holding its unknown settlement, the one holding its
    resolution; the last append is terminal and loading the tree shows the root
    completed. Adaptation: the resolution and the completion it enables share one
    append (Scope commits the resolved boundary, then a terminal checkpoint).
    """
    scenario_unknown_then_resolved(env)


def scenario_stale_duplicates(env: Env) -> None:
    tree_id, _eid, faulty = scenario_unknown_then_resolved(env)
    before = head_fingerprint(env, tree_id)
    *historical, at_head = faulty.calls
    for call in historical:
        expect_conflict(
            lambda call=call: call.resubmit(env.view), f"re-submitting the append at version {call.expected}"
        )
        assert head_fingerprint(env, tree_id) == before, "a refused append changed the head"
    again = at_head.resubmit(env.view)
    assert again.digest == at_head.digest
    assert head_fingerprint(env, tree_id) == before


def test_s02_stale_duplicate_appends_are_refused_and_leave_the_head_unchanged(env: Env) -> None:
    """Scope 2: re-submitting each historical boundary is refused; the head is unchanged.

    The pending and settled appends are historical: each conflicts. Adaptation: the
    resolved boundary is the head itself here (resolution and completion are one
    append), so re-submitting it is the identical retry at the head, which succeeds
    idempotently and changes nothing (Scope's own rule for a retry at the head).
    """
    scenario_stale_duplicates(env)


def test_s03_competing_history_from_the_same_base_is_refused_and_leaves_the_head_unchanged(env: Env) -> None:
    """Scope 3: a second writer's boundaries branching from the same start are refused.

    Two competing histories with the same Effect identity, built by the kernel from
    the stored base: (a) the same writer settling the unknown with a different
    resolution, appended after the unknown settlement; (b) a second writer's
    activation branching from the start append (it would settle the in-flight Effect
    unknown). Both meet occupied versions: refused, head unchanged.
    """
    tree_id, eid, faulty = scenario_unknown_then_resolved(env)
    program = chain(env, lost(env.log), name="conformance.chain-lost")
    resolver = Catalog([program]).resolve
    before = head_fingerprint(env, tree_id)
    start_call, settled_call, _resolved_call = faulty.calls

    base = TreeState(resolver)
    for event in [*start_call.events, *settled_call.events]:
        base.apply(event)
    kernel = Kernel(base, resolver, RandomIds())
    competing = kernel.resolve_effect(eid, SettlementStatus.SUCCEEDED, {"value": 99})
    competing += kernel.advance().events
    assert of_type(competing, EffectResolved, effect_id=eid) and of_type(competing, ProcessTerminated)
    expect_conflict(
        lambda: env.view.append(
            tree_id,
            settled_call.expected + len(settled_call.events),
            competing,
            previous_digest=settled_call.digest,
            timestamp=settled_call.timestamp,
        ),
        "a competing resolution of the same effect",
    )
    assert head_fingerprint(env, tree_id) == before

    branch = TreeState(resolver)
    for event in start_call.events:
        branch.apply(event)
    rival = Kernel(branch, resolver, RandomIds()).activate(RandomIds().incarnation_id()).events
    assert isinstance(rival[0], WriterActivated) and of_type(rival, EffectSettled, effect_id=eid, status="unknown")
    expect_conflict(
        lambda: env.view.append(
            tree_id, len(start_call.events), rival, previous_digest=start_call.digest, timestamp=start_call.timestamp
        ),
        "a second writer's activation branching from the start",
    )
    assert head_fingerprint(env, tree_id) == before


# ===========================================================================
# B. Repeated waiting, pause and resume


def test_s04_pause_resume_cycles_of_a_waiting_process_recommit_the_same_content_under_new_versions(env: Env) -> None:
    """Scope 4: a waiting Process paused and resumed three times.

    Each pause is the append at version waiting+2k+1, each resume at waiting+2k+2;
    every paused state is identical; each resume restores exactly the waiting state
    (same WaitID, same usage) under a new version; replaying the historical waiting
    or paused append is refused and the head still equals the waiting state.
    Adaptation: "same snapshot digest" is "same folded Process JSON" (our digests
    chain through positions, so equal content at a new version has a new digest).
    """
    program = asker_program("conformance.asker")
    runtime, faulty = env.runtime(program)
    handle = runtime.start(program)
    tree = runtime.wait_idle(handle.tree_id)
    root = handle.root_process_id
    assert tree.root.status == "waiting"
    wait_id, usage = tree.root.current_wait, tree.root.usage
    waiting = env.version(handle.tree_id)
    waiting_json = process_json(env.load(handle.tree_id), root)
    paused_json: dict[str, Any] | None = None
    for k in range(3):
        assert runtime.pause(root, "hold") is True
        assert env.version(handle.tree_id) == waiting + 2 * k + 1
        stored = env.load(handle.tree_id)
        assert stored.root.status == "paused"
        assert (stored.root.current_wait, stored.root.usage) == (wait_id, usage)
        current = process_json(stored, root)
        paused_json = paused_json or current
        assert current == paused_json
        assert runtime.resume(root) is True
        assert env.version(handle.tree_id) == waiting + 2 * k + 2
        assert process_json(env.load(handle.tree_id), root) == waiting_json
    before = head_fingerprint(env, handle.tree_id)
    expect_conflict(lambda: faulty.calls[0].resubmit(env.view), "replaying the historical waiting append")
    expect_conflict(lambda: faulty.calls[1].resubmit(env.view), "replaying the historical paused append")
    assert head_fingerprint(env, handle.tree_id) == before
    assert process_json(env.load(handle.tree_id), root) == waiting_json
    runtime.deliver_signals(root, [answer(env.load(handle.tree_id), root, "a-1", {"name": "n"})])
    assert handle.result(10).output == {"hello": "n"}


# ===========================================================================
# C. Concurrent restore fencing


def parked_tree(env: Env, program: Program) -> TreeID:
    """A tree parked by a runtime that then went away (its lease released)."""
    runtime, _ = env.runtime(program)
    handle = runtime.start(program)
    assert runtime.wait_idle(handle.tree_id).root.status == "paused"
    runtime.close()
    return handle.tree_id


def scenario_concurrent_restore(env: Env) -> None:
    program = sleeper_program()
    tree_id = parked_tree(env, program)
    racers = [env.runtime(program, leases=False) for _ in range(2)]
    faults = [faulty.arm(holding(WriterActivated), "block_before") for _, faulty in racers]
    outcomes = [run_in_thread(lambda rt=rt: rt.recover(str(tree_id))) for rt, _ in racers]
    for fault in faults:
        fault.wait()  # both loaded the same parked head before either appends
    for fault in faults:
        fault.release("proceed")
    won, lost_with = [], []
    for outcome in outcomes:
        assert outcome.returned(15)
        if outcome.error is None:
            won.append(outcome.value)
        else:
            lost_with.append(outcome.error)
    assert len(won) == 1, f"exactly one restore must win; {len(won)} did"
    assert len(lost_with) == 1 and isinstance(lost_with[0], Fenced), lost_with
    assert lost_with[0].code == "engine.tree.incarnation_conflict"
    stored = env.load(tree_id)
    assert len(stored.incarnations) == 2 and stored.root.status == "paused"
    assert len(of_type(env.events(tree_id), WriterActivated)) == 1


def test_s05_concurrent_restores_of_one_head_exactly_one_wins_the_other_is_fenced(env: Env) -> None:
    """Scope 5: two runtimes restore the same parked head concurrently; exactly one wins.

    Both load the paused head and reach the store together (held until both arrive);
    the store's version check lets one ``WriterActivated`` in and the other runtime
    stops with ``engine.tree.incarnation_conflict``. Adaptation: the racers' leases
    grant everything, else the owner lease would refuse the loser before the store
    is asked (that path is the next test).
    """
    scenario_concurrent_restore(env)


def test_s05_concurrent_restores_with_owner_leases_let_exactly_one_runtime_own_the_tree(env: Env) -> None:
    """Scope 5 with our owner leases in place: the loser is refused by the lease.

    Exactly one of two concurrent ``recover`` calls owns the tree; the other gets
    ``engine.tree.owned`` (or the fence, if it lost the race at the store instead).
    """
    program = sleeper_program()
    tree_id = parked_tree(env, program)
    racers = [env.runtime(program)[0] for _ in range(2)]
    outcomes = [run_in_thread(lambda rt=rt: rt.recover(str(tree_id))) for rt in racers]
    errors = [o.error for o in outcomes if o.returned(15) and o.error is not None]
    assert len(errors) == 1 and isinstance(errors[0], Fenced), errors
    assert errors[0].code in ("engine.tree.owned", "engine.tree.incarnation_conflict")
    assert sum(rt.owns(tree_id) for rt in racers) == 1
    assert len(of_type(env.events(tree_id), WriterActivated)) == 1


# ===========================================================================
# D. A delayed commit loses to an activation


def test_s06_delayed_commit_of_a_fenced_writer_loses_to_the_new_owner_and_appends_nothing(env: Env) -> None:
    """Scope 6: the original writer is blocked inside its settlement commit; another
    runtime restores the base head and completes the tree. Released, the old commit
    is refused, the old runtime stops fenced (its ``result`` raises
    ``engine.tree.incarnation_conflict``, never the winner's result as its own) and
    the head stays the winner's terminal head.

    Adaptation: the original's lease is a grant-all one (lost while it was blocked);
    with a live lease nobody else may recover the tree.
    """
    program = chain(env)
    original, faulty = env.runtime(program, leases=False)
    delayed = faulty.arm(holding(EffectSettled), "block_before")
    handle = original.start(program, {"n": 1})
    delayed.wait()
    waiter = run_in_thread(lambda: handle.result(20))

    winner, _ = env.runtime(program, leases=False)
    winner.recover(str(handle.tree_id))
    eid = the_unknown(winner.wait_idle(handle.tree_id))  # the dispatch's outcome was never recorded
    winner.resolve_unknown_effect(eid, Settlement.succeeded({"value": 7}))
    assert winner.result(handle.tree_id, 10).status == "completed"
    terminal_head = head_fingerprint(env, handle.tree_id)

    delayed.release("proceed")
    with pytest.raises(Fenced) as fenced:
        waiter.get()
    assert fenced.value.code == "engine.tree.incarnation_conflict"
    assert head_fingerprint(env, handle.tree_id) == terminal_head
    assert not original.owns(handle.tree_id)
    assert env.log.count() == 1


# ===========================================================================
# E. Crash boundaries


def test_s07_root_start_cut_before_commit_leaves_no_tree_and_start_fails(env: Env) -> None:
    """Scope 7: the start append is cut before it is written.

    ``start`` raises the crash error and returns no handle; the store has no head, no
    event and no Process; nothing was dispatched. The start id stays free: starting
    it again (on another runtime) creates the tree for real.
    """
    program = chain(env)
    runtime, faulty = env.runtime(program)
    fault = faulty.arm(holding(TreeStarted), "fail_before")
    with pytest.raises(StoreFailure) as failed:
        runtime.start(program, {"n": 1}, start_id="s07-start")
    assert failed.value.code == CRASH_CODE
    tree_id = TreeID.for_start(StartID("s07-start"))
    root = fault.events[0].process_id
    assert env.view.head(tree_id) is None and env.view.read(tree_id) == []
    assert env.view.tree_of_process(root) is None and not runtime.owns(tree_id)
    assert env.log.count() == 0
    other, _ = env.runtime(program)
    assert other.start(program, {"n": 1}, start_id="s07-start").result(10).status == "completed"
    assert env.log.count() == 1


def test_s08_root_start_written_but_unacknowledged_is_recovered_into_a_working_tree(env: Env) -> None:
    """Scope 8: the start append is written, its acknowledgement lost.

    ``start`` raises; the head exists (the root parked by its first Step); another
    runtime recovers it into a working tree (paused, resumable to completion), and the
    host's retry of the same start id returns that same tree, never a second one.
    """
    program = gate_program("effect", counted(env.log))
    runtime, faulty = env.runtime(program)
    faulty.arm(holding(TreeStarted), "fail_after")
    with pytest.raises(StoreFailure):
        runtime.start(program, None, start_id="s08-start")
    tree_id = TreeID.for_start(StartID("s08-start"))
    head = env.view.head(tree_id)
    assert head is not None and head.status == "paused"
    assert not runtime.owns(tree_id)

    restorer, _ = env.runtime(program)
    [handle] = restorer.recover(str(tree_id))
    assert restorer.wait_idle(tree_id).root.status == "paused"
    again = restorer.start(program, None, start_id="s08-start")
    assert (again.tree_id, again.root_process_id) == (tree_id, handle.root_process_id)
    assert len(of_type(env.events(tree_id), TreeStarted)) == 1
    restorer.resume(handle.root_process_id)
    assert handle.result(10).output == {"status": "succeeded", "result": {"value": 7}}
    assert env.log.count() == 1


def gated(env: Env, then: str, call: Any = None, budget: Budget | None = None) -> tuple[Runtime, Any, Any, Program]:
    program = gate_program(then, call)
    runtime, faulty = env.runtime(program)
    handle = runtime.start(program, budget=budget)
    assert runtime.wait_idle(handle.tree_id).root.status == "paused"
    return runtime, faulty, handle, program


def test_s09_pending_boundary_cut_before_commit_calls_nothing_and_restore_dispatches_once(env: Env) -> None:
    """Scope 9: the append holding the dispatch permission is cut before it is written.

    The dispatcher is not called, the head is the base (paused, one Step), the
    original runtime stops. Restored by a new runtime, the Step is computed again
    with the same EffectID and dispatched exactly once; the tree completes.
    Adaptation: our Step rides in the append of the input that made it possible (the
    host's resume); the cut removes the resume too, so the host repeats its resume
    after the restore (its reconciliation path for an unacknowledged request).
    """
    runtime, faulty, handle, program = gated(env, "effect", counted(env.log))
    base = head_fingerprint(env, handle.tree_id)
    fault = faulty.arm(holding(EffectDispatched), "fail_before")
    expect_stopped(lambda: runtime.resume(handle.root_process_id))
    cut = of_type(fault.events, EffectDispatched)[0].effect_id
    assert env.log.count() == 0
    assert head_fingerprint(env, handle.tree_id) == base
    expect_stopped(lambda: handle.result(5))

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    assert restorer.wait_idle(handle.tree_id).root.status == "paused"
    restorer.resume(handle.root_process_id)
    assert restorer.result(handle.tree_id, 10).status == "completed"
    assert [c["effect_id"] for c in env.log.calls()] == [cut]


def test_s10_pending_boundary_written_but_unacknowledged_settles_unknown_without_any_dispatch(env: Env) -> None:
    """Scope 10: the dispatch permission is written, the acknowledgement lost, so the
    original runtime never dispatched. Recovery (policy ``never``) settles the Effect
    unknown (``engine.dispatch.interrupted``) without calling anything; the host
    resolves it and the tree completes; zero dispatches overall.
    """
    runtime, faulty, handle, program = gated(env, "effect", counted(env.log))
    fault = faulty.arm(holding(EffectDispatched), "fail_after")
    expect_stopped(lambda: runtime.resume(handle.root_process_id))
    eid = of_type(fault.events, EffectDispatched)[0].effect_id
    assert env.log.count() == 0

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    assert the_unknown(restorer.wait_idle(handle.tree_id)) == eid
    settled = of_type(env.events(handle.tree_id), EffectSettled, effect_id=eid)
    assert [(s.status, s.diagnostic.code if s.diagnostic else None) for s in settled] == [
        ("unknown", "engine.dispatch.interrupted")
    ]
    restorer.resolve_unknown_effect(eid, Settlement.succeeded({"value": 3}))
    assert restorer.result(handle.tree_id, 10).output == {"status": "succeeded", "result": {"value": 3}}
    assert env.log.count() == 0


def test_s11_after_dispatch_before_settlement_recovers_unknown_without_redispatch(env: Env) -> None:
    """Scope 11: the dispatcher ran once; the append holding its settlement is cut
    before it is written. Recovery settles the Effect unknown without calling it
    again; the host resolves it; the tree completes; still exactly one call.
    """
    program = chain(env)
    runtime, faulty = env.runtime(program)
    faulty.arm(holding(EffectSettled), "fail_before")
    handle = runtime.start(program, {"n": 1})
    expect_stopped(lambda: handle.result(10))
    assert env.log.count() == 1

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    eid = the_unknown(restorer.wait_idle(handle.tree_id))
    restorer.resolve_unknown_effect(eid, Settlement.succeeded({"value": 7}))
    assert restorer.result(handle.tree_id, 10).output == {"total": 7, "effects": 1}
    assert env.log.count() == 1


def test_s12_settlement_written_but_unacknowledged_is_not_published_and_restore_needs_no_call(env: Env) -> None:
    """Scope 12: the settlement append is written, its acknowledgement lost.

    The original runtime never publishes the outcome it could not confirm: its
    ``result`` raises the crash error instead of returning the completion. The
    restored tree is complete without another dispatch (one call). Adaptation: with
    one Effect the settlement and the completion share that append, so the restored
    tree is already terminal and needs no new writer (no ``WriterActivated``).
    """
    program = chain(env)
    runtime, faulty = env.runtime(program)
    faulty.arm(holding(EffectSettled), "fail_after")
    handle = runtime.start(program, {"n": 1})
    expect_stopped(lambda: handle.result(10))

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    assert restorer.result(handle.tree_id, 10).output == {"total": 7, "effects": 1}
    assert not of_type(env.events(handle.tree_id), WriterActivated)
    assert env.log.count() == 1


def unknown_chain(env: Env) -> tuple[Runtime, Any, Any, EffectID, Program]:
    program = chain(env, lost(env.log), name="conformance.chain-lost")
    runtime, faulty = env.runtime(program)
    handle = runtime.start(program, {"n": 1})
    eid = the_unknown(runtime.wait_idle(handle.tree_id))
    return runtime, faulty, handle, eid, program


def test_s13_resolution_cut_before_commit_keeps_the_unknown_and_a_second_resolution_completes(env: Env) -> None:
    """Scope 13: the host's resolution append is held, then cut before it is written.

    The resolve call does not return before the store answers, then fails with the
    crash error; the original runtime's ``result`` fails too. The head still holds
    the same unknown Effect; a restored runtime shows it, the host resolves it again
    and the tree completes with usage {steps 2, effects 1, signals 1}; one dispatch.
    """
    runtime, faulty, handle, eid, program = unknown_chain(env)
    fault = faulty.arm(holding(EffectResolved), "block_before")
    resolving = run_in_thread(lambda: runtime.resolve_unknown_effect(eid, Settlement.succeeded({"value": 2})))
    fault.wait()
    assert not resolving.returned(0.1), "resolve returned before its append was acknowledged"
    head = env.view.head(handle.tree_id)
    assert head is not None and head.unknown_effect_ids == (eid,)
    fault.release("fail")
    expect_stopped(resolving.get)
    expect_stopped(lambda: handle.result(5))

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    assert the_unknown(restorer.wait_idle(handle.tree_id)) == eid
    restorer.resolve_unknown_effect(eid, Settlement.succeeded({"value": 2}))
    result = restorer.result(handle.tree_id, 10)
    assert result.output == {"total": 2, "effects": 1}
    assert result.usage == {"steps": 2, "effects": 1, "signals": 1}
    assert env.log.count() == 1


def test_s14_resolution_written_but_unacknowledged_completes_without_a_second_resolution(env: Env) -> None:
    """Scope 14: the resolution append is written, its acknowledgement lost.

    The resolve call fails with the crash error; the head already holds the
    resolution (and the completion it enabled), so the restored tree is complete
    without another resolution: resolving again is refused (nothing unknown left);
    one dispatch.
    """
    runtime, faulty, handle, eid, program = unknown_chain(env)
    faulty.arm(holding(EffectResolved), "fail_after")
    expect_stopped(lambda: runtime.resolve_unknown_effect(eid, Settlement.succeeded({"value": 2})))

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    assert restorer.result(handle.tree_id, 10).output == {"total": 2, "effects": 1}
    with pytest.raises(AgentfoldError) as again:
        restorer.resolve_unknown_effect(eid, Settlement.succeeded({"value": 2}))
    assert again.value.code == "engine.effect.not_pending"
    assert len(of_type(env.events(handle.tree_id), EffectResolved)) == 1
    assert env.log.count() == 1


ROOT_BUDGET = Budget.of(steps=100, effects=50, signals=100)
GRANT = Allocation(steps=10, effects=5, signals=10)  # tests.conformance.programs.CHILD_GRANT as a debit


def child_recovery_completes(env: Env, restorer: Runtime, handle: Any, child_id: ProcessID) -> None:
    tree = restorer.wait_idle(handle.tree_id)
    assert tree.root.status == "waiting"
    child = child_of(tree)
    assert child.process_id == child_id and child.status == "waiting"
    restorer.deliver_signals(child_id, [answer(tree, child_id, "name-1", {"name": "kid"})])
    result = restorer.result(handle.tree_id, 10)
    assert result.output == {"child": "completed", "output": {"hello": "kid"}}
    stored = env.load(handle.tree_id)
    assert stored.root.allocated == GRANT  # debited once, though the start ran twice
    assert stored.root.usage == {"steps": 5, "effects": 2, "signals": 3}
    assert stored.processes[child_id].usage == {"steps": 3, "effects": 1, "signals": 2}


def test_s15_child_start_cut_before_commit_publishes_no_child_and_restore_recreates_the_same_child(env: Env) -> None:
    """Scope 15: the append that starts a child is held, then cut before it is written.

    Before the store answers the child is published nowhere (not findable by id) and
    the head has one Process; the host's request fails with the crash error. After a
    restore the Step runs again and starts the child under the same derived
    ProcessID; root and child wait; answering the child completes both, with usage
    root {5, 2, 3} and child {3, 1, 2}. Adaptation: the root first parks (one extra
    Step: Scope's root usage is {4, 2, 3}) so that a host resume opens the append
    that starts the child; the host repeats the resume after the restore.
    """
    runtime, faulty, handle, program = gated(env, "child", budget=ROOT_BUDGET)
    fault = faulty.arm(holding(ProcessStarted), "block_before")
    resuming = run_in_thread(lambda: runtime.resume(handle.root_process_id))
    fault.wait()
    child_id = of_type(fault.events, ProcessStarted)[0].process_id
    assert child_id == child_process_id(effect_id(handle.root_process_id, 2, 0))
    assert not resuming.returned(0.1)
    assert env.view.tree_of_process(child_id) is None
    assert len(env.load(handle.tree_id).processes) == 1
    fault.release("fail")
    expect_stopped(resuming.get)
    assert len(env.load(handle.tree_id).processes) == 1

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    restorer.resume(handle.root_process_id)
    child_recovery_completes(env, restorer, handle, child_id)


def test_s16_child_start_written_but_unacknowledged_is_recovered_with_the_same_outcome(env: Env) -> None:
    """Scope 16: the append that starts the child is written; the acknowledgement is
    held, then lost. The host's resume does not return meanwhile and then fails; the
    head has two Processes; the restored tree needs no repeated resume and reaches
    the same outcome as scenario 15 (same child id, same usage).
    """
    runtime, faulty, handle, program = gated(env, "child", budget=ROOT_BUDGET)
    fault = faulty.arm(holding(ProcessStarted), "block_after")
    resuming = run_in_thread(lambda: runtime.resume(handle.root_process_id))
    fault.wait()
    assert not resuming.returned(0.1)
    fault.release("fail")
    expect_stopped(resuming.get)
    child_id = of_type(fault.events, ProcessStarted)[0].process_id
    assert len(env.load(handle.tree_id).processes) == 2

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    child_recovery_completes(env, restorer, handle, child_id)


def test_s17_progress_cut_before_commit_is_recomputed_after_restore(env: Env) -> None:
    """Scope 17: an append holding effect-free progress is cut before it is written.

    The head keeps the committed Steps of the base (here 1: the parking Step); after
    the restore the progress is computed again and the tree completes with all its
    Steps counted once (4). Adaptation: Scope's base has 0 Steps and ends with 2; our
    Program parks first so that a host resume opens the progress append (resume →
    effect-free continue → park again), and the host repeats the resume.
    """
    runtime, faulty, handle, program = gated(env, "progress")
    faulty.arm(holding(ControlRequested, control="resume"), "fail_before")
    expect_stopped(lambda: runtime.resume(handle.root_process_id))
    stored = env.load(handle.tree_id)
    assert (stored.root.committed_steps, stored.root.status) == (1, "paused")

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    restorer.resume(handle.root_process_id)
    tree = restorer.wait_idle(handle.tree_id)
    assert (tree.root.committed_steps, tree.root.pause_reason) == (3, "parked after progress")
    restorer.resume(handle.root_process_id)
    result = restorer.result(handle.tree_id, 10)
    assert result.output == {"progress": 1} and result.usage["steps"] == 4


def test_s18_progress_written_but_unacknowledged_is_kept_and_not_recomputed(env: Env) -> None:
    """Scope 18: the progress append is written, its acknowledgement lost.

    The head holds the progress (3 committed Steps, parked again); the restore runs
    no Step again (no new ``StepCommitted``) and the tree completes with 4 Steps.
    """
    runtime, faulty, handle, program = gated(env, "progress")
    faulty.arm(holding(ControlRequested, control="resume"), "fail_after")
    expect_stopped(lambda: runtime.resume(handle.root_process_id))
    stored = env.load(handle.tree_id)
    assert (stored.root.committed_steps, stored.root.status) == (3, "paused")
    steps = len(of_type(env.events(handle.tree_id), StepCommitted))

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    assert restorer.wait_idle(handle.tree_id).root.committed_steps == 3
    assert len(of_type(env.events(handle.tree_id), StepCommitted)) == steps
    restorer.resume(handle.root_process_id)
    assert restorer.result(handle.tree_id, 10).usage["steps"] == 4


def test_s19_pause_written_but_unacknowledged_is_restored_paused(env: Env) -> None:
    """Scope 19: a waiting Process is paused; the pause append is written and its
    acknowledgement held, then lost. The pause call does not return meanwhile and
    then fails; the restored Process is paused (with its reason and its wait), and
    resuming and answering it completes it.
    """
    program = asker_program("conformance.asker")
    runtime, faulty = env.runtime(program)
    handle = runtime.start(program)
    assert runtime.wait_idle(handle.tree_id).root.status == "waiting"
    fault = faulty.arm(holding(ControlRequested, control="pause"), "block_after")
    pausing = run_in_thread(lambda: runtime.pause(handle.root_process_id, "hold"))
    fault.wait()
    assert not pausing.returned(0.1)
    fault.release("fail")
    expect_stopped(pausing.get)

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    tree = restorer.wait_idle(handle.tree_id)
    assert (tree.root.status, tree.root.pause_reason) == ("paused", "hold")
    restorer.resume(handle.root_process_id)
    tree = restorer.wait_idle(handle.tree_id)
    restorer.deliver_signals(handle.root_process_id, [answer(tree, handle.root_process_id, "a-1", {"name": "p"})])
    assert restorer.result(handle.tree_id, 10).output == {"hello": "p"}


def test_s20_terminal_append_written_but_unacknowledged_publishes_no_result_from_the_original(env: Env) -> None:
    """Scope 20: the terminal append is written, its acknowledgement held, then lost.

    While it is held, a caller waiting for the result gets nothing; then it gets the
    crash error (the original never publishes the completion it could not confirm).
    A restored runtime reports the completed result.
    """
    program = chain(env)
    runtime, faulty = env.runtime(program)
    fault = faulty.arm(holding(ProcessTerminated), "block_after")
    handle = runtime.start(program, {"n": 1})
    waiting = run_in_thread(lambda: handle.result(20))
    fault.wait()
    assert not waiting.returned(0.1)
    assert env.load(handle.tree_id).root.status == "completed"
    fault.release("fail")
    expect_stopped(waiting.get)

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    assert restorer.result(handle.tree_id, 10).output == {"total": 7, "effects": 1}
    assert env.log.count() == 1


def test_s21_activation_written_but_unacknowledged_fences_the_old_writer_and_a_second_restore_works(
    env: Env,
) -> None:
    """Scope 21: a restore's activation is written; its acknowledgement held, then lost.

    Until it returns, the restoring runtime owns nothing; then ``recover`` fails with
    the crash error. A second restore from the new head works (paused). The original
    writer, asked to kill, is fenced (``engine.tree.incarnation_conflict``) and appends
    nothing. Adaptation: the restorers' leases grant everything (the original still
    holds its lease; Scope has no leases).
    """
    program = sleeper_program()
    original, _ = env.runtime(program)
    handle = original.start(program)
    assert original.wait_idle(handle.tree_id).root.status == "paused"

    first, faulty = env.runtime(program, leases=False)
    fault = faulty.arm(holding(WriterActivated), "block_after")
    restoring = run_in_thread(lambda: first.recover(str(handle.tree_id)))
    fault.wait()
    assert not restoring.returned(0.1) and not first.owns(handle.tree_id)
    fault.release("fail")
    with pytest.raises(StoreFailure):
        restoring.get()
    assert not first.owns(handle.tree_id)
    assert len(env.load(handle.tree_id).incarnations) == 2

    second, _ = env.runtime(program, leases=False)
    second.recover(str(handle.tree_id))
    assert second.wait_idle(handle.tree_id).root.status == "paused"
    before = head_fingerprint(env, handle.tree_id)
    expect_stopped(lambda: original.kill(handle.root_process_id), "engine.tree.incarnation_conflict")
    assert head_fingerprint(env, handle.tree_id) == before
    assert not of_type(env.events(handle.tree_id), ControlRequested)
    second.resume(handle.root_process_id)
    assert second.result(handle.tree_id, 10).status == "completed"


def test_s22_subtree_cancellation_written_but_unacknowledged_is_restored_with_the_parent_completed(
    env: Env,
) -> None:
    """Scope 22: the host cancels a waiting child; the append is written and its
    acknowledgement held, then lost. Neither the cancel call nor the original's
    result waiter returns meanwhile; both then fail with the crash error. Restored:
    the child is canceled (``host_cancellation``) and the parent, waiting for its
    child's terminal result, completed. Adaptation: the child's termination and the
    parent's completion ride in the cancel's own append.
    """
    program = parent_program(asker_program("conformance.asker"), 1, name="conformance.parent")
    runtime, faulty = env.runtime(program)
    handle = runtime.start(program)
    tree = runtime.wait_idle(handle.tree_id)
    child = child_of(tree)
    assert (tree.root.status, child.status) == ("waiting", "waiting")
    waiting = run_in_thread(lambda: handle.result(20))
    fault = faulty.arm(holding(ControlRequested, control="cancel"), "block_after")
    canceling = run_in_thread(lambda: runtime.cancel(child.process_id, "no longer needed"))
    fault.wait()
    assert not canceling.returned(0.1) and not waiting.returned(0)
    fault.release("fail")
    expect_stopped(canceling.get)
    expect_stopped(waiting.get)

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    result = restorer.result(handle.tree_id, 10)
    assert result.output == {"outcomes": [{"status": "canceled", "output": None}]}
    stored = env.load(handle.tree_id).processes[child.process_id]
    assert stored.termination is not None and stored.termination.cause == "host_cancellation"


# ===========================================================================
# F. A store call that blocks (Scope: detached storage shutdown)


def blocked_progress(env: Env, mode: str) -> None:
    program = chain(env)
    runtime, faulty = env.runtime(program)
    fault = faulty.arm(holding(EffectSettled), mode)
    handle = runtime.start(program, {"n": 2})
    fault.wait()
    base = len(runtime.store.calls[0].events)
    with pytest.raises(TimeoutError):
        handle.result(0.2)
    with pytest.raises(TimeoutError):
        runtime.wait_idle(handle.tree_id, timeout=0.2)
    with pytest.raises(RuntimeStopped) as busy:
        runtime.close(timeout=0.2)
    assert busy.value.code == "engine.runtime.busy"
    with pytest.raises(RuntimeStopped):
        runtime.start(program, {"n": 1})  # a closing runtime takes no new work

    fault.release("fail")
    expect_stopped(lambda: handle.result(10))
    expect_stopped(lambda: runtime.wait_idle(handle.tree_id, timeout=5))  # drains with the same cause
    written = len(fault.events) if mode == "block_after" else 0
    assert env.version(handle.tree_id) == base + written
    runtime.close(timeout=5)
    assert env.log.count() == 1

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    unknown = the_unknown(restorer.wait_idle(handle.tree_id))
    first, second = effect_id(handle.root_process_id, 1, 0), effect_id(handle.root_process_id, 2, 0)
    assert unknown == (second if mode == "block_after" else first)


def test_s23_store_call_blocked_before_writing_publishes_nothing_and_close_waits_for_it(env: Env) -> None:
    """Scope 23: a progress append blocks inside the store before writing.

    Adaptation (Python has no detached contexts): a caller's bounded wait (``result``,
    ``wait_idle``) times out instead of hanging; ``close`` refuses with
    ``engine.runtime.busy`` while the owner line is inside the store and the runtime
    takes no new work; once the host aborts the store call, ``result`` fails with the
    crash error, the head is the base, and ``close`` succeeds. The settlement that
    was cut is unknown after recovery (the dispatcher ran once).
    """
    blocked_progress(env, "block_before")


def test_s24_store_call_blocked_after_writing_publishes_nothing_and_close_waits_for_it(env: Env) -> None:
    """Scope 24: as scenario 23, the append written before the store call blocks.

    The head is the prospective one (the first settlement and the second dispatch
    permission); the second Effect was never dispatched, so recovery settles it
    unknown without calling it.
    """
    blocked_progress(env, "block_after")


# ===========================================================================
# G. Durable signal admission


NOTE = SignalRequest(SignalID("note-1"), {"text": "hello"})
NOTE_CONFLICT = SignalRequest(SignalID("note-1"), {"text": "something else"})


def assert_note_admitted_once(env: Env, tree_id: TreeID, accepted_before: int) -> None:
    root = env.load(tree_id).root
    records = [r for r in root.mailbox if r.signal_id == NOTE.id]
    assert len(records) == 1
    record = records[0]
    assert (record.wait_id, record.consumed, record.payload, record.digest) == (
        None,
        False,
        NOTE.payload,
        NOTE.payload_digest,
    )
    assert root.accepted_signals == accepted_before + 1
    assert root.status == "paused"


def refuses_conflicting_note(runtime: Runtime, pid: ProcessID) -> None:
    with pytest.raises(AgentfoldError) as conflict:
        runtime.deliver_signals(pid, [NOTE_CONFLICT])
    assert conflict.value.code == "engine.signal.conflict"


def test_s25_signal_admission_is_acknowledged_only_after_its_append(env: Env) -> None:
    """Scope 25: a paused Process receives an unaddressed signal; the append is held.

    ``deliver_signals`` does not return while the store has not answered; meanwhile
    the store shows neither the receipt nor a usage change. Once the append returns
    the call answers ``True`` and the head holds a pending receipt matching the
    request (id, no wait, payload and its digest). A repeat is deduplicated
    (``False``, nothing appended); the same id with another payload is refused.
    """
    runtime, faulty, handle, _program = gated(env, "effect", counted(env.log))
    pid = handle.root_process_id
    accepted = env.load(handle.tree_id).root.accepted_signals
    fault = faulty.arm(holding(SignalAdmitted), "block_before")
    delivering = run_in_thread(lambda: runtime.deliver_signals(pid, [NOTE]))
    fault.wait()
    assert not delivering.returned(0.1)
    stored = env.load(handle.tree_id).root
    assert NOTE.id not in stored.signal_index and stored.accepted_signals == accepted
    fault.release("proceed")
    assert delivering.get() is True
    assert_note_admitted_once(env, handle.tree_id, accepted)
    version = env.version(handle.tree_id)
    assert runtime.deliver_signals(pid, [NOTE]) is False
    assert env.version(handle.tree_id) == version
    refuses_conflicting_note(runtime, pid)


def test_s26_signal_admission_cut_before_commit_is_admitted_once_on_redelivery(env: Env) -> None:
    """Scope 26: the admission append is cut before it is written.

    The delivery fails with the crash error and the runtime stops; the head lacks the
    signal. After a restore, re-delivering the same request is accepted (``True``)
    and charged once; a conflicting payload under the same id is refused.
    """
    runtime, faulty, handle, program = gated(env, "effect", counted(env.log))
    pid = handle.root_process_id
    accepted = env.load(handle.tree_id).root.accepted_signals
    faulty.arm(holding(SignalAdmitted), "fail_before")
    expect_stopped(lambda: runtime.deliver_signals(pid, [NOTE]))
    assert not runtime.owns(handle.tree_id)
    assert NOTE.id not in env.load(handle.tree_id).root.signal_index

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    assert restorer.deliver_signals(pid, [NOTE]) is True
    assert_note_admitted_once(env, handle.tree_id, accepted)
    refuses_conflicting_note(restorer, pid)


def test_s27_signal_admission_written_but_unacknowledged_is_deduplicated_on_redelivery(env: Env) -> None:
    """Scope 27: the admission append is written, its acknowledgement lost.

    The delivery fails with the crash error; the head holds the signal. After a
    restore, re-delivering the same request answers ``False`` without error (already
    admitted) and it is charged once; a conflicting payload is refused.
    """
    runtime, faulty, handle, program = gated(env, "effect", counted(env.log))
    pid = handle.root_process_id
    accepted = env.load(handle.tree_id).root.accepted_signals
    faulty.arm(holding(SignalAdmitted), "fail_after")
    expect_stopped(lambda: runtime.deliver_signals(pid, [NOTE]))
    assert_note_admitted_once(env, handle.tree_id, accepted)

    restorer, _ = env.runtime(program)
    restorer.recover(str(handle.tree_id))
    assert restorer.deliver_signals(pid, [NOTE]) is False
    assert_note_admitted_once(env, handle.tree_id, accepted)
    refuses_conflicting_note(restorer, pid)


# ===========================================================================
# H. Framework child controls


class Controlled:
    """A controller tree waiting for ``go``, with its sleeping child."""

    def __init__(self, env: Env, limits: TreeLimits | None = None, *, leases: bool = True) -> None:
        self.env = env
        self.program = controller_program()
        self.runtime, self.faulty = env.runtime(self.program, leases=leases)
        self.handle = self.runtime.start(self.program, limits=limits, budget=ROOT_BUDGET)
        self.tree_id = self.handle.tree_id
        self.root = self.handle.root_process_id
        tree = self.runtime.wait_idle(self.tree_id)
        self.child = child_of(tree).process_id
        assert (tree.root.status, tree.processes[self.child].status) == ("waiting", "paused")
        self.go_wait = tree.root.current_wait

    def go_request(self, *controls: dict[str, Any]) -> SignalRequest:
        return SignalRequest(SignalID("go-1"), go(*controls), self.go_wait)

    def send(self, *controls: dict[str, Any]) -> TreeState:
        assert self.runtime.deliver_signals(self.root, [self.go_request(*controls)]) is True
        return self.runtime.wait_idle(self.tree_id)

    def control_effects(self, events: list[Any]) -> list[EffectDeclared]:
        return [
            e
            for e in of_type(events, EffectDeclared, process_id=self.root)
            if isinstance(e.payload, dict) and e.payload.get("operation") in ("signal_child", "cancel_child")
        ]

    def stored(self) -> TreeState:
        return self.env.load(self.tree_id)


def signal_to(to: str, sid: str = "note-1", payload: Any = None) -> dict[str, Any]:
    return {"op": "signal", "to": to, "signal_id": sid, "payload": payload if payload is not None else {"text": "hi"}}


def cancel_of(to: str, reason: str = "stop now") -> dict[str, Any]:
    return {"op": "cancel", "to": to, "reason": reason}


def receipts_of(events: list[Any], effects: list[EffectDeclared]) -> list[EffectSettled]:
    return [of_type(events, EffectSettled, effect_id=e.effect_id)[0] for e in effects]


def assert_signal_continuation(c: Controlled, signal_events: list[Any]) -> None:
    """After a signal_child: one settled receipt, the child's pending record, both in one append."""
    [effect] = c.control_effects(signal_events)
    assert not of_type(signal_events, EffectDispatched, effect_id=effect.effect_id), "a child control has no dispatch"
    [receipt] = receipts_of(signal_events, [effect])
    assert receipt.status == "succeeded" and receipt.payload == {"child": c.child, "signal_id": "note-1"}
    assert of_type(signal_events, SignalAdmitted, process_id=c.child, signal_id="note-1", source="parent")
    stored = c.stored()
    child = stored.processes[c.child]
    assert child.status == "paused" and child.usage == {"steps": 1, "effects": 0, "signals": 1}
    [record] = child.mailbox
    assert (record.signal_id, record.consumed, record.payload) == ("note-1", False, {"text": "hi"})
    assert stored.root.status == "waiting"  # now on the child's terminal result


def finish_signal_continuation(c: Controlled, runtime: Runtime) -> None:
    """Resume the child: it consumes the signal exactly once and the parent completes."""
    runtime.resume(c.child)
    result = runtime.result(c.tree_id, 10)
    assert result.output == {
        "receipts": [{"child": c.child, "signal_id": "note-1"}],
        "child": "completed",
        "output": {"signals": ["note-1"], "payloads": [{"text": "hi"}]},
    }
    [record] = c.stored().processes[c.child].mailbox
    assert (record.signal_id, record.consumed, record.payload) == ("note-1", True, None)


def test_s28_signal_child_commits_receipt_and_child_input_together_and_is_consumed_once(env: Env) -> None:
    """Scope 28: the parent signals its paused child.

    One settled receipt (no dispatch permission) whose append also holds the child's
    pending record: child usage +1 signal, still paused; the parent's allocations are
    unchanged. Once the parent adopted the receipt and the child is resumed, the child
    consumes the signal exactly once (one consumed record, payload released).
    """
    c = Controlled(env)
    assert c.stored().root.allocated == GRANT  # debited when the child started
    c.send(signal_to("child"))
    assert_signal_continuation(c, c.faulty.calls[-1].events)
    assert c.stored().root.allocated == GRANT
    finish_signal_continuation(c, c.runtime)


def test_s29_duplicate_signal_child_effects_settle_twice_and_the_child_admits_the_signal_once(env: Env) -> None:
    """Scope 29: the same signal_child Effect declared twice in one batch: two settled
    receipts under distinct EffectIDs, and the child admits the signal once.
    """
    c = Controlled(env)
    c.send(signal_to("child"), signal_to("child"))
    events = c.faulty.calls[-1].events
    effects = c.control_effects(events)
    assert len(effects) == 2 and effects[0].effect_id != effects[1].effect_id
    assert [r.status for r in receipts_of(events, effects)] == ["succeeded", "succeeded"]
    assert len(of_type(events, SignalAdmitted, process_id=c.child)) == 1
    child = c.stored().processes[c.child]
    assert [r.signal_id for r in child.mailbox] == ["note-1"] and child.accepted_signals == 1


def test_s30_signal_child_to_a_full_mailbox_fails_and_leaves_the_child_byte_identical(env: Env) -> None:
    """Scope 30: the child's mailbox is full (max_pending_signals 2, filled by two host
    signals): the receipt fails ``engine.child.signal.rejected`` (execution) and the
    child's folded state is byte-identical to before.
    """
    c = Controlled(env, TreeLimits(max_pending_signals=2))
    fill = [SignalRequest(SignalID("fill-1"), {"n": 1}), SignalRequest(SignalID("fill-2"), {"n": 2})]
    assert c.runtime.deliver_signals(c.child, fill) is True
    before = canonical_bytes(process_json(c.stored(), c.child))
    c.send(signal_to("child"))
    [receipt] = receipts_of(c.faulty.calls[-1].events, c.control_effects(c.faulty.calls[-1].events))
    assert receipt.status == "failed"
    failure = receipt.payload["failure"]
    assert (failure["code"], failure["kind"]) == ("engine.child.signal.rejected", "execution")
    assert canonical_bytes(process_json(c.stored(), c.child)) == before
    c.runtime.resume(c.child)
    assert c.runtime.result(c.tree_id, 10).output["output"]["signals"] == ["fill-1", "fill-2"]


def test_signal_child_through_the_childs_admission_rules_a_payload_its_schema_refuses_fails_rejected(
    env: Env,
) -> None:
    """Scope §6.4 (beyond the 40): signal_child delivers "through the child's ordinary
    admission rules", the signal schema included (Scope's prepareSignals validates every
    unaddressed external signal). The sleeper accepts objects only: a string fails the
    receipt ``engine.child.signal.rejected`` (execution) and leaves the child byte-identical.
    Before, a parent's signal skipped the schema and was admitted.
    """
    c = Controlled(env)
    before = canonical_bytes(process_json(c.stored(), c.child))
    c.send(signal_to("child", payload="not an object"))
    [receipt] = receipts_of(c.faulty.calls[-1].events, c.control_effects(c.faulty.calls[-1].events))
    assert receipt.status == "failed"
    failure = receipt.payload["failure"]
    assert (failure["code"], failure["kind"]) == ("engine.child.signal.rejected", "execution")
    assert "signal schema" in failure["message"]
    assert not of_type(c.faulty.calls[-1].events, SignalAdmitted, process_id=c.child)
    assert canonical_bytes(process_json(c.stored(), c.child)) == before


def stranger(env: Env, c: Controlled) -> tuple[Any, tuple[int, str, int]]:
    """Another tree's paused root: outside the controller's tree."""
    program = sleeper_program("conformance.stranger")
    c.runtime.catalog.add(program)
    other = c.runtime.start(program)
    assert c.runtime.wait_idle(other.tree_id).root.status == "paused"
    return other, head_fingerprint(env, other.tree_id)


def assert_not_owned(c: Controlled, target: ProcessID) -> None:
    events = c.faulty.calls[-1].events
    [receipt] = receipts_of(events, c.control_effects(events))
    assert receipt.status == "failed" and receipt.payload["child"] == target
    failure = receipt.payload["failure"]
    assert (failure["code"], failure["kind"]) == ("engine.child.control.not_owned", "contract")


def test_s31_signal_child_to_a_process_outside_the_tree_fails_not_owned(env: Env) -> None:
    """Scope 31: signal_child naming a Process outside the tree fails
    ``engine.child.control.not_owned`` (contract); the recipient (another tree) and the
    controller's own child are unchanged.
    """
    c = Controlled(env)
    other, before = stranger(env, c)
    own_child = canonical_bytes(process_json(c.stored(), c.child))
    c.send(signal_to(other.root_process_id))
    assert_not_owned(c, other.root_process_id)
    assert head_fingerprint(env, other.tree_id) == before
    assert canonical_bytes(process_json(c.stored(), c.child)) == own_child


def test_s32_cancel_child_records_parent_intent_then_the_child_ends_canceled_by_its_parent(env: Env) -> None:
    """Scope 32: cancel_child: the receipt succeeds; at the receipt the child records a
    pending cancellation owned by ``parent`` with the reason, is not terminal and its
    usage is unchanged; later it ends canceled (``parent_cancellation``).

    Adaptation: the child's termination follows in the same append (nothing is in
    flight), so "at the receipt" is the fold of the stream up to the receipt's
    position (time travel), and "later" is the rest of that append.
    """
    c = Controlled(env)
    usage = c.stored().processes[c.child].usage
    c.send(cancel_of("child"))
    stream = env.events(c.tree_id)
    [effect] = c.control_effects(stream)
    position = next(
        i for i, e in enumerate(stream, 1) if isinstance(e, EffectSettled) and e.effect_id == effect.effect_id
    )
    assert stream[position - 1].status == "succeeded"  # type: ignore[attr-defined]
    at_receipt = env.view.load(c.tree_id, None, upto=position).state.processes[c.child]
    assert at_receipt.intents == {"cancel": ("parent", "stop now")}
    assert not at_receipt.terminal and at_receipt.usage == usage
    child = c.stored().processes[c.child]
    assert child.status == "canceled" and child.termination is not None
    assert child.termination.cause == "parent_cancellation"
    assert c.runtime.result(c.tree_id, 10).output["child"] == "canceled"


def test_s33_cancel_child_of_a_process_outside_the_tree_fails_not_owned(env: Env) -> None:
    """Scope 33: cancel_child naming a Process outside the tree fails
    ``engine.child.control.not_owned``; the other tree is unchanged.
    """
    c = Controlled(env)
    other, before = stranger(env, c)
    c.send(cancel_of(other.root_process_id))
    assert_not_owned(c, other.root_process_id)
    assert head_fingerprint(env, other.tree_id) == before
    assert c.stored().processes[c.child].status == "paused"


# ===========================================================================
# I. Child control crashes


def child_control_crash(env: Env, control: dict[str, Any], mode: str) -> None:
    c = Controlled(env)
    before = head_fingerprint(env, c.tree_id)
    child_before = canonical_bytes(process_json(c.stored(), c.child))
    waiting = run_in_thread(lambda: c.handle.result(20))
    fault = c.faulty.arm(holding(SignalAdmitted, signal_id="go-1"), mode)
    delivering = run_in_thread(lambda: c.runtime.deliver_signals(c.root, [c.go_request(control)]))
    fault.wait()
    assert not delivering.returned(0.1) and not waiting.returned(0)
    stored = c.stored()
    if mode == "block_before":  # nothing of the cut is visible
        assert head_fingerprint(env, c.tree_id) == before
        assert canonical_bytes(process_json(stored, c.child)) == child_before
        assert SignalID("go-1") not in stored.root.signal_index
    else:  # the whole cut is stored: receipt, child change
        [effect] = c.control_effects(fault.events)
        assert stored.root.effect(effect.effect_id) is None  # its batch finished: the receipt was delivered
        assert canonical_bytes(process_json(stored, c.child)) != child_before
    fault.release("fail")
    expect_stopped(delivering.get)
    expect_stopped(waiting.get)

    fresh = controller_program()  # fresh objects, the same ProgramRef
    restorer = env.runtime(fresh)[0]
    restorer.recover(str(c.tree_id))
    redelivered = restorer.deliver_signals(c.root, [c.go_request(control)])
    assert redelivered is (mode == "block_before")  # the identical answer: admitted once
    restorer.wait_idle(c.tree_id)
    if control["op"] == "signal":
        cut = [*fault.events] if mode == "block_after" else env.events(c.tree_id)
        assert_signal_continuation(c, cut)
        finish_signal_continuation(c, restorer)
    else:
        child = c.stored().processes[c.child]
        assert child.termination is not None and child.termination.cause == "parent_cancellation"
        assert restorer.result(c.tree_id, 10).output["child"] == "canceled"
    # The old writer's append, re-submitted: refused, or (if it is still exactly the
    # head, a finished tree) an idempotent no-op. Either way the head does not move.
    head = head_fingerprint(env, c.tree_id)
    assert fault.call is not None
    if head[0] == fault.call.expected + len(fault.events) and mode == "block_after":
        assert fault.call.resubmit(env.view).digest == head[1]
    else:
        expect_conflict(lambda: fault.call.resubmit(env.view), "the fenced writer's child-control append")  # type: ignore[union-attr]
    assert head_fingerprint(env, c.tree_id) == head


def test_s34_signal_child_cut_before_store_leaves_the_child_unchanged_and_restore_reaches_the_same_continuation(
    env: Env,
) -> None:
    """Scope 34: the append holding a signal_child (opened by the host's answer to
    ``go``) is held and cut before it is written: meanwhile the head, the child and
    the parent's mailbox are unchanged and neither the answer nor the original's
    result returns; both then fail. A fresh runtime with fresh Program objects
    restores the tree; the host repeats its identical answer; the continuation is
    that of scenario 28. The old append, re-submitted, is refused.
    """
    child_control_crash(env, signal_to("child"), "block_before")


def test_s35_signal_child_stored_before_ack_holds_the_full_cut_and_restore_reaches_the_same_continuation(
    env: Env,
) -> None:
    """Scope 35: as 34, the append written before the store call blocks: the head holds
    the whole cut (receipt and the child's pending signal). After the restore the
    host's repeated answer is deduplicated and the continuation is that of 28; the
    old append, re-submitted after the new owner's activation, is refused.
    """
    child_control_crash(env, signal_to("child"), "block_after")


def test_s36_cancel_child_cut_before_store_leaves_the_child_unchanged_and_restore_reaches_the_same_continuation(
    env: Env,
) -> None:
    """Scope 36: as 34 with cancel_child: the cut child is unchanged; after the
    restore and the repeated answer the child ends ``parent_cancellation`` and the
    parent completes; the old append is refused.
    """
    child_control_crash(env, cancel_of("child"), "block_before")


def test_s37_cancel_child_stored_before_ack_holds_the_full_cut_and_restore_reaches_the_same_continuation(
    env: Env,
) -> None:
    """Scope 37: as 36, written before the block: the head holds the whole cut.

    Adaptation: the cut already finishes the tree (child canceled, parent completed),
    so the restore appends nothing and the old append is still exactly the head; its
    identical re-submission is an idempotent no-op, never a change of the head.
    """
    child_control_crash(env, cancel_of("child"), "block_after")


# ===========================================================================
# J. Negative checks: the scenarios reject broken stores


def test_s38_a_store_whose_load_never_finds_the_head_fails_the_effect_boundary_scenario(
    store_url: str, tmp_path: Path
) -> None:
    """Scope 38: against a store whose load never finds a tree, scenario 1 fails."""
    broken = broken_env(store_url, tmp_path, BlindLoadStore)
    try:
        with pytest.raises(AssertionError, match="found no head"):
            scenario_unknown_then_resolved(broken)
    finally:
        broken.close()


def test_s39_a_store_that_swallows_version_conflicts_fails_the_stale_duplicate_scenario(
    store_url: str, tmp_path: Path
) -> None:
    """Scope 39: against a store that reports success for conflicting appends, scenario 2 fails."""
    broken = broken_env(store_url, tmp_path, ConflictSwallowingStore)
    try:
        with pytest.raises(AssertionError, match="must refuse it with a version conflict"):
            scenario_stale_duplicates(broken)
    finally:
        broken.close()


def test_s40_a_store_without_compare_and_set_on_activation_fails_the_concurrent_restore_scenario(
    store_url: str, tmp_path: Path
) -> None:
    """Scope 40: against a store that lets a losing activation report success, scenario 5 fails."""
    broken = broken_env(store_url, tmp_path, ActivationWithoutCasStore)
    try:
        with pytest.raises(AssertionError, match="exactly one restore must win"):
            scenario_concurrent_restore(broken)
    finally:
        broken.close()


def test_probe_flags_a_store_whose_identical_retry_at_the_head_conflicts(store_url: str, tmp_path: Path) -> None:
    """The suite's global invariant is itself checked: against a store that refuses the
    identical retry of its head append, the probe records a failure for every append
    (so every scenario run on such a store would fail at teardown).
    """
    broken = broken_env(store_url, tmp_path, NonIdempotentStore)
    try:
        program = chain(broken)
        runtime, faulty = broken.runtime(program)
        assert runtime.start(program, {"n": 1}).result(10).status == "completed"
        assert len(faulty.probe_failures) == len(faulty.calls) == 2, faulty.probe_failures
    finally:
        broken.close()

"""A run asked to end is ended, and nothing below it is started again (found by a review of the
kernel's control paths against scope-kernel.md §2.5, §2.6, §3.7 and §3.8).

agentfold records a Process's terminal intent on that Process; its subtree gets its own
intents from the owner's next pass (docs/kernel-adaptations.md). Until then the stored tree
holds the ancestor's intent only, and a recovery, a replay or a resolution must read it there.
Real SQLite files and PostgreSQL databases; the crash case dies for real (tests/crash).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import FunctionDispatcher
from agentfold.adapters.eventstore import CorruptStream, EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import Rejected
from agentfold.domain.events import ControlRequested, EffectDispatched, EffectResolved, EffectSettled, TreeLimits
from agentfold.domain.program import (
    Continue,
    Descriptor,
    EffectPolicy,
    Pause,
    Program,
    Replay,
    SignalRequest,
    Step,
    dispatcher_effect,
)
from agentfold.domain.requests import Settlement
from tests.audit.support import Sql
from tests.crash import programs
from tests.crash.support import crash, events, recover, runtime_for, tree_of
from tests.kernel_programs import (
    IMPL,
    CallLog,
    JsonStrategy,
    asker_program,
    chain_program,
    config_digest,
    parent_program,
)


def calls_of(log: Path) -> list[dict[str, Any]]:
    return CallLog(log).calls()


def died_in_a_childs_call(url: str, log: Path, start_id: str) -> Any:
    """A parent whose owner died (for real) inside its child's call, a call whose policy
    allows making it again (`same_identity`): the call made once."""
    crash(url, log, "start", "--program", "parent-same", "--start-id", start_id,
          "--input", '{"child": {"n": 1}}', "--crash", "in-dispatch:1")
    assert len(calls_of(log)) == 1
    return tree_of(start_id)


def made_once_and_unknown(store: EventStore, tree_id: Any, log: Path) -> None:
    """The child's call was made once, by the process that died, and is recorded unknown."""
    assert len(calls_of(log)) == 1
    stream = events(store, tree_id)
    assert sum(isinstance(e, EffectDispatched) for e in stream) == 1
    (settled,) = [e for e in stream if isinstance(e, EffectSettled)]
    assert settled.status == "unknown"


def test_recovery_after_an_ancestors_cancel_makes_no_call_again(durable_store_url: str, tmp_path: Path) -> None:
    # The owner died inside the child's call (its policy allows making it again); a host then
    # cancelled the root. Recovery made the child's call a second time, after the cancel.
    log = tmp_path / "calls.jsonl"
    tree_id = died_in_a_childs_call(durable_store_url, log, "start:parent-same")
    with runtime_for(durable_store_url, "parent-same", log) as (store, _):
        root = store.load(tree_id).state.root
    with runtime_for(durable_store_url, "parent-same", log) as (store, _):
        # A host that does not drive runs (`agentfold cancel` where the owner is gone).
        host = Runtime(store, programs.catalog("parent-same", log), adopt_on_admit=False)
        try:
            host.cancel(root.process_id, "stop everything")
        finally:
            host.close()
    with runtime_for(durable_store_url, "parent-same", log) as (store, runtime):
        recover(runtime, tree_id)
        assert runtime.result(tree_id, timeout=30).status == "canceled"
        runtime.wait_idle(tree_id, timeout=30)
        made_once_and_unknown(store, tree_id, log)
        assert {p.status for p in store.load(tree_id).state.processes.values()} == {"canceled"}


@pytest.mark.parametrize("control", ["cancel", "kill"])
def test_a_cancel_that_takes_a_dead_owners_run_over_makes_no_call_again(
    durable_store_url: str, tmp_path: Path, control: str
) -> None:
    # The same, with a host that drives what it admits (`agentfold cancel`, serve's POST
    # /processes/{id}/cancel, Host.cancel): it took the run over first, and the takeover made
    # the child's call again before the cancel was applied. The intent is recorded first now.
    log = tmp_path / "calls.jsonl"
    tree_id = died_in_a_childs_call(durable_store_url, log, f"start:parent-same-{control}")
    with runtime_for(durable_store_url, "parent-same", log) as (store, _):
        root = store.load(tree_id).state.root
    with runtime_for(durable_store_url, "parent-same", log) as (store, runtime):
        assert getattr(runtime, control)(root.process_id, "stop everything")
        assert runtime.owns(tree_id) or runtime.drives(tree_id)  # taken over and driven here
        assert runtime.result(tree_id, timeout=30).status == ("canceled" if control == "cancel" else "killed")
        runtime.wait_idle(tree_id, timeout=30)
        made_once_and_unknown(store, tree_id, log)


def test_a_second_cancel_of_a_run_nobody_owns_carries_the_first_out(durable_store_url: str, tmp_path: Path) -> None:
    # A cancel recorded by a host that does not drive (or an owner that died before carrying it
    # out); a second `agentfold cancel` printed "already canceling ... another runtime owns this
    # tree and drives it on", exit 0, while nobody did: the run stayed `progress` for good.
    log = tmp_path / "calls.jsonl"
    tree_id = died_in_a_childs_call(durable_store_url, log, "start:parent-same-twice")
    with runtime_for(durable_store_url, "parent-same", log) as (store, runtime):
        root = store.load(tree_id).state.root
        recorder = Runtime(store, programs.catalog("parent-same", log), adopt_on_admit=False)
        try:
            assert recorder.cancel(root.process_id, "stop everything")
        finally:
            recorder.close()
        assert runtime.cancel(root.process_id, "stop everything") is False  # recorded already
        assert runtime.drives(tree_id)
        assert runtime.result(tree_id, timeout=30).status == "canceled"
        runtime.wait_idle(tree_id, timeout=30)
        assert len(calls_of(log)) == 1


def test_a_resolution_under_an_ancestors_pending_cancel_is_refused_and_appends_nothing(
    durable_store_url: str,
) -> None:
    def lost(request: Any, context: Any) -> Settlement:
        raise RuntimeError("lost the reply")

    child = chain_program(lost, replay=Replay.NEVER, name="ending.child")
    parent = parent_program(child, count=1, name="ending.parent")
    store = EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([parent])) as owner:
            handle = owner.start(parent, {"child": {"n": 1}}, start_id="ending-resolve")
            state = owner.wait_idle(handle.tree_id, timeout=30)
        (child_id,) = state.root.children
        (unknown,) = state.processes[child_id].unknown_effects()
        host = Runtime(store, Catalog([parent]), adopt_on_admit=False)
        try:
            assert host.cancel(state.root.process_id, "abandon the run")
            before = store.load(handle.tree_id).state.version
            with pytest.raises(Rejected) as refused:
                host.resolve_unknown_effect(unknown.effect_id, Settlement.succeeded({"value": 7}))
            assert refused.value.code == "engine.process.finished"
            assert f"its ancestor {state.root.process_id} is ending (cancel requested)" in refused.value.message
            with pytest.raises(Rejected) as refused:
                host.replay_unknown_effect(unknown.effect_id)
            assert refused.value.code == "engine.process.finished", refused.value  # the ending comes before the policy
            after = store.read(handle.tree_id)
            assert len(after) == before
            assert not any(isinstance(r.event, EffectResolved) for r in after)
        finally:
            host.close()
    finally:
        store.close()


def test_a_cancel_nobody_carried_out_is_progress_for_recovery_not_a_parked_run(durable_store_url: str) -> None:
    # A cancel recorded while the run waited for input (its owner then gone before acting on
    # it) left the run classified parked: `recover` and serve's orphan scan skipped it, and it
    # waited for ever with its cancel recorded.
    program = asker_program("ending.asker")
    store = EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([program])) as owner:
            handle = owner.start(program, {}, start_id="ending-parked")
            root = owner.wait_idle(handle.tree_id, timeout=30).root
        assert store.head(handle.tree_id).classification == "parked"
        host = Runtime(store, Catalog([program]), adopt_on_admit=False)
        try:
            assert host.cancel(root.process_id, "user gave up")
        finally:
            host.close()
        stream = store.read(handle.tree_id)
        assert isinstance(stream[-1].event, ControlRequested)
        assert store.head(handle.tree_id).classification == "progress"
        # As the release before this rule stored the row (its fold said parked): recovery reads
        # the fold too, and drives the run (review of the fix: the row alone kept it waiting).
        Sql(durable_store_url)._run("UPDATE agentfold_trees SET classification = 'parked' WHERE tree_id = ?",
                                    (str(handle.tree_id),))
        with Runtime(store, Catalog([program])) as recovering:
            assert [h.tree_id for h in recovering.recover()] == [handle.tree_id]  # every run needing an owner
            assert recovering.result(handle.tree_id, timeout=30).status == "canceled"
        assert store.head(handle.tree_id).classification == "terminal"
    finally:
        store.close()


def test_an_ended_run_whose_index_row_says_parked_is_not_taken_over(durable_store_url: str) -> None:
    # The index row is what recovery and the orphan scan list from; one that was behind the
    # history (edited by hand: every writer stores the row with its events) must not make a
    # runtime append a WriterActivated to a history whose every Process ended (a release
    # before 2026-12-05 did: an ended run has no writer to activate). Since an auditor's walk
    # (2026-12-05) a load refuses such a row (index.row_mismatch): the next append would have
    # rewritten it, and the evidence with it.
    program = chain_program(lambda request, context: Settlement.succeeded({"value": 1}), name="ending.chain")
    store = EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([program])) as owner:
            handle = owner.start(program, {"n": 2}, start_id="ending-row-behind")
            assert owner.result(handle.tree_id, timeout=30).status == "completed"
        before = len(store.read(handle.tree_id))
        Sql(durable_store_url)._run(
            "UPDATE agentfold_trees SET classification = 'parked', status = 'running' WHERE tree_id = ?",
            (str(handle.tree_id),),
        )
        with Runtime(store, Catalog([program])) as recovering:
            with pytest.raises(CorruptStream) as corrupt:
                recovering.recover(str(handle.tree_id))
            assert (corrupt.value.rule, corrupt.value.position) == ("index.row_mismatch", before)
            assert "the tree index's status is 'running'; the fold at position" in corrupt.value.message
            assert recovering.recover() == []  # left alone, logged
            assert recovering.recover(if_needed=True) == []
        assert len(store.read(handle.tree_id)) == before
    finally:
        store.close()


class Fan(JsonStrategy):
    """Declares three calls in one Step, then pauses."""

    def decide(self, state: Any, window: Any) -> Step:
        if state["phase"] == "start":
            return Step(0, Continue(tuple(dispatcher_effect({"i": i}) for i in range(3))), {"phase": "fanned"})
        return Step(0, Pause("look at the mailbox"), {"phase": "paused"})


def test_a_step_whose_settlements_would_overfill_the_mailbox_fails_the_process(store_url: str) -> None:
    # Each Effect reserves its settlement signal against max_pending_signals (spec 2.5 step 6):
    # a Step declaring three with room for two was accepted, and the full mailbox then refused
    # every host signal.
    program = Program(
        Descriptor("ending.fan", signal_schema={"type": "object"}), Fan(), IMPL, config_digest("ending.fan"),
        policy=lambda effect: EffectPolicy(replay=Replay.NEVER),
        dispatcher=FunctionDispatcher(lambda request, context: Settlement.succeeded({"ok": 1})),
    )
    store = EventStore(store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            for room, status in ((2, "failed"), (4, "paused")):
                handle = runtime.start(program, {}, start_id=f"fan-{room}", limits=TreeLimits(max_pending_signals=room))
                root = runtime.wait_idle(handle.tree_id, timeout=30).root
                assert root.status == status, room
                if status == "failed":
                    assert root.termination is not None and root.termination.failure is not None
                    assert root.termination.failure.code == "engine.limit.signals"
                    assert "mailbox bound of 2 pending signals" in root.termination.failure.message
                    assert not any(isinstance(e.event, EffectDispatched) for e in store.read(handle.tree_id))
                else:  # room for the three settlements and one more: a host signal fits
                    runtime.deliver_signals(root.process_id, [SignalRequest("host-1", {"x": 1})])
    finally:
        store.close()


def test_a_wait_under_a_cancel_nobody_carried_out_is_not_listed_as_pending(durable_store_url: str, tmp_path: Path) -> None:
    # `pending` (and GET /pending-inputs, the read models) listed the approval wait of a run whose
    # cancel was recorded and not carried out yet (its owner gone), while `answer` on it was
    # refused engine.process.finished "... is canceled" (found by the upgrade review).
    from agentfold.adapters.sources import default_sources
    from tests.test_cli import agentfold, ok
    from tests.test_cli_interaction import approval, run_json, write

    url = durable_store_url
    started = run_json(url, write(tmp_path, approval(None)), "--start-id", "ending-wait")
    waits = ok(agentfold("pending", "--json", store=url)).json()["pending"]
    (wait,) = waits
    store = EventStore(url)
    try:
        host = Runtime(store, default_sources().catalog(), adopt_on_admit=False)  # records, drives nothing
        try:
            assert host.cancel(started["root_process_id"], "user gave up")
        finally:
            host.close()
    finally:
        store.close()
    assert ok(agentfold("pending", "--json", store=url)).json()["pending"] == []
    ok(agentfold("project", store=url))
    assert ok(agentfold("pending", "--json", store=url)).json()["pending"] == []  # from the read models too
    refused = agentfold("--json", "answer", wait["process_id"], wait["wait_id"], '{"approved": true}', store=url)
    assert refused.code != 0 and refused.error()["code"] == "engine.process.finished", refused.stderr
    ok(agentfold("recover", store=url))  # carries the cancel out
    shown = ok(agentfold("show", started["tree_id"], "--json", store=url)).json()
    assert shown["processes"][0]["status"] == "canceled"
    ok(agentfold("project", store=url))
    assert ok(agentfold("audit", "verify", "--all", store=url)).code == 0


def test_a_canceled_runs_result_answers_before_a_child_call_under_way_settles_and_wait_idle_after(
    tmp_path: Path,
) -> None:
    """`run.result()` is the root's end (Scope's Await): a root canceled while its child's call is
    under way answers canceled at once; the child ends once that call settles, and only
    `wait_idle` waits for it (Scope's Join; docs/python.md)."""
    from tests.kernel_programs import GatedCall

    gate = GatedCall(CallLog(tmp_path / "calls.jsonl"), at=0)
    child = chain_program(gate, name="test.ending.gated")
    parent = parent_program(child, 1, name="test.ending.parent")
    with Runtime(EventStore("memory:"), Catalog([parent, child])) as runtime:
        run = runtime.start(parent, {"child": {"n": 1}}, start_id="ending-under-way")
        try:
            assert gate.entered.wait(10)
            runtime.cancel(run.root_process_id)
            assert run.result(timeout=10).status == "canceled"
            during = runtime.capture(run.tree_id)
            (kid,) = [p for p in during.processes.values() if p.process_id != run.root_process_id]
            assert kid.status == "running"
        finally:
            gate.release.set()
        after = runtime.wait_idle(run.tree_id, timeout=10)
    kid = after.processes[kid.process_id]
    assert kid.status == "canceled"
    assert [e.status for e in events(runtime.store, run.tree_id) if isinstance(e, EffectSettled)] == ["succeeded"]

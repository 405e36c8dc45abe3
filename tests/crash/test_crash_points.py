"""Crash points with real process death, then recovery by a fresh Runtime.

A worker process (``tests/crash/worker.py``) drives a tree with a ``CrashPlan`` and
dies with ``os._exit(75)`` at the chosen point. This process then recovers the tree
and checks what a user can observe: the dispatcher calls recorded in the call-log
file (written by the dispatchers of both processes, so calls of the dead process are
counted), the Effects left unknown (in the folded tree and in the store's head
index), and completion once the host resolves them.

The runtime batches a Step with its settlement and the next dispatch permission in
one append (DESIGN.md), so "after step commit" means the dispatch permission of the
Step's Effect is committed but nothing was called yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentfold.domain.errors import AgentfoldError, EngineCode
from agentfold.domain.events import (
    EffectDispatched,
    EffectResolved,
    EffectSettled,
    ProcessStarted,
    SignalAdmitted,
    WriterActivated,
)
from agentfold.domain.ids import SignalID, WaitID
from agentfold.domain.program import SignalRequest
from agentfold.domain.requests import Settlement
from tests.crash import programs
from tests.crash.support import (
    count,
    crash,
    dispatcher_effects,
    events,
    indexed_unknown,
    recover,
    runtime_for,
    tree_of,
    unknown_ids,
    worker,
)
from tests.kernel_programs import CallLog


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return tmp_path / "calls.jsonl"


def calls(log: Path) -> list[dict[str, object]]:
    return CallLog(log).calls()


# ---------------------------------------------------------------------------
# a chain of three dispatcher Effects (replay never), each worth 1 unless resolved


@dataclass(frozen=True)
class ChainCrash:
    point: str
    calls_at_crash: int
    unknown: int | None  # ordinal of the Effect recovery leaves unknown (1-based), or None
    final_calls: int
    total: int


CHAIN_CASES = [
    # The start append commits Step 1 with Effect 1's dispatch permission; nothing was called.
    ChainCrash("after:StepCommitted:1", 0, 1, 2, 12),
    # Step 2 is committed with Effect 1's settlement and Effect 2's permission.
    ChainCrash("after:StepCommitted:2", 1, 2, 2, 12),
    # Effect 1 was called, but the append recording its outcome never happened.
    ChainCrash("before:StepCommitted:2", 1, 1, 3, 12),
    # Effect 2 declared but never permitted: recovery may dispatch it (exactly once).
    ChainCrash("declared:2", 1, None, 3, 3),
    # After dispatch permission: Effect 2 was never called, and recovery does not call it.
    ChainCrash("dispatched:2", 1, 2, 2, 12),
    # Inside the dispatch: Effect 2's side effect happened, its outcome was lost.
    ChainCrash("in-dispatch:2", 2, 2, 3, 12),
    # After settlement: Effect 2 is recorded; Effect 3's permission came in the same append.
    ChainCrash("settled:2", 2, 3, 2, 12),
]


@pytest.mark.parametrize("case", CHAIN_CASES, ids=[c.point for c in CHAIN_CASES])
def test_chain_crash_recovers_without_repeating_a_call_and_completes_after_resolution(
    durable_store_url: str, log: Path, case: ChainCrash
) -> None:
    start_id = "start:chain-crash"
    tree_id = tree_of(start_id)
    crash(durable_store_url, log, "start", "--program", "chain", "--start-id", start_id,
          "--input", '{"n": 3}', "--crash", case.point)
    assert len(calls(log)) == case.calls_at_crash

    with runtime_for(durable_store_url, "chain", log) as (store, runtime):
        before = events(store, tree_id)
        assert count(before, WriterActivated) == 0
        assert store.head(tree_id).version == len(before)  # type: ignore[union-attr] # the index agrees with the stream
        assert indexed_unknown(store, tree_id) == set()  # in flight is not unknown until a new owner says so

        recover(runtime, tree_id)
        tree = runtime.wait_idle(tree_id)
        stream = events(store, tree_id)
        assert count(stream, WriterActivated) == 1
        declared = dispatcher_effects(stream)

        if case.unknown is None:
            assert unknown_ids(runtime, tree_id) == []
            result = runtime.result(tree_id, timeout=30)
        else:
            target = declared[case.unknown - 1]
            # Recovery called nothing: the lost outcome is unknown, never guessed or retried.
            assert len(calls(log)) == case.calls_at_crash
            assert unknown_ids(runtime, tree_id) == [target]
            assert indexed_unknown(store, tree_id) == {target}
            record = tree.root.effect(target)
            assert record is not None and record.diagnostic is not None
            assert record.diagnostic.code == EngineCode.DISPATCH_INTERRUPTED
            assert tree.root.status not in ("completed", "failed")
            runtime.resolve_unknown_effect(target, Settlement.succeeded({"value": 10}))
            result = runtime.result(tree_id, timeout=30)

        assert result.status == "completed"
        assert result.output == {"total": case.total, "effects": 3}
        log_lines = calls(log)
        assert len(log_lines) == case.final_calls
        # No Effect was ever called twice (replay policy never).
        assert len({line["effect_id"] for line in log_lines}) == len(log_lines)
        if case.point.startswith("in-dispatch"):
            assert log_lines[1]["effect_id"] == declared[1]  # the call that happened is the unknown one
        assert indexed_unknown(store, tree_id) == set()
        assert store.head(tree_id).status == "completed"  # type: ignore[union-attr]
        # decide ran once for every committed Step, in the dead process or after recovery; only a
        # Step computed but not committed before the crash (Step 2, before its append) ran twice.
        decided = programs.decides(log)
        again = {step for step in decided if decided.count(step) > 1}
        assert again == ({(0, 1)} if case.point == "before:StepCommitted:2" else set()), decided
        assert sorted(set(decided)) == [(0, 0), (0, 1), (1, 1), (2, 1)]  # the four Steps of a chain of three


@pytest.mark.parametrize("point", ["in-dispatch:2", "dispatched:2"])
def test_same_identity_effect_is_dispatched_again_under_its_id_after_a_crash(
    durable_store_url: str, log: Path, point: str
) -> None:
    start_id = "start:chain-same"
    tree_id = tree_of(start_id)
    crash(durable_store_url, log, "start", "--program", "chain-same", "--start-id", start_id,
          "--input", '{"n": 3}', "--crash", point)
    at_crash = calls(log)
    assert len(at_crash) == (2 if point.startswith("in-dispatch") else 1)

    with runtime_for(durable_store_url, "chain-same", log) as (store, runtime):
        recover(runtime, tree_id)
        result = runtime.result(tree_id, timeout=30)
        assert result.status == "completed"
        assert result.output == {"total": 3, "effects": 3}
        stream = events(store, tree_id)
        declared = dispatcher_effects(stream)
        second = [line for line in calls(log) if line["effect_id"] == declared[1]]
        if point.startswith("in-dispatch"):
            # Called once by the dead process and exactly once more by the new owner.
            assert len(calls(log)) == 4
            assert len(second) == 2
            assert second[0]["attempt_id"] != second[1]["attempt_id"]
        else:
            assert len(calls(log)) == 3
            assert len(second) == 1
        activation = next(e for e in stream if isinstance(e, WriterActivated))
        redispatch = [e for e in stream if isinstance(e, EffectDispatched) and e.effect_id == declared[1]]
        assert len(redispatch) == 2
        assert redispatch[1].incarnation_id == activation.incarnation_id
        assert str(redispatch[1].attempt_id) == second[-1]["attempt_id"]
        assert unknown_ids(runtime, tree_id) == []
        assert not any(isinstance(e, EffectSettled) and e.status == "unknown" for e in stream)


# ---------------------------------------------------------------------------
# signal admission: the crashing process is the one admitting the answer


def park_asker(store_url: str, log: Path, start_id: str) -> str:
    """Start ask-call in this process and leave it parked on its input wait, unowned; the wait id."""
    from tests.crash import programs

    with runtime_for(store_url, "ask-call", log) as (_store, runtime):
        handle = runtime.start(programs.build("ask-call", log), None, start_id=start_id)
        tree = runtime.wait_idle(handle.tree_id)
        assert tree.root.status == "waiting"
        assert tree.root.current_wait is not None
        return str(tree.root.current_wait)


@pytest.mark.parametrize("when", ["before", "after"])
def test_crash_during_signal_admission_admits_the_answer_exactly_once(
    durable_store_url: str, log: Path, when: str
) -> None:
    start_id = "start:ask-crash"
    tree_id = tree_of(start_id)
    wait_id = park_asker(durable_store_url, log, start_id)
    crash(durable_store_url, log, "answer", "--program", "ask-call", "--start-id", start_id,
          "--name", "ada", "--signal-id", "answer-1", "--crash", f"{when}:SignalAdmitted:1")
    assert calls(log) == []

    with runtime_for(durable_store_url, "ask-call", log) as (store, runtime):
        stream = events(store, tree_id)
        # The admitting process takes the parked tree over in the append that admits the
        # answer: a crash before it leaves nothing, not even the takeover.
        assert count(stream, WriterActivated) == (1 if when == "after" else 0)
        assert count(stream, SignalAdmitted) == (1 if when == "after" else 0)

        recover(runtime, tree_id)
        tree = runtime.wait_idle(tree_id)
        answer = [SignalRequest(SignalID("answer-1"), {"name": "ada"}, WaitID(wait_id))]
        if when == "before":
            assert tree.root.status == "waiting"
            assert unknown_ids(runtime, tree_id) == []
            # The host sends the answer again; it is admitted now and called once.
            assert runtime.deliver_signals(tree.root.process_id, answer) is True
            result = runtime.result(tree_id, timeout=30)
            assert result.output == {"hello": "ada", "value": 7}
            assert len(calls(log)) == 1
        else:
            # The answer's Step and its dispatch permission were committed; the call never happened.
            target = dispatcher_effects(events(store, tree_id))[0]
            assert unknown_ids(runtime, tree_id) == [target]
            assert indexed_unknown(store, tree_id) == {target}
            assert calls(log) == []
            # Sending the same answer again is a duplicate, not a second admission.
            assert runtime.deliver_signals(tree.root.process_id, answer) is False
            runtime.resolve_unknown_effect(target, Settlement.succeeded({"value": 10}))
            result = runtime.result(tree_id, timeout=30)
            assert result.output == {"hello": "ada", "value": 10}
            assert calls(log) == []
        assert result.status == "completed"
        stream = events(store, tree_id)
        assert count(stream, SignalAdmitted) == 1
        assert count(stream, WriterActivated) == (2 if when == "after" else 1)
        assert indexed_unknown(store, tree_id) == set()


# ---------------------------------------------------------------------------
# resolution: the crashing process is the one resolving an unknown Effect


@pytest.mark.parametrize("when", ["before", "after"])
def test_crash_during_resolution_records_the_resolution_at_most_once(
    durable_store_url: str, log: Path, when: str
) -> None:
    start_id = "start:resolve-crash"
    tree_id = tree_of(start_id)
    crash(durable_store_url, log, "start", "--program", "chain", "--start-id", start_id,
          "--input", '{"n": 2}', "--crash", "dispatched:1")
    crash(durable_store_url, log, "resolve", "--program", "chain", "--start-id", start_id,
          "--value", "10", "--crash", f"{when}:EffectResolved:1")
    assert calls(log) == []

    with runtime_for(durable_store_url, "chain", log) as (store, runtime):
        stream = events(store, tree_id)
        first = dispatcher_effects(stream)[0]
        assert count(stream, WriterActivated) == 1  # the resolving process recovered the tree first
        assert count(stream, EffectResolved) == (1 if when == "after" else 0)
        assert indexed_unknown(store, tree_id) == ({first} if when == "before" else set())

        recover(runtime, tree_id)
        runtime.wait_idle(tree_id)
        if when == "before":
            # The resolution never happened: the host resolves again, Effect 2 is called once.
            assert unknown_ids(runtime, tree_id) == [first]
            runtime.resolve_unknown_effect(first, Settlement.succeeded({"value": 10}))
            result = runtime.result(tree_id, timeout=30)
            assert result.output == {"total": 11, "effects": 2}
            assert len(calls(log)) == 1
        else:
            # The resolution was committed with Effect 2's permission; Effect 2 was never called.
            second = dispatcher_effects(events(store, tree_id))[1]
            assert unknown_ids(runtime, tree_id) == [second]
            assert indexed_unknown(store, tree_id) == {second}
            with pytest.raises(AgentfoldError) as refused:
                runtime.resolve_unknown_effect(first, Settlement.succeeded({"value": 99}))
            assert refused.value.code == "engine.effect.not_pending"
            runtime.resolve_unknown_effect(second, Settlement.succeeded({"value": 20}))
            result = runtime.result(tree_id, timeout=30)
            assert result.output == {"total": 30, "effects": 2}
            assert calls(log) == []
        assert result.status == "completed"
        stream = events(store, tree_id)
        resolved = [e.effect_id for e in stream if isinstance(e, EffectResolved)]
        assert resolved.count(first) == 1
        assert indexed_unknown(store, tree_id) == set()


# ---------------------------------------------------------------------------
# child start: a prepared parent starts two chain children in one append


@pytest.mark.parametrize("when", ["before", "after"])
def test_crash_during_child_start_starts_each_child_exactly_once(durable_store_url: str, log: Path, when: str) -> None:
    start_id = "start:child-crash"
    tree_id = tree_of(start_id)
    crash(durable_store_url, log, "start", "--program", "prep-parent", "--start-id", start_id,
          "--crash", f"{when}:ProcessStarted:1")
    # The parent's preparation call happened; the children's calls did not.
    assert [line["payload"] for line in calls(log)] == [{"prepare": True}]

    with runtime_for(durable_store_url, "prep-parent", log) as (store, runtime):
        stream = events(store, tree_id)
        assert count(stream, ProcessStarted) == (2 if when == "after" else 0)

        recover(runtime, tree_id)
        tree = runtime.wait_idle(tree_id)
        if when == "before":
            # The append that settled the preparation and started the children never happened:
            # the preparation's outcome is unknown; resolving it starts the children once.
            prepare = dispatcher_effects(events(store, tree_id))[0]
            assert unknown_ids(runtime, tree_id) == [prepare]
            assert indexed_unknown(store, tree_id) == {prepare}
            runtime.resolve_unknown_effect(prepare, Settlement.succeeded({"value": 5}))
            result = runtime.result(tree_id, timeout=30)
            assert result.output == {"prepared": 5, "children": [{"total": 1, "effects": 1}] * 2}
            assert len(calls(log)) == 3  # the preparation, then one call per child
        else:
            # The children started and were permitted to dispatch; their calls never happened.
            children = [p for p in tree.processes.values() if p.parent_id is not None]
            assert len(children) == 2
            child_unknown = [r.effect_id for c in children for r in c.unknown_effects()]
            assert len(child_unknown) == 2
            assert unknown_ids(runtime, tree_id) == child_unknown
            assert indexed_unknown(store, tree_id) == set(child_unknown)
            for effect_id in child_unknown:
                runtime.resolve_unknown_effect(effect_id, Settlement.succeeded({"value": 10}))
            result = runtime.result(tree_id, timeout=30)
            assert result.output == {"prepared": 5, "children": [{"total": 10, "effects": 1}] * 2}
            assert len(calls(log)) == 1
        assert result.status == "completed"
        stream = events(store, tree_id)
        assert count(stream, ProcessStarted) == 2
        assert len({e.process_id for e in stream if isinstance(e, ProcessStarted)}) == 2
        assert indexed_unknown(store, tree_id) == set()


def test_worker_without_crash_plan_finishes_normally(durable_store_url: str, log: Path) -> None:
    """The harness itself: without a crash point the worker completes (so exit 75 means the crash fired)."""
    done = worker(durable_store_url, log, "start", "--program", "chain", "--start-id", "start:plain", "--input", '{"n": 2}')
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"status": "completed", "output": {"total": 2, "effects": 2}}
    assert len(calls(log)) == 2

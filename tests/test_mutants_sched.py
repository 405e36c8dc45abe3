"""Mutation audit of the runtime's scheduling (call slots, timers, drain, close, waits).

Each test here failed with a deliberate bug planted in ``agentfold/adapters/runtime.py`` that
the rest of the suite let through; each asserts what a user of a Runtime observes (outcomes
stored, the count of timers waiting that ``GET /metrics`` reports, what a wait answers). In
process, over SQLite files; timers read a hand-moved clock, so no test waits for an instant.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.team import (
    FIRST_COMPLETED,
    FirstSuccessConfig,
    compile_deadline,
    compile_first_success,
)
from agentfold.domain.events import EffectSettled
from agentfold.domain.requests import EffectRequest, Settlement
from tests.interaction.support import open_runtime
from tests.interaction.tools import WAIT, wait_until
from tests.kernel_programs import chain_program
from tests.team.test_timers import ManualClock, QuickTimer  # a clock moved by hand; a 0.05 s tick
from tests.test_call_slots import one_slot_held


def at(clock: ManualClock, seconds: float) -> str:
    """The Deadline input: an instant ``seconds`` after the clock's now."""
    return (datetime.fromtimestamp(clock.now, UTC) + timedelta(seconds=seconds)).isoformat()


def settled(store: EventStore, tree_id: Any) -> list[tuple[str, Any]]:
    return [(r.event.status, r.event.payload) for r in store.read(tree_id) if isinstance(r.event, EffectSettled)]


def test_a_timer_stopped_with_its_run_is_not_counted_again_when_its_instant_passes(tmp_path: Path) -> None:
    """A canceled Deadline's timer stops at once; when its instant later passes on the clock,
    the runtime still counts the other run's timer as waiting (``timers_waiting``, GET /metrics)
    and that timer still fires at its own instant. (Mutant: the timer thread did not skip a
    stopped timer: it fired it again at its instant and the count of waiting timers fell by one
    more than the timers that fired, to 0 with a timer still waiting.)"""
    clock = ManualClock(time.time())
    deadline = compile_deadline("sched.deadline", dispatcher=QuickTimer(clock))
    with open_runtime(f"sqlite:///{tmp_path / 'timers.db'}", deadline, poll_interval=0) as runtime:
        soon = runtime.start(deadline, at(clock, 60), start_id="sched:canceled")
        later = runtime.start(deadline, at(clock, 3600), start_id="sched:later")
        wait_until(lambda: runtime.timers_waiting() == 2, "two timers to wait")
        assert runtime.cancel(soon.root_process_id, "no longer needed")
        assert soon.result(WAIT).status == "canceled"
        assert runtime.timers_waiting() == 1
        clock.now += 120  # past the canceled timer's instant, an hour before the other's
        time.sleep(0.3)  # several ticks: the timer thread looks at both instants again
        assert runtime.timers_waiting() == 1
        assert runtime.status(later.tree_id) == "running"
        assert settled(runtime.store, soon.tree_id) == [
            ("failed", {"error": "the timer was stopped before its instant (the Process is stopping)"})
        ]
        clock.now += 3600
        assert later.result(WAIT).status == "completed"
        assert runtime.timers_waiting() == 0


class SlowDue(QuickTimer):
    """A Deadline's timer whose ``due`` takes a moment once ``slow`` is set (a parse, a lookup)."""

    slow = False

    def due(self, request: EffectRequest) -> float | Settlement:
        if self.slow:
            time.sleep(0.3)
        return super().due(request)


def test_overdue_timers_of_a_run_canceled_while_nobody_drove_it_are_stopped_not_fired(tmp_path: Path) -> None:
    """docs/team.md, Deadline, "Cancellation": a race of two Deadlines left waiting (its runtime
    closed), whose instants passed while nobody drove it, then canceled by a command: each timer
    settles failed as stopped, never as fired, and nothing is unknown. (Mutant: the takeover
    armed the timers of Processes already stopping; overdue, the first fired while the owner
    line was still starting the second, before the cancel reached it.)"""
    clock = ManualClock(time.time())
    timer = SlowDue(clock)
    deadline = compile_deadline("sched.deadline", dispatcher=timer)
    race = compile_first_success(FirstSuccessConfig(name="sched.race", candidates=[deadline],
                                                    accept=FIRST_COMPLETED, max_candidates=2))
    url = f"sqlite:///{tmp_path / 'overdue.db'}"
    with open_runtime(url, race, deadline) as runtime:
        handle = runtime.start(race, [
            {"key": "one", "program": "sched.deadline", "input": at(clock, 60)},
            {"key": "two", "program": "sched.deadline", "input": at(clock, 90)},
        ], start_id="sched:overdue")
        wait_until(lambda: runtime.timers_waiting() == 2, "the timers to wait")
    clock.now += 120  # their instants passed while nobody drove the run
    timer.slow = True
    with open_runtime(url, race, deadline, poll_interval=0) as command:  # as `agentfold cancel`
        assert command.cancel(handle.root_process_id, "no longer needed")
        assert command.result(handle.tree_id, WAIT).status == "canceled"
        # The race ends canceled once its candidates do; their timers' outcomes follow.
        wait_until(lambda: len(settled(command.store, handle.tree_id)) == 2, "both timers' outcomes")
        stopped = ("failed", {"error": "the timer was stopped before its instant (the Process is stopping)"})
        assert settled(command.store, handle.tree_id) == [stopped, stopped]
        assert command.capture(handle.tree_id).root.unknown_effects() == []


def test_wait_idle_does_not_answer_a_run_waiting_for_a_call_slot_as_idle(tmp_path: Path) -> None:
    """A run whose Effect waits for a call slot (every ``dispatch_workers`` slot is busy) has
    work to do: ``wait_idle`` waits for it (and times out while the slot stays busy) instead of
    answering a state with the Effect declared and never called. (Mutant: a line waiting for a
    slot counted as idle: wait_idle answered at once, and a command such as `agentfold start
    --wait` printed the run as if it had nothing left to do.)"""
    with one_slot_held(tmp_path, "idle") as (calls, program, _store, runtime, holder):
        waiter = runtime.start(program, {"n": 1}, start_id="idle-waiter")
        assert runtime.runs_waiting_for_calls() == 1
        with pytest.raises(TimeoutError):
            runtime.wait_idle(waiter.tree_id, 0.3)
        calls.release.set()
        assert runtime.wait_idle(waiter.tree_id, WAIT).classification() == "terminal"
        assert waiter.result(WAIT).status == "completed" and holder.result(WAIT).status == "completed"


def test_a_permission_committed_while_close_waits_for_its_append_is_not_called(tmp_path: Path) -> None:
    """``close`` waits for an owner line inside an append; a dispatch permission that append
    commits after close began is left to the next owner (replay or unknown), never called by a
    runtime that will not record its outcome. (Mutant: the line launched it, and the call was
    made after close began, its outcome never recorded.)"""
    db = tmp_path / "closing.db"
    calls: list[int] = []
    first_returns = threading.Event()
    blocker: list[sqlite3.Connection] = []

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        calls.append(request.payload["index"])
        if len(calls) == 1:
            # The store is locked before this call returns: the append of its outcome (with the
            # next call's permission) waits for the lock.
            lock = sqlite3.connect(db, check_same_thread=False)
            lock.execute("BEGIN EXCLUSIVE")
            blocker.append(lock)
            first_returns.set()
        return Settlement.succeeded({"value": 1})

    program = chain_program(call, name="sched.closing")
    store = EventStore(f"sqlite:///{db}")
    runtime = Runtime(store, Catalog([program]), poll_interval=0)
    try:
        handle = runtime.start(program, {"n": 2}, start_id="sched:closing")
        assert first_returns.wait(WAIT)
        time.sleep(0.2)  # the owner line is inside its append, waiting for the lock
        closing = threading.Thread(target=runtime.close, kwargs={"timeout": WAIT})
        closing.start()
        time.sleep(0.2)  # close has begun and waits for the append
        blocker[0].rollback()
        blocker[0].close()
        closing.join(WAIT)
        assert not closing.is_alive()
        time.sleep(0.3)  # a call launched after close began would have been made by now
        assert calls == [0]
        kinds = [type(r.event).__name__ for r in store.read(handle.tree_id)]
        # Two permissions when the append began before close (the case this test is after; a
        # machine too slow to get there in 0.2 s leaves one, and nothing to call either way).
        assert kinds.count("EffectSettled") == 1 and kinds.count("EffectDispatched") in (1, 2), kinds
    finally:
        runtime.close()
        store.close()

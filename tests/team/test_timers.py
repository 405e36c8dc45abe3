"""Timers wait on the runtime's timer thread, not in a call slot (docs/team.md, Deadline).

A Deadline's timer is a :class:`~agentfold.adapters.dispatch.TimerDispatcher`: the runtime asks
it for its instant and waits for every timer on one thread of its own. Before, a timer was a
dispatcher call that held one of ``Runtime(dispatch_workers=N)``'s call slots and a thread for
its whole wait: N waiting timers froze every other call of the runtime, a race's worker could
not start before its timeout won, and a timer due soon fired only after another one freed a
slot. Each test here runs with ``dispatch_workers=1`` and fails on that behaviour (a result that
never comes within ``WAIT``, or the wrong winner). Real stores: memory, SQLite, PostgreSQL.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from agentfold.adapters.dispatch import TimerDispatcher
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.team import (
    FIRST_COMPLETED,
    DeadlineDispatcher,
    FirstSuccessConfig,
    TransformConfig,
    compile_deadline,
    compile_first_success,
    transform,
)
from agentfold.domain.events import EffectDispatched, EffectSettled
from agentfold.domain.program import Descriptor, EffectPolicy, Program, Replay
from agentfold.domain.requests import EffectRequest, Settlement
from tests.interaction.support import open_runtime, recover
from tests.interaction.tools import WAIT, wait_until
from tests.kernel_programs import IMPL, Chain, config_digest


def soon(seconds: float, base: float | None = None) -> str:
    moment = datetime.fromtimestamp(base, UTC) if base is not None else datetime.now(UTC)
    return (moment + timedelta(seconds=seconds)).isoformat()


def stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def echo_fn(text: Any) -> Any:
    return f"echo: {text}"


def echo() -> Any:
    return transform(TransformConfig(name="test.echo", fn=echo_fn, identity="test.echo/1"))


def settled(store: EventStore, tree_id: Any) -> list[Any]:
    return [r for r in store.read(tree_id) if isinstance(r.event, EffectSettled)]


def wait_timers(runtime: Any, count: int) -> None:
    wait_until(lambda: runtime.timers_waiting() == count, f"{count} timer(s) to wait")


# ---------------------------------------------------------------------------
# Waiting timers hold no call slot


def test_waiting_timers_leave_the_only_call_slot_to_other_runs(store_url: str) -> None:
    """Three Deadlines wait with one call slot: an unrelated one-call run completes at once;
    the timers are no calls in flight; cancelled, each ends canceled at once, none unknown."""
    deadline, worker = compile_deadline("test.deadline"), echo()
    with open_runtime(store_url, deadline, worker, dispatch_workers=1) as runtime:
        timers = [runtime.start(deadline, soon(600), start_id=f"timer:{i}") for i in range(3)]
        wait_timers(runtime, 3)
        assert runtime.dispatches_running() == 0 and runtime.runs_waiting_for_calls() == 0
        result = runtime.start(worker, "hello").result(WAIT)
        assert (result.status, result.output) == ("completed", "echo: hello")
        assert [runtime.status(t.tree_id) for t in timers] == ["running"] * 3
        begun = time.monotonic()
        for handle in timers:
            assert runtime.cancel(handle.root_process_id, "no longer needed")
        assert [t.result(WAIT).status for t in timers] == ["canceled"] * 3
        assert time.monotonic() - begun < 5  # no cancellation grace: a timer stops at once
        assert runtime.timers_waiting() == 0
        for handle in timers:
            assert runtime.capture(handle.tree_id).root.unknown_effects() == []
            assert [r.event.status for r in settled(runtime.store, handle.tree_id)] == ["failed"]


def test_a_race_worker_wins_over_its_timeout_while_another_timer_waits(store_url: str) -> None:
    """One call slot, a Deadline of another run waiting for ten minutes: a race between an
    echo and a 5 s Deadline is won by the echo (with a slot held by the waiting timer, the echo
    could not be called before the race's own timeout won)."""
    deadline, worker = compile_deadline("test.deadline"), echo()
    race = compile_first_success(FirstSuccessConfig(name="test.race", candidates=[worker, deadline],
                                                    accept=FIRST_COMPLETED, max_candidates=2))
    with open_runtime(store_url, race, deadline, worker, dispatch_workers=1) as runtime:
        other = runtime.start(deadline, soon(600), start_id="timer:other")
        wait_timers(runtime, 1)
        result = runtime.start(race, [
            {"key": "work", "program": "test.echo", "input": "fast"},
            {"key": "timeout", "program": "test.deadline", "input": soon(5)},
        ]).result(WAIT)
        assert result.status == "completed" and result.output["winner"] == 0, result.output
        assert result.output["candidates"][0]["outcome"]["result"]["output"] == "echo: fast"
        wait_timers(runtime, 1)  # the race's timer was stopped with its candidate; the other waits on
        assert runtime.status(other.tree_id) == "running"


def test_a_timer_due_soon_fires_on_time_behind_many_waiting_ones(store_url: str) -> None:
    """Twenty timers wait for ten minutes; two more, due in 1.6 s and 0.8 s (started in that
    order), each fire at their instant, the later-started one first."""
    deadline = compile_deadline("test.deadline")
    with open_runtime(store_url, deadline, dispatch_workers=1) as runtime:
        for i in range(20):
            runtime.start(deadline, soon(600), start_id=f"timer:far:{i}")
        wait_timers(runtime, 20)
        late, early = soon(1.6), soon(0.8)
        second = runtime.start(deadline, late, start_id="timer:late")
        first = runtime.start(deadline, early, start_id="timer:early")
        assert first.result(WAIT).status == "completed"
        assert runtime.status(second.tree_id) == "running"  # not before its instant
        assert second.result(WAIT).status == "completed"
        for handle, instant in ((first, early), (second, late)):
            [record] = settled(runtime.store, handle.tree_id)
            assert record.event.status == "succeeded"
            fired = stamp(record.timestamp) - stamp(instant)
            assert 0 <= fired < 2.0, f"fired {fired:+.3f} s from its instant"
        assert runtime.timers_waiting() == 20


# ---------------------------------------------------------------------------
# The clock, and what a timer cannot tell


class ManualClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class QuickTimer(DeadlineDispatcher):
    TICK_SECONDS = 0.05


def test_a_clock_set_forward_is_followed_while_the_timer_waits(store_url: str) -> None:
    """The timer's clock is read again at least every tick: an instant a day away is reached
    by setting the clock forward, and not before."""
    clock = ManualClock(time.time())
    deadline = compile_deadline("test.deadline", dispatcher=QuickTimer(clock))
    with open_runtime(store_url, deadline) as runtime:
        handle = runtime.start(deadline, soon(86_400, clock.now))
        wait_timers(runtime, 1)
        clock.now += 86_399
        time.sleep(0.3)  # several ticks: still a second before its instant
        assert runtime.status(handle.tree_id) == "running"
        clock.now += 1.5  # past it (the text of the instant is rounded to the microsecond)
        assert handle.result(WAIT).status == "completed"
        assert runtime.timers_waiting() == 0


class BrokenTimer(TimerDispatcher):
    """``due`` raising, returning something that is no instant, a clock that fails, ``fired``
    raising what is no Exception, or a tick of 0 (which would spin)."""

    TICK_SECONDS = 0.05

    def __init__(self, how: str) -> None:
        super().__init__(self._clock)
        self.how = how
        self.broken = threading.Event()
        if how == "tick":
            self.TICK_SECONDS = 0

    def _clock(self) -> float:
        if self.broken.is_set():
            raise OSError("the clock is gone")
        return time.time()

    def due(self, request: EffectRequest) -> float | Settlement:
        if self.how == "raises":
            raise RuntimeError("no instant")
        if self.how == "garbage":
            return "tomorrow"  # type: ignore[return-value]
        if self.how == "fired":
            return time.time() + 0.2
        return time.time() + 600

    def fired(self, request: EffectRequest) -> Settlement:
        if self.how == "fired":
            raise asyncio.CancelledError("the loop went away")
        return super().fired(request)


@pytest.mark.parametrize(("how", "says"), [
    ("raises", "RuntimeError: no instant"),
    ("garbage", "not a finite number of seconds"),
    ("clock", "the timer's clock failed: OSError: the clock is gone"),
    ("fired", "CancelledError: the loop went away"),
    ("tick", "BrokenTimer.TICK_SECONDS is 0, not a number of seconds above 0"),
])
def test_a_timer_that_cannot_tell_its_outcome_leaves_it_unknown(store_url: str, how: str, says: str) -> None:
    """And the timer thread goes on: a plain Deadline started afterwards fires."""
    timer = BrokenTimer(how)
    deadline = compile_deadline("test.deadline", dispatcher=timer)  # type: ignore[arg-type]
    plain = compile_deadline("test.plain")
    with open_runtime(store_url, deadline, plain) as runtime:
        handle = runtime.start(deadline, soon(600))
        if how == "clock":
            wait_timers(runtime, 1)
            timer.broken.set()
        wait_until(lambda: runtime.capture(handle.tree_id).root.unknown_effects() != [], "the timer to be unknown")
        [effect] = runtime.capture(handle.tree_id).root.unknown_effects()
        assert effect.diagnostic is not None and effect.diagnostic.code == "engine.dispatch.failed"
        assert says in effect.diagnostic.message
        assert runtime.timers_waiting() == 0
        assert runtime.status(handle.tree_id) == "running"  # waiting for a host to resolve it
        assert runtime.start(plain, soon(0.2)).result(WAIT).status == "completed"


RELEASE = threading.Event()


def slow_fn(text: Any) -> Any:
    RELEASE.wait(WAIT)
    return f"slow: {text}"


def test_a_deadline_starts_and_fires_while_every_call_slot_is_busy(store_url: str) -> None:
    """One call slot, taken by a slow call: a Deadline is still dispatched at once (its
    permission needs no slot) and fires at its instant while the slow call runs on."""
    deadline = compile_deadline("test.deadline")
    slow = transform(TransformConfig(name="test.slow", fn=slow_fn, identity="test.slow/1"))
    RELEASE.clear()
    try:
        with open_runtime(store_url, deadline, slow, dispatch_workers=1) as runtime:
            busy = runtime.start(slow, "work")
            wait_until(lambda: runtime.dispatches_running() == 1, "the slow call to run")
            instant = soon(1.0)
            handle = runtime.start(deadline, instant)
            assert handle.result(WAIT).status == "completed"
            [record] = settled(runtime.store, handle.tree_id)
            assert 0 <= stamp(record.timestamp) - stamp(instant) < 2.0
            assert runtime.status(busy.tree_id) == "running" and runtime.runs_waiting_for_calls() == 0
            RELEASE.set()
            assert busy.result(WAIT).output == "slow: work"
    finally:
        RELEASE.set()


# ---------------------------------------------------------------------------
# A runtime that closes while its timer waits


def test_a_timer_left_waiting_by_a_closed_runtime_is_waited_for_again_by_the_next(store_url: str) -> None:
    """Closing abandons the waiting timer without recording anything; the next owner waits
    for the original instant under the same Effect id (same_identity), never unknown."""
    deadline = compile_deadline("test.deadline")
    store = EventStore(store_url)
    try:
        instant = soon(1.5)
        with open_runtime(store, deadline) as runtime:
            handle = runtime.start(deadline, instant, start_id="timer:closed")
            wait_timers(runtime, 1)
        assert settled(store, handle.tree_id) == []
        with open_runtime(store, deadline) as runtime:
            recover(runtime, handle.tree_id)
            assert runtime.result(handle.tree_id, WAIT).status == "completed"
            assert runtime.capture(handle.tree_id).root.unknown_effects() == []
        [record] = settled(store, handle.tree_id)
        assert record.event.status == "succeeded" and stamp(record.timestamp) >= stamp(instant)
        dispatched = [r.event for r in store.read(handle.tree_id) if isinstance(r.event, EffectDispatched)]
        assert len(dispatched) == 2 and dispatched[0].effect_id == dispatched[1].effect_id == record.event.effect_id
    finally:
        store.close()


def test_a_paused_deadline_taken_over_by_a_new_owner_fires_while_paused_and_completes_when_resumed(
    store_url: str,
) -> None:
    """A pause does not stop a timer in flight; neither does an owner change while paused: the
    new owner waits for the same instant (same_identity), the outcome is recorded while the
    Deadline is paused, and it completes on resume. Before, the new owner recorded the timer
    unknown (a paused Process was given no dispatch at recovery)."""
    deadline = compile_deadline("test.deadline")
    store = EventStore(store_url)
    try:
        instant = soon(6.0)  # time to start, pause and close first, even on a loaded machine
        with open_runtime(store, deadline) as runtime:
            handle = runtime.start(deadline, instant, start_id="timer:paused")
            wait_timers(runtime, 1)
            runtime.pause(handle.root_process_id)
            assert runtime.capture(handle.tree_id).root.status == "paused"
        assert settled(store, handle.tree_id) == []  # closed while the timer waited
        with open_runtime(store, deadline) as runtime:
            recover(runtime, handle.tree_id)
            wait_until(lambda: len(settled(store, handle.tree_id)) == 1, "the timer to fire while paused")
            tree = runtime.wait_idle(handle.tree_id)
            assert tree.root.status == "paused" and tree.root.unknown_effects() == []
            runtime.resume(handle.root_process_id)
            assert runtime.result(handle.tree_id, WAIT).status == "completed"
        [record] = settled(store, handle.tree_id)
        assert record.event.status == "succeeded" and stamp(record.timestamp) >= stamp(instant)
    finally:
        store.close()


# ---------------------------------------------------------------------------
# Owners that stop waiting (Runtime.drain, wait_idle(past_timers=True)): a timer due after
# their time cannot return meanwhile and is not waited for; one due within it is.


class InTimer(TimerDispatcher):
    """Due ``seconds`` after its dispatch."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def due(self, request: EffectRequest) -> float:
        return self.clock() + self.seconds


def timer_chain(seconds: float, replay: Replay) -> Program:
    """One Effect, a timer due ``seconds`` after its dispatch, with replay policy ``replay``."""
    name = f"test.timer_chain.{replay.value}"
    return Program(Descriptor(name, input_schema={"type": "object"}), Chain(), IMPL, config_digest(name),
                   policy=lambda effect: EffectPolicy(replay=replay), dispatcher=InTimer(seconds))


@pytest.mark.parametrize("replay", [Replay.NEVER, Replay.SAME_IDENTITY])
def test_drain_leaves_a_far_timer_the_next_owner_makes_again_and_records_one_due_within_it(
    store_url: str, replay: Replay,
) -> None:
    """A far timer with replay policy never is waited for as any call: abandoned, it is unknown."""
    grace = 30.0 if replay == Replay.SAME_IDENTITY else 1.0
    far = timer_chain(3600, replay)
    with open_runtime(store_url, far) as runtime:
        runtime.start(far, {"n": 1})
        wait_timers(runtime, 1)
        began = time.monotonic()
        assert runtime.drain(grace) is (replay == Replay.SAME_IDENTITY)
        if replay == Replay.SAME_IDENTITY:
            assert time.monotonic() - began < grace / 3, "drain waited for a timer an hour away"
        grace = 30.0
    near = timer_chain(3.0, replay)
    with open_runtime(store_url, near) as runtime:
        handle = runtime.start(near, {"n": 1}, start_id="near")
        wait_timers(runtime, 1)
        assert runtime.drain(grace) is True
        [outcome] = settled(runtime.store, handle.tree_id)
        assert outcome.event.status == "succeeded"


def test_wait_idle_past_timers_returns_only_for_far_timers_the_next_owner_makes_again(store_url: str) -> None:
    replayed = timer_chain(3600, Replay.SAME_IDENTITY)
    once = timer_chain(3600, Replay.NEVER)
    with open_runtime(store_url, replayed, once) as runtime:
        handle = runtime.start(replayed, {"n": 1})
        other = runtime.start(once, {"n": 1})
        wait_timers(runtime, 2)
        with pytest.raises(TimeoutError):
            runtime.wait_idle(handle.tree_id, 0.3)
        began = time.monotonic()
        tree = runtime.wait_idle(handle.tree_id, 30, past_timers=True)
        assert time.monotonic() - began < 10
        assert tree.classification() == "progress" and tree.root.status == "running"
        [(effect_id, left)] = runtime.waiting_timers(handle.tree_id)
        assert [r.effect_id for p in tree.live.values() for r in p.in_flight()] == [effect_id]
        assert 3000 < left <= 3600
        # Abandoned, a timer with replay policy never would be recorded unknown: still busy.
        with pytest.raises(TimeoutError):
            runtime.wait_idle(other.tree_id, 0.5, past_timers=True)
        assert runtime.status(handle.tree_id) == "running"


# ---------------------------------------------------------------------------
# Runtime.stored_far_timers: whether a stored run (nobody drives it) has nothing to do but wait
# for timers due after a time (`agentfold recover` leaves it as it is, appending nothing)


def test_stored_far_timers_lists_a_run_left_only_waiting_for_far_timers_and_appends_nothing(store_url: str) -> None:
    deadline = compile_deadline("test.deadline")
    once = timer_chain(3600, Replay.NEVER)
    store = EventStore(store_url)
    try:
        with open_runtime(store, deadline, once) as runtime:
            handle = runtime.start(deadline, soon(3600), start_id="timer:far")
            paused = runtime.start(deadline, soon(3600), start_id="timer:far-paused")
            never = runtime.start(once, {"n": 1}, start_id="timer:never")
            wait_timers(runtime, 3)
            runtime.pause(paused.root_process_id)
        versions = {h.tree_id: h.version for h in store.heads()}
        with open_runtime(store, deadline, once) as runtime:
            [(effect_id, left)] = runtime.stored_far_timers(handle.tree_id, 60.0)  # type: ignore[misc]
            [dispatched] = [r.event for r in store.read(handle.tree_id) if isinstance(r.event, EffectDispatched)]
            assert effect_id == dispatched.effect_id and 3000 < left <= 3600
            # A paused run's timer goes on waiting too (a pause does not stop it).
            [(paused_effect, _)] = runtime.stored_far_timers(paused.tree_id, 60.0)  # type: ignore[misc]
            assert runtime.capture(paused.tree_id).root.status == "paused"
            # Due within the time: taken over and waited for. Replay policy never: the next owner
            # records it unknown, so it is taken over.
            assert runtime.stored_far_timers(handle.tree_id, 7200.0) is None
            assert runtime.stored_far_timers(never.tree_id, 60.0) is None
            assert {h.tree_id: h.version for h in store.heads()} == versions  # nothing appended
            assert not runtime.owns(handle.tree_id)
            # A run this runtime (or another) drives is not listed: its owner fires the timer.
            recover(runtime, handle.tree_id)
            assert runtime.stored_far_timers(handle.tree_id, 60.0) is None
            with open_runtime(store, deadline, once) as other:
                assert other.stored_far_timers(handle.tree_id, 60.0) is None
                assert other.stored_far_timers(paused.tree_id, 60.0) == [(paused_effect, pytest.approx(3600, abs=120))]
    finally:
        store.close()


def test_stored_far_timers_takes_a_run_over_when_another_process_has_a_call_to_start(store_url: str) -> None:
    """A race between a Deadline an hour away and an echo whose call waits for the only call slot
    (a slow call of another run holds it): left by its owner, the echo's Effect is declared and
    not started. The next owner starts it, so the run is taken over, far timer or not."""
    deadline, worker = compile_deadline("test.deadline"), echo()
    slow = transform(TransformConfig(name="test.slow", fn=slow_fn, identity="test.slow/1"))
    race = compile_first_success(FirstSuccessConfig(name="test.race", candidates=[worker, deadline],
                                                    accept=FIRST_COMPLETED, max_candidates=2))
    store = EventStore(store_url)
    RELEASE.clear()
    try:
        with open_runtime(store, race, deadline, worker, slow, dispatch_workers=1) as runtime:
            runtime.start(slow, "work")
            wait_until(lambda: runtime.dispatches_running() == 1, "the slow call to run")
            handle = runtime.start(race, [
                {"key": "work", "program": "test.echo", "input": "late"},
                {"key": "timeout", "program": "test.deadline", "input": soon(3600)},
            ])
            wait_timers(runtime, 1)
            wait_until(lambda: runtime.runs_waiting_for_calls() == 1, "the echo to wait for a call slot")
        RELEASE.set()
        tree = store.load(handle.tree_id).state
        planned = [r for p in tree.live.values() for r in p.batch if r.phase == "planned"]
        assert len(planned) == 1 and [len(p.in_flight()) for p in tree.live.values()].count(1) == 1
        with open_runtime(store, race, deadline, worker, slow) as runtime:
            assert runtime.stored_far_timers(handle.tree_id, 60.0) is None
            recover(runtime, handle.tree_id)
            result = runtime.result(handle.tree_id, WAIT)
            assert result.status == "completed" and result.output["winner"] == 0, result.output
    finally:
        RELEASE.set()
        store.close()


class BlockingTimer(DeadlineDispatcher):
    """A Deadline's timer whose ``dispatch`` is its own: called as an ordinary dispatcher."""

    def dispatch(self, request: EffectRequest, context: Any) -> Settlement:
        return super().dispatch(request, context)


def test_stored_far_timers_takes_a_run_over_for_a_recorded_cancel_or_a_timer_it_calls(store_url: str) -> None:
    """A cancel recorded by a writer that did not drive it (adopt_on_admit=False) is a terminal
    intent the next owner acts on; a TimerDispatcher whose ``dispatch`` is overridden is a call
    like any other (the next owner makes it again; nothing tells when it returns)."""
    deadline = compile_deadline("test.deadline")
    own = compile_deadline("test.own_timer", dispatcher=BlockingTimer())
    store = EventStore(store_url)
    try:
        with open_runtime(store, deadline, own) as runtime:
            canceled = runtime.start(deadline, soon(3600), start_id="timer:canceled")
            called = runtime.start(own, soon(3600), start_id="timer:own")
            wait_timers(runtime, 1)
            wait_until(lambda: runtime.dispatches_running() == 1, "the overridden timer to be called")
        with open_runtime(store, deadline, own, adopt_on_admit=False) as writer:
            writer.cancel(canceled.root_process_id, "no longer needed")
            assert not writer.owns(canceled.tree_id)
        with open_runtime(store, deadline, own) as runtime:
            assert runtime.stored_far_timers(canceled.tree_id, 60.0) is None
            assert runtime.stored_far_timers(called.tree_id, 60.0) is None
            recover(runtime, canceled.tree_id)
            assert runtime.result(canceled.tree_id, WAIT).status == "canceled"
    finally:
        store.close()


def orphaned(store: EventStore, deadline: Program, start_id: str, seconds: float = 3600) -> Any:
    """A Deadline ``seconds`` away started by a runtime that closed while its timer waited
    (nothing recorded for the timer: the run is left for the next owner); its handle."""
    with open_runtime(store, deadline) as runtime:
        handle = runtime.start(deadline, soon(seconds), start_id=start_id)
        wait_timers(runtime, 1)
    return handle


def test_stored_far_timers_answers_none_when_input_was_recorded_while_it_looked(store_url: str) -> None:
    """Its look holds the owner lease: a writer recording input meanwhile cannot take the run
    and records the input without driving it. The run must then be taken over (it was left
    with the input recorded and nobody acting on it)."""
    deadline = compile_deadline("test.deadline")
    store = EventStore(store_url)
    try:
        handle = orphaned(store, deadline, "timer:raced")
        with open_runtime(store, deadline) as prober, open_runtime(store, deadline) as writer:
            load = prober._load
            admitted: list[bool] = []

            def load_then_cancel(tree_id: Any) -> Any:
                loaded = load(tree_id)
                admitted.append(writer.cancel(handle.root_process_id, "while the prober looked"))
                assert not writer.owns(handle.tree_id)  # the lease was held: recorded, not driven
                return loaded

            prober._load = load_then_cancel  # type: ignore[method-assign]
            assert prober.stored_far_timers(handle.tree_id, 60.0) is None
            assert admitted == [True]
            prober._load = load  # type: ignore[method-assign]
            recover(prober, handle.tree_id)
            assert prober.result(handle.tree_id, WAIT).status == "canceled"
    finally:
        store.close()


def test_stored_far_timers_never_gives_back_a_lease_its_runtime_holds(store_url: str) -> None:
    """This runtime may hold a tree's lease with no owner line yet (the orphan scan between its
    look and its adoption, a release under way): the look must not take that lease from it."""
    deadline = compile_deadline("test.deadline")
    store = EventStore(store_url)
    try:
        handle = orphaned(store, deadline, "timer:held")
        with open_runtime(store, deadline) as runtime, open_runtime(store, deadline) as other:
            assert runtime._leases.acquire(handle.tree_id)
            assert runtime.stored_far_timers(handle.tree_id, 60.0) is None
            assert runtime._leases.holds(handle.tree_id)
            assert other.stored_far_timers(handle.tree_id, 60.0) is None  # owned: not free to look at
            runtime._leases.release(handle.tree_id)
            assert other.stored_far_timers(handle.tree_id, 60.0) is not None
    finally:
        store.close()



class StoppedSays(DeadlineDispatcher):
    """A timer whose ``stopped`` gives its own outcome."""

    def stopped(self, request: EffectRequest) -> Settlement:
        return Settlement.failed({"error": "custom stop"})


def test_a_deadline_canceled_by_a_command_while_nobody_drives_it_stops_its_timer_failed_never_unknown(
    store_url: str,
) -> None:
    """docs/team.md, Deadline, "Cancellation": a canceled Deadline's timer settles failed, with no
    unknown Effect. Found by a docs walkthrough: a run left waiting for a far timer (a command
    returned, its runtime closed) and then canceled by another command recorded the timer
    unknown (engine.dispatch.interrupted: the cancel was recorded first, and the takeover found
    the timer in flight for a Process already ending), which no host could resolve. Waiting for
    an instant has no outside effect: the command takes the run over first, and the timer
    settles as its ``stopped`` says. A timer whose ``dispatch`` is its own is an ordinary call:
    the cancel is recorded first as before, its call is not made again, and it is unknown."""
    deadline = compile_deadline("test.deadline")
    custom = compile_deadline("test.custom_stop", dispatcher=StoppedSays())
    own = compile_deadline("test.own_timer", dispatcher=BlockingTimer())
    programs = (deadline, custom, own)
    store = EventStore(store_url)
    try:
        with open_runtime(store, *programs) as runtime:
            handles = [runtime.start(p, soon(3600), start_id=f"timer:{p.descriptor.name}") for p in programs]
            wait_timers(runtime, 2)
            wait_until(lambda: runtime.dispatches_running() == 1, "the overridden timer to be called")
        with open_runtime(store, *programs, poll_interval=0) as command:  # as `agentfold cancel`
            assert all(command.cancel(h.root_process_id, "no longer needed") for h in handles)
            results = [command.result(h.tree_id, WAIT) for h in handles]
            unknown = [command.capture(h.tree_id).root.unknown_effects() for h in handles]
        assert [r.status for r in results] == ["canceled"] * 3
        outcomes = [[(r.event.status, r.event.payload, r.event.diagnostic) for r in settled(store, h.tree_id)]
                    for h in handles]
        assert outcomes[0] == [("failed", {"error": "the timer was stopped before its instant (the Process is stopping)"},
                                None)]
        assert outcomes[1] == [("failed", {"error": "custom stop"}, None)]
        [(status, _, diagnostic)] = outcomes[2]
        assert (status, diagnostic.code) == ("unknown", "engine.dispatch.interrupted")
        assert [len(u) for u in unknown] == [0, 0, 1]
        own_calls = [r.event for r in store.read(handles[2].tree_id) if isinstance(r.event, EffectDispatched)]
        assert len(own_calls) == 1  # recorded first: the ordinary call was not made again
    finally:
        store.close()


def test_a_run_whose_last_call_was_a_timer_is_not_kept_by_the_timer_thread_once_finished(tmp_path: Any) -> None:
    """The timer thread kept the last timer it looked at (its owner line, its tree, its Programs)
    in a local variable while it waited for the next: a long-lived server held a finished run in
    memory until another timer fired, which might be never."""
    import gc

    from agentfold.adapters.runtime import _Driver

    quick = timer_chain(0.05, Replay.NEVER)
    with open_runtime(f"sqlite:///{tmp_path / 'timers.db'}", quick) as runtime:
        handle = runtime.start(quick, {"n": 1}, start_id="quick")
        assert runtime.result(handle.tree_id, WAIT).status == "completed"

        def lines_of_the_run() -> int:
            gc.collect()
            return sum(1 for o in gc.get_objects() if isinstance(o, _Driver) and o.tree_id == handle.tree_id)

        deadline = time.monotonic() + 5
        while lines_of_the_run() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lines_of_the_run() == 0


def test_a_timer_counts_once_among_the_settled_calls_when_it_fires(tmp_path: Any) -> None:
    """docs/http-api.md (``agentfold_calls_settled_total``): a timer counts once when it settles,
    as any dispatcher call; it fires here, so ``succeeded``."""
    quick = timer_chain(0.05, Replay.NEVER)
    with open_runtime(f"sqlite:///{tmp_path / 'counted.db'}", quick) as runtime:
        handle = runtime.start(quick, {"n": 1}, start_id="counted")
        assert runtime.result(handle.tree_id, WAIT).status == "completed"
        assert runtime.calls_settled.snapshot() == {"succeeded": 1}

"""Ownership, leases, adoption and takeover: behaviours the mutation audit of 2026-12-05 found
undefended (each test here failed with a planted bug that the rest of the suite let pass).

Real stores (SQLite files, PostgreSQL when AGENTFOLD_TEST_PG is set), real leases, runtimes of
their own per "host"; nothing is mocked but the timing of a look (a wrapped method that waits).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.team import DeadlineDispatcher, FirstSuccessConfig, compile_deadline, compile_first_success
from agentfold.domain.errors import Fenced
from agentfold.domain.events import ControlRequested, EffectDispatched, EffectSettled, WriterActivated
from agentfold.domain.ids import SignalID
from agentfold.domain.program import Replay, SignalRequest
from agentfold.domain.requests import EffectRequest, Settlement
from tests.interaction.tools import WAIT, wait_until
from tests.kernel_programs import CallLog, GatedCall, chain_program
from tests.team.test_timers import soon
from tests.test_orphan_adoption import parked_asker
from tests.test_terminal_request_takeover import accept_none


def test_a_cancel_sent_again_while_a_passing_holder_has_the_lease_carries_the_recorded_cancel_out(
    durable_store_url: str,
) -> None:
    """A cancellation recorded by a host that does not drive (or an owner that died first) is
    sent again while another runtime holds the run's lease for a moment (an orphan scan's look,
    a racing command). The second cancel records nothing ("already canceling"), yet nobody else
    will carry the first out: its runtime must keep trying to take the run over once the holder
    lets go, as for any input recorded beside a passing holder, or the run stays running for good."""
    program, handle, _ = parked_asker(durable_store_url, "cancel-again-1")
    store = EventStore(durable_store_url)
    try:
        recorder = Runtime(store, Catalog([program]), adopt_on_admit=False, poll_interval=0)
        try:
            assert recorder.cancel(handle.root_process_id, "first") is True  # recorded, not carried out
        finally:
            recorder.close()
        holder_store = EventStore(durable_store_url)
        holder = holder_store.leases()
        assert holder.acquire(handle.tree_id)  # another process's lease, as far as any runtime can tell
        refused = threading.Event()

        def let_go() -> None:
            try:
                refused.wait(30)
                time.sleep(0.03)
            finally:
                holder.release(handle.tree_id)
                holder.close()
                holder_store.close()

        thread = threading.Thread(target=let_go, daemon=True)
        with Runtime(store, Catalog([program]), poll_interval=0) as command:
            acquire = command._leases.acquire

            def acquire_then_the_holder_lets_go(tree_id: Any) -> bool:
                taken = acquire(tree_id)
                if not taken:
                    refused.set()
                return taken

            command._leases.acquire = acquire_then_the_holder_lets_go  # type: ignore[method-assign]
            thread.start()
            assert command.cancel(handle.root_process_id, "again") is False  # already canceling
            thread.join(30)
            assert command.drives(handle.tree_id)
            assert command.result(handle.tree_id, timeout=20).status == "canceled"
        events = [r.event for r in store.read(handle.tree_id)]
        assert sum(isinstance(e, ControlRequested) for e in events) == 1  # the second recorded nothing
    finally:
        store.close()


class _SlowToPlan(DeadlineDispatcher):
    """A Deadline's timer whose ``due`` takes a moment (a clock read over the network, say)."""

    def due(self, request: EffectRequest) -> float | Settlement:
        time.sleep(0.5)
        return super().due(request)


def test_a_cancel_that_takes_over_two_overdue_timers_stops_both_before_either_is_armed(
    durable_store_url: str,
) -> None:
    """docs/team.md: a canceled Deadline's timer settles failed, never as fired. A race of two
    Deadlines whose instants passed while nobody drove it is canceled by a host that takes it
    over: the takeover makes both timers again and records the cancel in the same append. Each
    must be stopped before it is armed; armed first, the overdue one fires on the timer thread
    while the takeover is still planning the other (its ``due`` takes a moment), and a Deadline
    the host canceled is recorded as reached (succeeded)."""
    deadline = compile_deadline("mut.deadline")
    race = compile_first_success(FirstSuccessConfig(
        name="mut.deadlines", candidates=[deadline], accept=accept_none, max_candidates=2,
        description="Two Deadlines, neither accepted."))
    store = EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([race, deadline])) as first:
            handle = first.start(race, [{"key": "a", "program": "mut.deadline", "input": soon(1.0)},
                                        {"key": "b", "program": "mut.deadline", "input": soon(1.0)}],
                                 start_id="two-overdue")
            wait_until(lambda: first.timers_waiting() == 2, "both timers to wait")
        time.sleep(1.5)  # both instants passed while nobody drove the run
        slow = compile_deadline("mut.deadline", dispatcher=_SlowToPlan())
        with Runtime(store, Catalog([race, slow]), poll_interval=0) as command:
            assert command.cancel(handle.root_process_id, "too late") is True
            assert command.result(handle.tree_id, timeout=WAIT).status == "canceled"
            tree = command.wait_idle(handle.tree_id, timeout=WAIT)
        candidates = {p.process_id for p in tree.processes.values() if p.process_id != handle.root_process_id}
        settled = [r.event for r in store.read(handle.tree_id)
                   if isinstance(r.event, EffectSettled) and r.event.process_id in candidates]
        assert len(settled) == 2
        assert [s.status for s in settled] == ["failed", "failed"], settled
        assert {p.status for p in tree.processes.values()} == {"canceled"}
    finally:
        store.close()


def test_the_orphan_scan_does_not_adopt_again_a_run_whose_owner_line_failed_here(
    durable_store_url: str, tmp_path: Any,
) -> None:
    """docs/http-api.md (failover): a run whose owner line failed in this server while driving
    it (``engine.runtime.failed``: an unexpected exception) is not adopted again by the scan
    (each attempt would repeat the failure and append an activation); ``recover`` adopts it.
    The failure here: the store raising an unexpected error on the append that records the
    first call's outcome."""
    log = CallLog(tmp_path / "calls.jsonl")
    gate = GatedCall(log, at=0)
    program = chain_program(gate, name="mut.failing.line")
    store = EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
            handle = runtime.start(program, {"n": 2}, start_id="failed-line-1")
            assert gate.entered.wait(30)
            real = store.append
            broke: list[bool] = []

            def append_breaks_once(*args: Any, **kwargs: Any) -> Any:
                if not broke:
                    broke.append(True)
                    raise RuntimeError("an unexpected error inside the owner line")
                return real(*args, **kwargs)

            store.append = append_breaks_once  # type: ignore[method-assign]
            gate.release.set()
            wait_until(lambda: bool(broke) and not runtime.owns(handle.tree_id), "the owner line to fail")
            store.append = real  # type: ignore[method-assign]
            before = store.head(handle.tree_id)
            assert before is not None and before.classification != "terminal"
            assert runtime.adopt_orphans() == []
            assert runtime.adopt_orphans() == []
            after = store.head(handle.tree_id)
            assert after is not None and after.version == before.version  # nothing appended
            assert log.count() == 1
            # `agentfold recover` (an operator's decision) still adopts it.
            assert [h.tree_id for h in runtime.recover(str(handle.tree_id))] == [handle.tree_id]
    finally:
        store.close()


def test_a_run_that_ends_between_the_orphan_scans_listing_and_its_adoption_is_left_ended(
    durable_store_url: str,
) -> None:
    """The scan lists the live runs, then looks at each under its lease. A run its owner ends in
    between (an answer drove it to completion, and the owner let it go) is listed live but is
    finished when the scan takes its lease: it must be left as it is. Activated, its finished
    history got a ``WriterActivated`` after its ``ProcessTerminated``."""
    program, handle, wait = parked_asker(durable_store_url, "ended-meanwhile-1")
    store = EventStore(durable_store_url)
    try:
        listed = store.heads(live_only=True)  # the scan's listing: the run is live (parked)
        assert [h.tree_id for h in listed] == [str(handle.tree_id)]
        with Runtime(store, Catalog([program]), poll_interval=0) as owner:
            owner.deliver_signals(handle.root_process_id, [SignalRequest(SignalID("ended-answer"), {"name": "e"}, wait)])
            assert owner.result(handle.tree_id, timeout=30).status == "completed"
        events = [r.event for r in store.read(handle.tree_id)]
        with Runtime(store, Catalog([program]), poll_interval=0) as scanner:
            store.heads = lambda *args, **kwargs: listed  # type: ignore[method-assign]
            assert scanner.adopt_orphans() == []
        assert [r.event for r in store.read(handle.tree_id)] == events  # nothing appended after its end
    finally:
        store.close()


def test_a_finished_run_is_given_up_by_its_owner_with_its_lease(durable_store_url: str, tmp_path: Any) -> None:
    """A finished tree needs no owner: its owner line leaves (``owned_count``, the server's
    ``agentfold_runs_owned`` gauge, "runs this server drives now", goes back down) and its lease
    is given back. Kept, every finished run of a long-lived server stayed in memory, counted as
    driven, and held a lease for good."""
    program = chain_program(name="mut.finishing")
    store = EventStore(durable_store_url)
    other = EventStore(durable_store_url)
    leases = other.leases()
    try:
        with Runtime(store, Catalog([program]), poll_interval=0.05) as runtime:
            handles = [runtime.start(program, {"n": 2}, start_id=f"finishing-{i}") for i in range(3)]
            for handle in handles:
                assert runtime.result(handle.tree_id, timeout=30).status == "completed"
            wait_until(lambda: runtime.owned_count() == 0, "the owner lines of the finished runs to leave")
            assert not any(runtime.owns(handle.tree_id) for handle in handles)
            # Given back (a moment after the line leaves, which counts first), not held for good.
            wait_until(lambda: all(leases.acquire(handle.tree_id) for handle in handles), "the leases to be given back")
            assert runtime.status(handles[0].tree_id) == "completed"  # still answered, from the store
    finally:
        leases.close()
        other.close()
        store.close()


def test_a_runtime_on_a_store_opened_through_a_symlink_never_adopts_a_live_owners_run(tmp_path: Any) -> None:
    """The SQLite lease file is named after the database's real path: a server whose store URL
    names the database through a symlink locks the same file as one that names it directly, so
    its orphan scan leaves a live owner's run alone. (Named after the path as given, it locked
    another file: it adopted the run, made its call again or recorded it unknown, and two
    owners drove one run.) The publisher's lease has its own test; it needs Kafka."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "s.db").symlink_to(tmp_path / "real" / "s.db")
    log = CallLog(tmp_path / "calls.jsonl")
    gate = GatedCall(log, at=0)
    program = chain_program(gate, name="mut.linked")
    by_path = EventStore(f"sqlite:///{tmp_path / 'real' / 's.db'}")
    try:
        with Runtime(by_path, Catalog([program]), poll_interval=0) as owner:
            handle = owner.start(program, {"n": 1}, start_id="linked-1")
            assert gate.entered.wait(30)  # the owner is inside the call
            by_link = EventStore(f"sqlite:///{tmp_path / 'link' / 's.db'}")
            try:
                with Runtime(by_link, Catalog([program]), poll_interval=0) as scanner:
                    assert scanner.adopt_orphans() == []
                    assert not scanner.owns(handle.tree_id)
            finally:
                by_link.close()
            gate.release.set()
            assert owner.result(handle.tree_id, timeout=30).status == "completed"
        assert log.count() == 1
        assert [type(r.event).__name__ for r in by_path.read(handle.tree_id)].count("WriterActivated") == 0
    finally:
        gate.release.set()
        by_path.close()


class _HeldAt:
    """A chain dispatcher that holds call ``index`` until its event is set (one event per call)."""

    def __init__(self, log: CallLog) -> None:
        self.log = log
        self.entered = {0: threading.Event(), 1: threading.Event()}
        self.release = {0: threading.Event(), 1: threading.Event()}

    def __call__(self, request: EffectRequest, context: Any) -> Settlement:
        index = request.payload["index"]
        self.log.record(index=index)
        self.entered[index].set()
        self.release[index].wait(30)
        return Settlement.succeeded({"value": 1})


def test_a_run_found_with_nothing_to_drive_is_no_longer_said_driven_here_once_another_runtime_takes_it(
    durable_store_url: str, tmp_path: Any,
) -> None:
    """``driven`` (a CLI command's and an HTTP write's answer, ``Runtime.drives``) is true for a
    run this runtime found, nobody owning it, with nothing to drive (a request sent again), only
    until someone appends after that look. A long-lived server that once sent a pause again to a
    paused run must not say it drives that run after another runtime resumed it and drives it."""
    log = CallLog(tmp_path / "calls.jsonl")
    held = _HeldAt(log)
    program = chain_program(held, name="mut.driven")
    store, other_store = EventStore(durable_store_url), EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([program]), poll_interval=0) as first:
            handle = first.start(program, {"n": 2}, start_id="driven-1")
            assert held.entered[0].wait(30)
            assert first.pause(handle.root_process_id) is True
            held.release[0].set()
            assert first.wait_idle(handle.tree_id, timeout=30).classification() == "parked"
        with Runtime(store, Catalog([program]), poll_interval=0) as server, \
                Runtime(other_store, Catalog([program]), poll_interval=0) as other:
            assert server.pause(handle.root_process_id) is False  # already paused: nothing to drive
            assert server.drives(handle.tree_id)  # found under its lease, nobody owning it
            assert other.resume(handle.root_process_id) is True  # taken over and driven there
            assert held.entered[1].wait(30)
            assert other.owns(handle.tree_id)
            assert not server.drives(handle.tree_id)  # the other runtime drives it now
            held.release[1].set()
            assert other.result(handle.tree_id, timeout=30).status == "completed"
    finally:
        held.release[0].set()
        held.release[1].set()
        other_store.close()
        store.close()


def test_a_call_permitted_by_an_append_that_commits_while_the_runtime_closes_is_never_made_twice(
    durable_store_url: str, tmp_path: Any,
) -> None:
    """Closing abandons the calls in flight; a permission whose append commits once the close has
    begun is not started at all: nobody would record its outcome, and the next owner makes a
    ``same_identity`` call again. Started anyway, the call ran twice: once by the closing runtime
    (its outcome lost), once by the runtime that took the run over."""
    log = CallLog(tmp_path / "calls.jsonl")

    def call(request: EffectRequest, context: Any) -> Settlement:
        log.record(index=request.payload["index"])
        return Settlement.succeeded({"value": 1})

    program = chain_program(call, replay=Replay.SAME_IDENTITY, name="mut.closing")
    store = EventStore(durable_store_url)
    try:
        runtime = Runtime(store, Catalog([program]), poll_interval=0)
        real = store.append
        permits: list[int] = []
        closer: list[threading.Thread] = []

        def append_while_closing(tree_id: Any, expected: int, events: Any, **kwargs: Any) -> Any:
            if any(isinstance(e, EffectDispatched) for e in events):
                permits.append(expected)
                if len(permits) == 2:  # the second call's permission: the runtime closes meanwhile
                    thread = threading.Thread(target=runtime.close, kwargs={"timeout": 10}, daemon=True)
                    thread.start()
                    closer.append(thread)  # started first: the test joins it as soon as it is listed
                    wait_until(lambda: runtime.closed, "the close to begin")
            return real(tree_id, expected, events, **kwargs)

        store.append = append_while_closing  # type: ignore[method-assign]
        handle = runtime.start(program, {"n": 2}, start_id="closing-1")
        wait_until(lambda: bool(closer), "the second permission")
        closer[0].join(30)
        store.append = real  # type: ignore[method-assign]
        time.sleep(0.2)  # a call started by the closed runtime would have been logged by now
        with Runtime(store, Catalog([program]), poll_interval=0) as next_owner:
            next_owner.recover(str(handle.tree_id))
            assert next_owner.result(handle.tree_id, timeout=30).status == "completed"
        assert sorted(line["index"] for line in log.calls()) == [0, 1]  # each call made once
    finally:
        store.close()


def test_starting_again_a_run_whose_owner_died_with_a_call_in_flight_takes_it_over_and_drives_it(
    durable_store_url: str, tmp_path: Any,
) -> None:
    """docs/python.md: starting a run again (the same start id: a queue delivering its job again
    after the worker died) takes it over when it has something to drive, its owner having died
    with work in flight; the handle returned is then driven here to the end. Otherwise the run
    waited for a `recover` or an orphan scan although its job was delivered again."""
    log = CallLog(tmp_path / "calls.jsonl")
    gate = GatedCall(log, at=0)
    program = chain_program(gate, replay=Replay.SAME_IDENTITY, name="mut.redelivered")
    store = EventStore(durable_store_url)
    try:
        owner = Runtime(store, Catalog([program]), poll_interval=0)
        try:
            first = owner.start(program, {"n": 2}, start_id="redelivered-1")
            assert gate.entered.wait(30)
        finally:
            owner.close(timeout=0.5)  # the worker goes away inside the first call
            gate.release.set()
        with Runtime(store, Catalog([program]), poll_interval=0) as worker:
            again = worker.start(program, {"n": 2}, start_id="redelivered-1")
            assert again.tree_id == first.tree_id
            assert worker.owns(again.tree_id)  # taken over at once: it had a call in flight
            assert worker.result(again.tree_id, timeout=30).status == "completed"
        assert sorted(line["index"] for line in log.calls()) == [0, 0, 1]  # the first made again (same_identity)
    finally:
        store.close()


def test_a_run_taken_again_on_a_new_lease_session_is_not_stopped_for_the_old_sessions_loss(pg_database: str,
                                                                                            tmp_path: Any) -> None:
    """PostgreSQL: the lease session ends; another lease statement meets the dead session first
    (the losses are noted, a new session opens), the run's owner line is given up, and the run
    is taken again on the new session (a host's ``recover``) before the watcher's next look at
    the leases. That look must not report the run's new lease lost: it would stop the new owner
    line, which holds its lease, abandon its call and take the run over once more (another
    activation, the call made again)."""
    log = CallLog(tmp_path / "calls.jsonl")
    gate = GatedCall(log, at=0)
    program = chain_program(gate, replay=Replay.SAME_IDENTITY, name="mut.relocked")
    quick = chain_program(name="mut.quick")
    store = EventStore(pg_database)
    try:
        with Runtime(store, Catalog([program, quick]), poll_interval=0.05) as runtime:
            leases = runtime._leases
            check, looks = leases.check, threading.Event()

            def check_when_allowed() -> Any:
                looks.wait(30)  # the watcher's look at the leases waits for the test
                return check()

            leases.check = check_when_allowed  # type: ignore[method-assign]
            handle = runtime.start(program, {"n": 2}, start_id="relocked-1")
            assert gate.entered.wait(30)
            pid = leases._conn.info.backend_pid  # type: ignore[attr-defined]
            with psycopg.connect(pg_database, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            runtime.start(quick, {"n": 1}, start_id="meets-the-dead-session").result(timeout=30)
            assert not leases.holds(handle.tree_id)  # noted lost with the old session
            runtime.release(handle.tree_id)
            gate.entered.clear()
            deadline = time.monotonic() + 10
            while True:  # the ended backend's lock may outlive it a moment
                try:
                    runtime.recover(str(handle.tree_id))
                    break
                except Fenced:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            assert gate.entered.wait(30)  # the call made again by the new owner line (same_identity)
            assert leases.holds(handle.tree_id)
            looks.set()
            time.sleep(0.5)  # several watcher polls
            assert runtime.owns(handle.tree_id)
            gate.release.set()
            assert runtime.result(handle.tree_id, timeout=30).status == "completed"
        activations = [r.event for r in store.read(handle.tree_id) if isinstance(r.event, WriterActivated)]
        assert len(activations) == 1  # the recover's only
        assert sorted(line["index"] for line in log.calls()) == [0, 0, 1]
    finally:
        gate.release.set()
        store.close()

"""``Runtime.adopt_orphans``: what a runtime adopts of the live trees nobody owns, and what not.

The HTTP servers' failover (tests/http_api/test_serve_failover.py) runs this scan every
``--adopt-every`` seconds. Here, on each durable store, in one process: two runtimes with
their own stores (their own leases), one whose owner line is gone (closed with a call in
flight), and a scan by the other.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.ids import SignalID
from agentfold.domain.program import SignalRequest
from tests.kernel_programs import CallLog, GatedCall, asker_program, chain_program


def stored_events(url: str, tree_id: Any) -> int:
    store = EventStore(url, create=False)
    try:
        return len(store.read_raw(tree_id))
    finally:
        store.close()


def orphaned_chain(url: str, gate: GatedCall, start_id: str = "orphan-1") -> Any:
    """A chain tree whose owner closed while its first call was in flight; its tree id."""
    program = chain_program(gate, name="orphan.chain")
    owner = Runtime(EventStore(url), Catalog([program]), poll_interval=0)
    gate.entered.clear()
    try:
        handle = owner.start(program, {"n": 2}, start_id=start_id)
        assert gate.entered.wait(30)
    finally:
        owner.close()
        owner.store.close()
    return handle.tree_id


def test_a_tree_whose_owner_is_gone_is_adopted_once_and_its_call_in_flight_becomes_unknown(
    durable_store_url: str, tmp_path: Any,
) -> None:
    log = CallLog(tmp_path / "calls.jsonl")
    gate = GatedCall(log)
    tree_id = orphaned_chain(durable_store_url, gate)
    gate.release.set()
    program = chain_program(gate, name="orphan.chain")
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as survivor:
        assert survivor.adopt_orphans() == [tree_id]
        assert survivor.adopt_orphans() == []  # it owns it now
        tree = survivor.wait_idle(tree_id, timeout=30)
        [effect] = [e for p in tree.processes.values() for e in p.unknown_effects()]
        assert survivor.orphans_adopted == 1
    assert effect.diagnostic is not None and effect.diagnostic.code == "engine.dispatch.interrupted"
    assert log.count() == 1  # the call was never made again


def test_a_live_owners_tree_is_never_taken(durable_store_url: str, tmp_path: Any) -> None:
    gate = GatedCall(CallLog(tmp_path / "calls.jsonl"))
    program = chain_program(gate, name="orphan.chain")
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as owner:
        handle = owner.start(program, {"n": 2}, start_id="owned-1")
        assert gate.entered.wait(30)
        before = stored_events(durable_store_url, handle.tree_id)
        with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as other:
            assert other.adopt_orphans() == []
            assert other.adopt_orphans() == []
        assert stored_events(durable_store_url, handle.tree_id) == before
        gate.release.set()
        assert owner.result(handle.tree_id, timeout=30).status == "completed"


def test_a_parked_tree_nobody_owns_is_left_as_it_is(durable_store_url: str) -> None:
    program = asker_program("orphan.asker")
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as first:
        handle = first.start(program, None, start_id="parked-1")
        first.wait_idle(handle.tree_id, timeout=30)
    before = stored_events(durable_store_url, handle.tree_id)
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as scanner:
        assert scanner.adopt_orphans() == []
        assert scanner.adopt_orphans() == []
        assert stored_events(durable_store_url, handle.tree_id) == before  # no WriterActivated: nothing to drive
        # The scan looked and let go: the answer, sent through another runtime while the scanner
        # still runs, adopts the tree there and completes it.
        with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as answering:
            waiting = answering.capture(handle.tree_id).processes[handle.root_process_id]
            assert answering.deliver_signals(
                handle.root_process_id, [SignalRequest(SignalID("answer-1"), {"name": "n"}, waiting.current_wait)])
            assert answering.result(handle.tree_id, timeout=30).output == {"hello": "n"}


def parked_asker(url: str, start_id: str) -> tuple[Any, Any, Any]:
    """A parked asker tree nobody owns: its program, its run handle and its current wait."""
    program = asker_program("orphan.asker")
    with Runtime(EventStore(url), Catalog([program]), poll_interval=0) as first:
        handle = first.start(program, None, start_id=start_id)
        wait = first.wait_idle(handle.tree_id, timeout=30).root.current_wait
    return program, handle, wait


def test_an_answer_sent_while_a_scan_held_the_lease_to_look_is_driven_once_the_look_ends(
    durable_store_url: str,
) -> None:
    """The answering runtime cannot take the tree while a scan looks (it holds the lease), so
    it appends the answer without driving it; once the look is over it takes the tree."""
    program, handle, wait = parked_asker(durable_store_url, "looked-1")
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as scanner, \
            Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as answering:
        assert scanner._leases.acquire(handle.tree_id)  # the scan's look, in progress
        append = answering.store.append

        def append_then_the_look_ends(*args: Any, **kwargs: Any) -> Any:
            try:
                return append(*args, **kwargs)
            finally:
                scanner._leases.release(handle.tree_id)

        answering.store.append = append_then_the_look_ends  # type: ignore[method-assign]
        assert answering.deliver_signals(
            handle.root_process_id, [SignalRequest(SignalID("looked-answer"), {"name": "n"}, wait)])
        assert answering.drives(handle.tree_id)
        assert answering.result(handle.tree_id, timeout=30).output == {"hello": "n"}


@pytest.mark.parametrize("judged_first", [False, True], ids=["while-it-looked", "after-it-judged"])
def test_a_scan_that_looked_at_a_parked_tree_while_an_answer_came_drives_the_answer(
    durable_store_url: str, judged_first: bool,
) -> None:
    """The answer came (through a runtime that could not take the tree) while the scan held the
    lease to look, before or after the scan judged the run parked with nothing in flight (leave
    it): the scan finds the tree moved on when it lets go, and adopts it there and then. Nobody
    else will try again, or the answer waits undriven until some later scan or `recover` (the
    second case: found by the mutation audit of 2026-12-05)."""
    program, handle, wait = parked_asker(durable_store_url, f"looked-2-{judged_first}")
    looking, answered = threading.Event(), threading.Event()
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as scanner, \
            Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as answering:
        look = scanner.needs_recovery

        def slow_look(head: Any) -> bool:
            verdict = look(head) if judged_first else None
            looking.set()
            assert answered.wait(30)
            return look(head) if verdict is None else verdict

        scanner.needs_recovery = slow_look  # type: ignore[method-assign]
        scan: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: scan.setdefault("adopted", scanner.adopt_orphans()), daemon=True)
        thread.start()
        assert looking.wait(30)
        assert answering.deliver_signals(
            handle.root_process_id, [SignalRequest(SignalID("looked-answer"), {"name": "m"}, wait)])
        assert not answering.drives(handle.tree_id)  # the scan still held the lease
        answered.set()
        thread.join(30)
        assert scan["adopted"] == [handle.tree_id]
        assert scanner.result(handle.tree_id, timeout=30).output == {"hello": "m"}


def test_a_tree_whose_program_is_unknown_here_is_reported_once_and_never_written(
    durable_store_url: str, tmp_path: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    gate = GatedCall(CallLog(tmp_path / "calls.jsonl"))
    tree_id = orphaned_chain(durable_store_url, gate)
    gate.release.set()
    before = stored_events(durable_store_url, tree_id)
    with caplog.at_level(logging.WARNING, logger="agentfold.runtime"):
        with Runtime(EventStore(durable_store_url), Catalog(), poll_interval=0) as stranger:
            assert stranger.adopt_orphans() == []
            assert stranger.adopt_orphans() == []
    reports = [r.getMessage() for r in caplog.records if "cannot be adopted" in r.getMessage()]
    assert len(reports) == 1 and str(tree_id) in reports[0], reports
    assert stored_events(durable_store_url, tree_id) == before


def test_the_watcher_scans_by_itself_every_adopt_orphans_every_seconds(durable_store_url: str, tmp_path: Any) -> None:
    log = CallLog(tmp_path / "calls.jsonl")
    gate = GatedCall(log)
    tree_id = orphaned_chain(durable_store_url, gate)
    gate.release.set()
    program = chain_program(gate, name="orphan.chain")
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0.05,
                 adopt_orphans_every=0.1) as survivor:
        # Nobody calls recover or admits input: the scan adopts it, and the tree parks on its unknown call.
        deadline = time.monotonic() + 30
        while survivor.orphans_adopted == 0:
            assert time.monotonic() < deadline, "the scan never adopted the tree"
            time.sleep(0.02)
        tree = survivor.wait_idle(tree_id, timeout=30)
        assert survivor.orphans_adopted == 1
    assert [e.diagnostic.code for p in tree.processes.values() for e in p.unknown_effects() if e.diagnostic] == [
        "engine.dispatch.interrupted"]
    assert log.count() == 1


def test_a_scan_with_a_time_budget_adopts_what_fits_and_the_next_scan_goes_on(durable_store_url: str,
                                                                               tmp_path: Any) -> None:
    log = CallLog(tmp_path / "calls.jsonl")
    gate = GatedCall(log)
    orphans = {orphaned_chain(durable_store_url, gate, f"orphan-{i}") for i in range(3)}
    gate.release.set()
    program = chain_program(gate, name="orphan.chain")
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0) as survivor:
        scans = [survivor.adopt_orphans(budget=0.0) for _ in range(4)]
        assert [len(s) for s in scans] == [1, 1, 1, 0]  # one adoption per scan; none twice
        assert {t for s in scans for t in s} == orphans
    assert log.count() == 3  # one call per tree, made before its owner went; none again

"""Owner leases: behaviours the mutation audit of the leases (2026-12-05, s31) found undefended
(each test here failed with a planted bug that the rest of the suite let pass).

Real stores (SQLite files, PostgreSQL when AGENTFOLD_TEST_PG is set), real leases, one runtime
per "host"; nothing is mocked but the moment a step happens (a wrapped ``append`` that lets a
peer act first).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import Fenced
from agentfold.domain.events import WriterActivated
from agentfold.domain.ids import SignalID, StartID, TreeID
from agentfold.domain.program import Replay, SignalRequest
from agentfold.domain.requests import Settlement
from tests.kernel_programs import asker_program, chain_program
from tests.test_orphan_adoption import parked_asker

ROOT = Path(__file__).resolve().parent.parent

#: Another process that holds one run's owner lease until its standard input closes.
LEASE_HOLDER = """
import sys
from agentfold.adapters.eventstore import EventStore
from agentfold.domain.ids import TreeID
store = EventStore(sys.argv[1], create=False)
leases = store.leases()
print("held" if leases.acquire(TreeID(sys.argv[2])) else "refused", flush=True)
sys.stdin.read()
"""


def test_a_takeover_whose_lease_a_peer_took_meanwhile_is_fenced_and_appends_nothing_after_the_peers_activation(
    tmp_path: Path,
) -> None:
    """A takes a run over; before its activation commits, its lease is lost (the SQLite lease
    file was removed: A's watcher opens it again and finds the run's lock taken) and a peer B
    activates the run. A's activation then meets B's: A holds no lease, so it must stop
    (``engine.tree.incarnation_conflict``) and append nothing, and B drives the run on. Activating
    again on top of B (as if B were a dead writer) fenced the live owner and left A driving the
    run without a lease."""
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    program, handle, wait = parked_asker(url, "lost-mid-takeover")
    tree_id = handle.tree_id
    store_a, store_b = EventStore(url), None
    a = Runtime(store_a, Catalog([program]), poll_interval=0)
    b: Runtime | None = None
    real_append = store_a.append

    def peer_first(tree: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal store_b, b
        if tree == tree_id and b is None:
            (tmp_path / "agentfold.db.leases").unlink()  # an operator cleaning up
            store_b = EventStore(url)
            b = Runtime(store_b, Catalog([program]), poll_interval=0)
            assert b.recover(str(tree_id))  # B takes the run on the new lease file and activates it
            a._check_leases()  # A's watcher poll: the file is new, the run's lock there is B's
            assert not a._leases.holds(tree_id)
        return real_append(tree, *args, **kwargs)

    store_a.append = peer_first  # type: ignore[method-assign, assignment]
    try:
        with pytest.raises(Fenced) as caught:
            a.recover(str(tree_id))
        assert caught.value.code == "engine.tree.incarnation_conflict"
        assert b is not None and store_b is not None
        activations = [r.event for r in store_b.read(tree_id) if isinstance(r.event, WriterActivated)]
        assert len(activations) == 1  # B's only: A appended nothing after it
        # B still owns the run: its answer is driven to the end.
        assert b.deliver_signals(handle.root_process_id, [SignalRequest(SignalID("after-race"), {"name": "b"}, wait)])
        assert b.result(tree_id, timeout=30).output == {"hello": "b"}
        assert not a.owns(tree_id)
    finally:
        a.close()
        store_a.close()
        if b is not None:
            b.close()
        if store_b is not None:
            store_b.close()


def test_an_owner_whose_lease_a_peer_took_on_a_new_lease_file_stops_driving_the_run(tmp_path: Path) -> None:
    """The SQLite lease file is removed under a live owner A, and a peer B opens the new file and
    takes A's parked run over before A's watcher looks again. At that poll A opens the file
    again and finds the run's lock held: the lease is B's, so A's owner line stops (A no longer
    drives the run, B does). Taking "every held lease again" without noticing the one B holds
    left A owning a run B drives: two owners of one run."""
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    program = asker_program("lease.file.peer")
    store_a = EventStore(url)
    a = Runtime(store_a, Catalog([program]), poll_interval=0)
    store_b: EventStore | None = None
    b: Runtime | None = None
    try:
        handle = a.start(program, None, start_id="peer-on-new-file")
        a.wait_idle(handle.tree_id, timeout=30)
        assert a.owns(handle.tree_id)
        (tmp_path / "agentfold.db.leases").unlink()  # an operator cleaning up
        store_b = EventStore(url)
        b = Runtime(store_b, Catalog([program]), poll_interval=0)  # its leases open the new file
        assert b.recover(str(handle.tree_id))  # on the new file: nobody holds the run's lock there
        assert b.owns(handle.tree_id)
        a._check_leases()  # A's watcher poll: the file was replaced, the run's lock there is B's
        deadline = time.monotonic() + 5
        while a.owns(handle.tree_id) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not a.owns(handle.tree_id) and not a.drives(handle.tree_id)
        assert b.owns(handle.tree_id)
    finally:
        a.close()
        store_a.close()
        if b is not None:
            b.close()
        if store_b is not None:
            store_b.close()


def test_a_run_lost_with_its_lease_session_and_taken_by_a_peer_is_let_go_once_not_at_every_poll(
    pg_database: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """PostgreSQL: A's lease session ends while a call of its run is under way and a peer takes
    the run over. A's lease manager reports the loss once; A lets the run go once and does not
    look at it again at every later watcher poll (a loss reported again at each poll noted the
    run anew: A read its head and tried its lease at every poll, for LOST_TREE_ATTEMPTS polls,
    for every run a peer took over after a failover)."""
    entered, release = threading.Event(), threading.Event()

    def held(request: Any, context: Any) -> Settlement:
        entered.set()
        release.wait(30)
        return Settlement.succeeded({"value": 1})

    program = chain_program(held, replay=Replay.SAME_IDENTITY, name="leases.once")
    let_go = "not adopted again after its lease was lost: another runtime took it over"
    first_store, peer_store = EventStore(pg_database), EventStore(pg_database)
    caplog.set_level(logging.INFO, logger="agentfold.runtime")
    try:
        # A polls every 0.1 s: the peer, trying at once, takes the run before A adopts it again.
        with Runtime(first_store, Catalog([program]), poll_interval=0.1) as first, \
                Runtime(peer_store, Catalog([program]), poll_interval=0) as peer:
            handle = first.start(program, {"n": 1}, start_id="lost-once")
            assert entered.wait(20)
            pid = first._leases._conn.info.backend_pid  # type: ignore[attr-defined]
            with psycopg.connect(pg_database, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            deadline = time.monotonic() + 10
            while not (peer.owns(handle.tree_id) or time.monotonic() > deadline):
                try:
                    peer.recover(str(handle.tree_id))
                except Fenced:  # the ended session's lock is not released yet
                    time.sleep(0.005)
            assert peer.owns(handle.tree_id), "the peer did not take the run over"
            deadline = time.monotonic() + 10
            while let_go not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
            assert let_go in caplog.text
            looked: list[object] = []
            head = first_store.head

            def counted_head(tree_id: Any, *args: Any, **kwargs: Any) -> Any:
                if tree_id == handle.tree_id:
                    looked.append(tree_id)
                return head(tree_id, *args, **kwargs)

            first_store.head = counted_head  # type: ignore[method-assign]
            time.sleep(0.35)  # three more watcher polls of A
            assert caplog.text.count(let_go) == 1
            assert looked == []  # A no longer looks at the peer's run
            assert not first.owns(handle.tree_id) and peer.owns(handle.tree_id)
            release.set()
    finally:
        release.set()
        first_store.close()
        peer_store.close()


def test_a_run_whose_lease_another_process_holds_is_not_taken_over_here(durable_store_url: str) -> None:
    """The owner lease of a run is the same lock in every process (PostgreSQL: the advisory
    lock key; SQLite: the byte of the lease file): while another process holds it, a runtime
    here refuses to take the run over and appends nothing. A key derived per process (say from
    Python's salted ``hash``) let two processes own one run at once."""
    program, handle, _ = parked_asker(durable_store_url, "held-elsewhere")
    store = EventStore(durable_store_url)
    holder = subprocess.Popen(
        [sys.executable, "-c", LEASE_HOLDER, durable_store_url, str(handle.tree_id)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        version = store.head(handle.tree_id).version  # type: ignore[union-attr]
        with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
            with pytest.raises(Fenced) as caught:
                runtime.recover(str(handle.tree_id))
            assert caught.value.code == "engine.tree.owned"
            assert not runtime.owns(handle.tree_id)
        assert store.head(handle.tree_id).version == version  # type: ignore[union-attr]
    finally:
        holder.communicate(timeout=30)
        store.close()


def test_the_leases_of_different_runs_never_exclude_each_other(durable_store_url: str) -> None:
    """Two runtimes (two lease managers: two lease sessions, two open lease files) each hold the
    leases of 64 different runs at once: every one is granted, and each run's lease is refused
    to the other. A lease key made of a few bits of the run's id (runs sharing a lock) made a
    runtime refuse runs nobody drives (``engine.tree.owned``) while another ran."""
    stores = [EventStore(durable_store_url), EventStore(durable_store_url)]
    managers = [store.leases() for store in stores]
    runs = [TreeID.for_start(StartID(f"start:run-{i}")) for i in range(128)]
    try:
        mine, theirs = runs[:64], runs[64:]
        assert all(managers[0].acquire(tree) for tree in mine)
        assert all(managers[1].acquire(tree) for tree in theirs)
        assert not any(managers[1].acquire(tree) for tree in mine[:8])
        assert not any(managers[0].acquire(tree) for tree in theirs[:8])
    finally:
        for manager in managers:
            manager.close()
        for store in stores:
            store.close()


def test_leases_of_a_session_that_ended_unnoticed_are_reported_lost_when_the_next_lease_opens_a_new_one(
    pg_database: str,
) -> None:
    """PostgreSQL: A's lease session ends (a failover); the first statement to meet it is an
    unlock (A gives a run up: the failure is swallowed), and the next one a lock (A starts a
    run), which opens a new session. The runs A still drove held their locks on the ended
    session only: they must be reported lost (their owner lines stop), not carried over to
    the new session as if still held, or a peer takes such a run while A drives it."""
    program = asker_program("lease.session.unnoticed")
    store_a, store_b = EventStore(pg_database), EventStore(pg_database)
    try:
        with Runtime(store_a, Catalog([program]), poll_interval=0) as a, \
                Runtime(store_b, Catalog([program]), poll_interval=0) as b:
            kept = a.start(program, None, start_id="unnoticed-kept")
            given_up = a.start(program, None, start_id="unnoticed-given-up")
            a.wait_idle(kept.tree_id, timeout=30)
            a.wait_idle(given_up.tree_id, timeout=30)
            pid = a._leases._conn.info.backend_pid  # type: ignore[attr-defined]
            with psycopg.connect(pg_database, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            a.release(given_up.tree_id)  # its unlock meets the ended session
            deadline = time.monotonic() + 10
            while a.owns(given_up.tree_id) and time.monotonic() < deadline:
                time.sleep(0.005)
            a.start(program, None, start_id="unnoticed-new")  # its lock opens a new session
            a._check_leases()  # A's watcher poll
            deadline = time.monotonic() + 5
            while a.owns(kept.tree_id) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert not a.owns(kept.tree_id)
            deadline = time.monotonic() + 10
            while not b.owns(kept.tree_id):  # the ended session's lock goes once its backend exits
                try:
                    b.recover(str(kept.tree_id))
                except Fenced:
                    assert time.monotonic() < deadline, "the peer could not take the run over"
                    time.sleep(0.005)
            assert b.owns(kept.tree_id) and not a.owns(kept.tree_id)
    finally:
        store_a.close()
        store_b.close()

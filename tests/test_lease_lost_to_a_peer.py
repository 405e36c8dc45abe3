"""A runtime whose lease session ended, and whose run a peer took over meanwhile, lets the run go
at once (PostgreSQL: real advisory locks, a real ``pg_terminate_backend``).

It used to try to adopt it again at every watcher poll for ``LOST_TREE_ATTEMPTS`` polls (two
queries per run per poll, for every run a peer took over after a failover), then log
"another owner holds it". Now the first attempt that finds the lease held reads what was
appended since its owner line stopped: a ``WriterActivated`` of another incarnation means
the run is the peer's.
"""

from __future__ import annotations

import logging
import threading
import time

import psycopg
import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import LOST_TREE_ATTEMPTS, Runtime
from agentfold.domain.program import Replay
from agentfold.domain.requests import EffectRequest, Settlement
from tests.kernel_programs import chain_program


def test_a_run_a_peer_took_over_after_a_lost_lease_is_let_go_at_once(
    pg_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    entered, release = threading.Event(), threading.Event()

    def held(request: EffectRequest, context: DispatchContext) -> Settlement:
        entered.set()
        release.wait(30)
        return Settlement.succeeded({"value": 1})

    # same_identity: the peer dispatches the call again and drives the run (a parked run would be
    # left alone at once anyway: nothing to drive)
    program = chain_program(held, replay=Replay.SAME_IDENTITY, name="peer.chain")
    poll = 0.5
    first_store, peer_store = EventStore(pg_database), EventStore(pg_database)
    caplog.set_level(logging.INFO, logger="agentfold.runtime")
    try:
        with Runtime(first_store, Catalog([program]), poll_interval=poll) as first, \
                Runtime(peer_store, Catalog([program]), poll_interval=0) as peer:
            handle = first.start(program, {"n": 1}, start_id="peer-1")
            assert entered.wait(20)
            pid = first._leases._conn.info.backend_pid  # type: ignore[attr-defined]
            with psycopg.connect(pg_database, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            taken: list[object] = []
            deadline = time.monotonic() + 10
            while not taken and time.monotonic() < deadline:  # the peer gets there first
                try:
                    taken = list(peer.recover(str(handle.tree_id)))
                except Exception:  # noqa: BLE001 - the ended session still held the lock
                    time.sleep(0.05)
                if taken and not peer.drives(handle.tree_id):
                    taken = []
                    time.sleep(0.05)
            assert taken, "the peer did not take the run over"
            let_go = "not adopted again after its lease was lost: another runtime took it over"
            began = time.monotonic()
            while let_go not in caplog.text and time.monotonic() - began < 20:
                time.sleep(0.1)
            took = time.monotonic() - began
            assert let_go in caplog.text, caplog.text[-2000:]
            assert took < 10 * poll + 5 < LOST_TREE_ATTEMPTS * poll, took  # not after 150 polls
            with first._lock:
                assert handle.tree_id not in first._lost
            assert peer.drives(handle.tree_id) and not first.drives(handle.tree_id)
            release.set()
    finally:
        release.set()
        first_store.close()
        peer_store.close()

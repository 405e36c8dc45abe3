"""An append is atomic (docs/guarantees.md "The store is exactly once"): the events of one
append, the tree's index row and any new process rows are written in one transaction, all
of them or none.

The fault is real and comes last in the transaction, after the append's events and its
index row were written: on SQLite a trigger that refuses the update of the tree's index
row (written after the events), on PostgreSQL a deferred constraint trigger on the events
table, which raises when the transaction commits. Seeing no event of that append afterwards
(events table, notification log, index row) is what proves the rollback; a fault on the
first statement (tests/http_api/test_serve_store_faults.py) proves nothing about the others.
The refused write is reported as such (``store.append_failed``), not as contention.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

import psycopg
import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.recorders import EVENTS_TABLE, TREES_TABLE
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import AgentfoldError
from agentfold.domain.requests import EffectRequest, Settlement
from tests.kernel_programs import chain_program


def refuse_at_the_end(url: str, on: bool) -> None:
    """While ``on``, every append fails at the end of its transaction."""
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url[len("sqlite:///"):], isolation_level=None) as conn:
            conn.execute("DROP TRIGGER IF EXISTS test_refuse_index")
            if on:  # the index row is written after the events (SQLiteTreeRecorder._insert_events)
                conn.execute(f"CREATE TRIGGER test_refuse_index BEFORE UPDATE ON {TREES_TABLE} "
                             "BEGIN SELECT RAISE(ABORT, 'disk I/O error (test fault)'); END")
        return
    with psycopg.connect(url, autocommit=True) as pg:
        pg.execute(f"DROP TRIGGER IF EXISTS test_refuse_commit ON {EVENTS_TABLE}")
        if on:
            pg.execute("CREATE OR REPLACE FUNCTION test_refuse_commit() RETURNS trigger LANGUAGE plpgsql AS $$ "
                       "BEGIN RAISE EXCEPTION 'could not write block (test fault)'; END $$")
            pg.execute(f"CREATE CONSTRAINT TRIGGER test_refuse_commit AFTER INSERT ON {EVENTS_TABLE} "
                       "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_refuse_commit()")


def stored_rows(url: str) -> list[tuple[Any, ...]]:
    """Every row of the events table, as the database has them (not through agentfold)."""
    sql = f"SELECT originator_id, originator_version, topic FROM {EVENTS_TABLE} ORDER BY originator_version"
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url[len("sqlite:///"):]) as conn:
            return [tuple(r) for r in conn.execute(sql)]
    with psycopg.connect(url) as pg:
        return [tuple(r) for r in pg.execute(sql)]


def test_an_append_that_fails_at_the_end_of_its_transaction_stores_none_of_it(durable_store_url: str) -> None:
    url = durable_store_url
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def gated(request: EffectRequest, context: DispatchContext) -> Settlement:
        calls.append(request.payload["index"])
        if request.payload["index"] == 0:
            entered.set()
            release.wait(30)
        return Settlement.succeeded({"value": 1})

    program = chain_program(gated, name="atomic.chain")
    store = EventStore(url)
    with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
        handle = runtime.start(program, {"n": 2}, start_id="atomic-1")
        assert entered.wait(20)
        before_rows = stored_rows(url)
        before_head = store.head(handle.tree_id)
        before_log = store.max_notification_id()
        refuse_at_the_end(url, True)
        try:
            release.set()  # the call returns: its settlement, the next Step and permission go in one append
            deadline = time.monotonic() + 20
            while runtime.drives(handle.tree_id) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not runtime.drives(handle.tree_id), "the failed append did not stop the owner line"
            with pytest.raises(AgentfoldError) as stopped:
                handle.result(timeout=5)
            assert stopped.value.code == "store.append_failed", stopped.value  # not "kept changing"
            # None of that append is stored: no event row, no notification, the same index row.
            assert stored_rows(url) == before_rows
            assert store.max_notification_id() == before_log
            assert store.head(handle.tree_id) == before_head
        finally:
            refuse_at_the_end(url, False)
        assert [r.position for r in store.read(handle.tree_id)] == list(range(1, before_head.version + 1))  # type: ignore[union-attr]
        assert calls == [0]  # the next call was never made: its permission was not stored

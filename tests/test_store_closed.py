"""A closed EventStore refuses every later use with ``store.closed`` (every backend).

eventsourcing's own ConnectionPoolClosedError (no message, no code) used to escape from a
closed SQLite or PostgreSQL store, and a closed memory store went on working; an embedding
service that closed a store under a live Runtime got an unclassified failure, or none.
"""

from __future__ import annotations

import gc
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from eventsourcing.persistence import OperationalError

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import StoreFailure
from agentfold.domain.ids import TreeID
from tests.kernel_programs import chain_program


def test_every_use_of_a_closed_store_is_refused_as_store_closed(store_url: str) -> None:
    program = chain_program()
    store = EventStore(store_url)
    runtime = Runtime(store, Catalog([program]))
    try:
        assert runtime.start(program, {"n": 2}, start_id="before").result(timeout=30).status == "completed"
        # A finished run's owner line lets the tree go just after result() returns; until then
        # capture answers from the line's memory, not from the store.
        deadline = time.monotonic() + 10
        while runtime.drives(TreeID.for_start("before")) and time.monotonic() < deadline:  # type: ignore[arg-type]
            time.sleep(0.01)
    finally:
        store.close()
    tree = TreeID.for_start("before")
    uses = {
        "heads": store.heads,
        "read": lambda: store.read(tree),
        "load": lambda: store.load(tree),
        "leases": store.leases,
        "notifications": lambda: store.notifications(0),
        "a start through a runtime": lambda: runtime.start(program, {"n": 1}, start_id="after"),
        "a tree captured from the store": lambda: runtime.capture(tree),
        # Host questions go through the read models (SQLite, PostgreSQL) or the fold (memory).
        "Host.pending": Host(runtime).pending,
        "Host.unknown": Host(runtime).unknown,
        "Host.runs": Host(runtime).runs,
    }
    for name, use in uses.items():
        with pytest.raises(StoreFailure) as refused:
            use()
        assert refused.value.code == "store.closed", name
        assert "was closed by this process" in refused.value.message and refused.value.hint, name
    runtime.close()
    store.close()  # closing again is harmless


def test_an_sqlite_call_whose_store_was_closed_under_it_ends_with_its_own_error_and_nothing_more(
    tmp_path: Path,
) -> None:
    # Found by a docs walk: Ctrl-C while `agentfold run` waited 30 s for another process's
    # SQLite write lock exited 130 with its one cli.interrupted line, then a traceback
    # ("Exception ignored in: <generator object SQLiteDatastore.transaction>": Pool is closed,
    # then "Cannot operate on a closed database"): the command closed its store under the
    # call, and the call's cleanup, once the wait ended, failed again on the closed store.
    store = EventStore(f"sqlite:///{tmp_path / 'runs.db'}")
    unraisable: list[Any] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        ended = store.factory.datastore.transaction(commit=True)
        ended.__enter__().execute("SELECT count(*) FROM agentfold_events")
        dropped = store.factory.datastore.transaction(commit=False)
        dropped.__enter__().execute("SELECT count(*) FROM agentfold_trees")
        store.close()  # as a command that stops does, under the calls still in progress
        # The call's own failure (the wait for the lock ran out) is what its caller meets:
        with pytest.raises(OperationalError, match="database is locked"):
            ended.__exit__(sqlite3.OperationalError, sqlite3.OperationalError("database is locked"), None)
        # A call abandoned half-way (its frame dropped with the interruption) ends quietly.
        del dropped
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert unraisable == []

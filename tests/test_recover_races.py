"""Taking a run over only when there is something to drive, judged under its lease (found by a
review racing real `agentfold recover` commands and repeated starts; docs/guarantees.md "A
superseded writer stops", docs/concepts.md: a parked run is adopted only when input reaches it).

Two `recover` commands racing over a crashed run each appended an activation: the second had
listed the run while it still needed recovery, and took it over again after the first had
settled its call unknown and parked it. Starting a parked run again with its start id (a queue
delivering the job twice) appended an activation at every start and kept the run. Real SQLite
files and PostgreSQL databases; the owner dies for real (tests/crash).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.events import WriterActivated
from tests.crash.support import crash, runtime_for, tree_of
from tests.kernel_programs import asker_program


def activations(store: EventStore, tree_id: Any) -> int:
    return sum(isinstance(r.event, WriterActivated) for r in store.read(tree_id))


def test_a_recover_that_listed_a_run_another_recover_then_parked_takes_nothing_over(
    durable_store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "calls.jsonl"
    crash(durable_store_url, log, "start", "--program", "chain", "--start-id", "raced", "--input", '{"n": 2}',
          "--crash", "in-dispatch:1")
    tree_id = tree_of("raced")
    with runtime_for(durable_store_url, "chain", log) as (store, first), \
            runtime_for(durable_store_url, "chain", log) as (_, second):
        real = Runtime._try_adopt
        raced: list[bool] = []

        def the_other_recover_first(self: Runtime, tid: Any, **kwargs: Any) -> Any:
            if self is second and not raced:
                raced.append(True)
                first.recover(str(tid))  # settles the call unknown: the run parks
                first.wait_idle(tid, timeout=30)
                first.release(tid)
            return real(self, tid, **kwargs)

        monkeypatch.setattr(Runtime, "_try_adopt", the_other_recover_first)
        assert second.needs_recovery(store.head(tree_id))  # listed while it still needed recovery
        second.recover()  # every live tree
        assert raced and not second.owns(tree_id)
        assert activations(store, tree_id) == 1
        assert second.recover(str(tree_id), if_needed=True) == []  # one tree, the CLI's way
        assert activations(store, tree_id) == 1
        assert store.load(tree_id).state.root.unknown_effects()


def test_starting_a_parked_run_again_appends_nothing_and_leaves_it_parked(store_url: str) -> None:
    asker = asker_program()
    store = EventStore(store_url)
    try:
        with Runtime(store, Catalog([asker])) as runtime:
            handle = runtime.start(asker, {"question": "name?"}, start_id="parked-job")
            runtime.wait_idle(handle.tree_id, timeout=30)
        version = store.load(handle.tree_id).state.version
        for _ in range(3):  # a queue delivering the job again
            with Runtime(store, Catalog([asker])) as again:
                same = again.start(asker, {"question": "name?"}, start_id="parked-job")
                assert same.tree_id == handle.tree_id
                assert not again.owns(handle.tree_id)
        assert store.load(handle.tree_id).state.version == version
        assert activations(store, handle.tree_id) == 0
    finally:
        store.close()


def test_an_append_that_waits_out_another_processs_sqlite_write_lock_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It was store.append_failed with "fix the store (free disk space, write access)": the
    # cause is a process holding the write lock (one stopped mid-transaction), and the remedy
    # is to send the request again once it is gone.
    import sqlite3

    from agentfold.adapters import eventstore
    from agentfold.domain.errors import StoreFailure

    real = eventstore.parse_store_url

    def short_lock_wait(url: str) -> tuple[str, dict[str, str]]:
        backend, env = real(url)
        return backend, {**env, "SQLITE_LOCK_TIMEOUT": "1"} if backend == "sqlite" else env

    monkeypatch.setattr(eventstore, "parse_store_url", short_lock_wait)
    path = tmp_path / "locked.db"
    asker = asker_program()
    store = EventStore(f"sqlite:///{path}")
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another process's write transaction, never finished
        with Runtime(store, Catalog([asker])) as runtime, pytest.raises(StoreFailure) as failed:
            runtime.start(asker, {"question": "name?"}, start_id="locked")
        assert failed.value.code == "store.unavailable"
        assert "another process held the store's write lock" in failed.value.message
        assert "send the request again" in (failed.value.hint or "")
        holder.execute("ROLLBACK")
        assert store.heads() == []
    finally:
        holder.close()
        store.close()

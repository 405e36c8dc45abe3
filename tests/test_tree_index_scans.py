"""The tree index's scans cost what they find, not the store's size.

``serve`` looks for live runs nobody owns every few seconds (``heads(live_only=True)``), and
settling an Effect by its id looks up the tree holding it (``tree_of_unknown_effect``); both
were full scans of ``agentfold_trees``, which keeps a row for every run ever started. They now
read partial indexes (live trees; trees with unknown Effects), and listings read the rows in
creation order from an index. A steady-state append stores only the row's version, digest and
time on SQLite (SQLite rewrites an index whenever an UPDATE sets a column it reads), so the
row must still follow every change of status, classification and unknown Effects.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import psycopg

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.recorders import HeadFilter
from agentfold.adapters.runtime import Runtime, index_head
from agentfold.domain.ids import TreeID
from agentfold.domain.requests import EffectRequest, Settlement
from tests.kernel_programs import chain_program

INDEXES = ("agentfold_trees_by_created", "agentfold_trees_live", "agentfold_trees_unknown")


def _row_matches_the_fold(store: EventStore, runtime: Runtime, tree_id: TreeID) -> dict[str, Any]:
    head = store.head(tree_id)
    assert head is not None
    folded = runtime.capture(tree_id)
    expected = index_head(folded, tree_id, [], head.updated_at)
    stored = {k: getattr(head, k) for k in ("status", "classification", "version", "unknown_effect_ids")}
    assert stored == {k: getattr(expected, k) for k in stored}
    return stored


def test_the_index_row_follows_every_change_of_a_run(store_url: str) -> None:
    """progress -> parked on an unknown Effect -> progress once resolved -> terminal, with
    steady-state appends in between: the stored row is the fold's at every stage."""
    gate = threading.Event()
    released = threading.Event()

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        index = request.payload["index"]
        if index == 3:
            return Settlement.unknown()
        if index == 6:
            gate.set()
            released.wait(30)
        return Settlement.succeeded({"value": 1})

    program = chain_program(call, name="test.index_scans")
    store = EventStore(store_url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, {"n": 9}, start_id="follows")
            tree_id = handle.tree_id
            runtime.wait_idle(tree_id)
            parked = _row_matches_the_fold(store, runtime, tree_id)
            assert parked["classification"] == "parked" and len(parked["unknown_effect_ids"]) == 1
            (effect_id,) = parked["unknown_effect_ids"]
            assert store.tree_of_unknown_effect(effect_id) == tree_id
            assert [h.tree_id for h in store.heads(live_only=True)] == [tree_id]

            runtime.resolve_unknown_effect(effect_id, Settlement.succeeded({"value": 1}))
            assert gate.wait(30)  # steady-state appends after the resolution, the call 6 held
            moving = _row_matches_the_fold(store, runtime, tree_id)
            assert moving["classification"] == "progress" and moving["unknown_effect_ids"] == ()
            assert moving["version"] > parked["version"]
            assert store.tree_of_unknown_effect(effect_id) is None
            assert [h.tree_id for h in store.heads(live_only=True)] == [tree_id]

            released.set()
            result = handle.result(timeout=30)
            assert result.status == "completed" and result.output == {"total": 9, "effects": 9}
            done = store.head(tree_id)
            assert done is not None and done.classification == "terminal" and done.status == "completed"
            assert done.version == runtime.capture(tree_id).version
            assert store.heads(live_only=True) == []
    finally:
        released.set()
        store.close()


def _plan_sqlite(path: Path, sql: str, params: list[Any]) -> str:
    con = sqlite3.connect(path)
    try:
        return " ".join(str(r[-1]) for r in con.execute("EXPLAIN QUERY PLAN " + sql, params))
    finally:
        con.close()


def _fill_finished_runs(store: EventStore, n: int) -> None:
    """``n`` finished runs, as rows of the index only (what a long-lived store holds)."""
    rows = [
        (f"tree:{i:032x}", f"old-{i}", f"process:{i:032x}", "test.old", "completed", "terminal", 3,
         "sha256:" + "0" * 64, "[]", f"2026-01-01T00:00:{i:09d}Z", f"2026-01-01T00:00:{i:09d}Z")
        for i in range(n)
    ]
    sql = (
        "INSERT INTO agentfold_trees (tree_id, start_id, root_process_id, program, status, classification, "
        "version, head_digest, unknown_effect_ids, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)"
    )
    if store.backend == "sqlite":
        with store.factory.datastore.transaction(commit=True) as c:
            c.executemany(sql, rows)
    else:
        with store.factory.datastore.get_connection() as conn, conn.cursor() as cur:
            cur.executemany(sql.replace("?", "%s"), rows)
            cur.execute("ANALYZE agentfold_trees")


def _live_and_unknown_sql(mark: str) -> tuple[tuple[str, list[Any]], str]:
    live = HeadFilter(live_only=True).sql("agentfold_trees", mark)
    unknown = f"SELECT tree_id FROM agentfold_trees WHERE unknown_effect_ids <> '[]' AND unknown_effect_ids LIKE {mark}"
    return live, unknown


def test_sqlite_reads_live_runs_unknown_effects_and_pages_from_indexes(tmp_path: Path) -> None:
    path = tmp_path / "agentfold.db"
    store = EventStore(f"sqlite:///{path}")
    try:
        _fill_finished_runs(store, 2000)
        (live_sql, live_params), unknown_sql = _live_and_unknown_sql("?")
        live = _plan_sqlite(path, live_sql, live_params)
        assert "agentfold_trees_live" in live and "TEMP B-TREE" not in live, live
        unknown = _plan_sqlite(path, unknown_sql, ['%"effect:x"%'])
        assert "agentfold_trees_unknown" in unknown, unknown
        page_sql, page_params = HeadFilter(limit=10, after=("2026", "tree:")).sql("agentfold_trees", "?")
        page = _plan_sqlite(path, page_sql, page_params)
        assert "agentfold_trees_by_created" in page and "TEMP B-TREE" not in page, page
        latest_sql, latest_params = HeadFilter(last=10).sql("agentfold_trees", "?")
        latest = _plan_sqlite(path, latest_sql, latest_params)
        assert "agentfold_trees_by_created" in latest, latest
        # The lookups still answer: none of the 2,000 finished runs is live or holds an unknown Effect.
        assert store.heads(live_only=True) == []
        assert store.tree_of_unknown_effect("effect:x") is None
        assert len(store.heads(only=HeadFilter(last=10))) == 10
    finally:
        store.close()


def test_postgresql_reads_live_runs_and_unknown_effects_from_partial_indexes(pg_database: str) -> None:
    url = pg_database
    store = EventStore(url)
    try:
        _fill_finished_runs(store, 5000)
        (live_sql, live_params), unknown_sql = _live_and_unknown_sql("%s")
        with psycopg.connect(url, autocommit=True) as conn:
            live = " ".join(r[0] for r in conn.execute("EXPLAIN " + live_sql, live_params))
            unknown = " ".join(r[0] for r in conn.execute("EXPLAIN " + unknown_sql, ['%"effect:x"%']))
        assert "agentfold_trees_live" in live and "Seq Scan" not in live, live
        assert "agentfold_trees_unknown" in unknown and "Seq Scan" not in unknown, unknown
        assert store.heads(live_only=True) == []
        assert store.tree_of_unknown_effect("effect:x") is None
    finally:
        store.close()


def test_a_store_of_an_earlier_release_gets_the_indexes_when_opened(durable_store_url: str) -> None:
    url = durable_store_url
    store = EventStore(url)
    try:
        assert _indexes(store) == set(INDEXES)
        _drop_indexes(store)
        assert _indexes(store) == set()
    finally:
        store.close()
    reopened = EventStore(url)  # an open that may create tables (every command that writes)
    try:
        assert _indexes(reopened) == set(INDEXES)
    finally:
        reopened.close()


def _drop_indexes(store: EventStore) -> None:
    if store.backend == "sqlite":
        with store.factory.datastore.transaction(commit=True) as c:
            for name in INDEXES:
                c.execute(f"DROP INDEX {name}")
    else:
        with store.factory.datastore.get_connection() as conn:
            for name in INDEXES:
                conn.execute(f"DROP INDEX {name}")


def _indexes(store: EventStore) -> set[str]:
    if store.backend == "sqlite":
        with store.factory.datastore.transaction(commit=False) as c:
            c.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'agentfold_trees'")
            return {str(r[0]) for r in c.fetchall()} & set(INDEXES)
    with store.factory.datastore.get_connection() as conn:
        rows = conn.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'agentfold_trees'").fetchall()
    return {str(r["indexname"]) for r in rows} & set(INDEXES)

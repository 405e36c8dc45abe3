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
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from eventsourcing.persistence import StoredEvent
from eventsourcing.sqlite import SQLiteCursor

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.eventstore import PATCHED_START_TOPIC, EventStore
from agentfold.adapters.recorders import HeadFilter, StatementCachingSQLitePool
from agentfold.adapters.runtime import Runtime, index_head
from agentfold.domain.ids import TreeID
from agentfold.domain.requests import EffectRequest, Settlement
from tests.kernel_programs import chain_program, parent_program

TREE_INDEXES = ("agentfold_trees_by_created", "agentfold_trees_live", "agentfold_trees_with_unknown")
INDEXES = (*TREE_INDEXES, "agentfold_processes_by_tree", "agentfold_events_patched_starts")


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
            # PostgreSQL plans with the table's statistics (autovacuum gathers them in production).
            cur.execute("ANALYZE agentfold_trees")


#: What each store-wide read is asked, and the index that must answer it.
READS: list[tuple[str, Callable[[EventStore], object], str]] = [
    ("live", lambda store: store.heads(live_only=True), "agentfold_trees_live"),
    ("parked", lambda store: store.heads(only=HeadFilter(classification="parked")), "agentfold_trees_live"),
    ("unknown", lambda store: store.tree_of_unknown_effect("effect:x"), "agentfold_trees_with_unknown"),
    ("latest", lambda store: store.heads(only=HeadFilter(last=10)), "agentfold_trees_by_created"),
    ("page", lambda store: store.heads(only=HeadFilter(limit=10, after=("2026", "tree:"))), "agentfold_trees_by_created"),
    ("processes", lambda store: store.processes_of_tree(TreeID(f"tree:{7:032x}")), "agentfold_processes_by_tree"),
    # A load of a tree whose snapshot is of format 3: does its history store an input as changes?
    ("patched starts", lambda store: store.index.holds_topic(uuid.UUID(int=7), PATCHED_START_TOPIC, 10**9) or None,
     "agentfold_events_patched_starts"),
]


def _statements_sqlite(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every statement the store's SQLite connections run, with its parameters filled in."""
    statements: list[str] = []
    create = StatementCachingSQLitePool._create_connection

    def traced(pool: StatementCachingSQLitePool) -> Any:
        connection = create(pool)
        connection._sqlite_conn.set_trace_callback(statements.append)
        return connection

    monkeypatch.setattr(StatementCachingSQLitePool, "_create_connection", traced)
    return statements


@pytest.mark.parametrize("name,read,index", READS, ids=[r[0] for r in READS])
def test_sqlite_reads_live_runs_unknown_effects_and_pages_from_indexes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, read: Callable[[EventStore], object], index: str
) -> None:
    path = tmp_path / "agentfold.db"
    statements = _statements_sqlite(monkeypatch)
    store = EventStore(f"sqlite:///{path}")
    try:
        _fill_finished_runs(store, 2000)
        statements.clear()
        answer = read(store)  # none of the 2,000 finished runs is live or holds an unknown Effect
        assert answer in ([], None) or len(answer) == 10  # type: ignore[arg-type]
        (query,) = [q for q in statements if q.lstrip().upper().startswith("SELECT")]
    finally:
        store.close()
    con = sqlite3.connect(path)
    try:
        plan = " ".join(str(r[-1]) for r in con.execute("EXPLAIN QUERY PLAN " + query))
    finally:
        con.close()
    # No sort of the table's rows (``last`` sorts its N rows again, oldest first: "SCAN newest").
    assert index in plan and "TEMP B-TREE" not in plan.split("SCAN newest")[0], (query, plan)


def test_sqlite_writes_out_the_patched_starts_condition_it_asks_the_index_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan test above reads SQL with its values filled in, so it cannot tell the partial
    index's condition written out from the topic bound as a parameter, for which SQLite 3.40
    still picks the index but reads it about 3x slower. The statement itself must hold it."""
    executed: list[tuple[str, tuple[Any, ...]]] = []
    execute = SQLiteCursor.execute

    def recorded(cursor: SQLiteCursor, sql: str, params: Any = (), *a: Any, **kw: Any) -> None:
        executed.append((sql, tuple(params)))
        execute(cursor, sql, params, *a, **kw)

    store = EventStore(f"sqlite:///{tmp_path / 'agentfold.db'}")
    try:
        monkeypatch.setattr(SQLiteCursor, "execute", recorded)
        assert store.index.holds_topic(uuid.UUID(int=7), PATCHED_START_TOPIC, 10**9) is False
    finally:
        store.close()
    ((sql, params),) = [(q, p) for q, p in executed if q.lstrip().upper().startswith("SELECT")]
    assert f"topic = '{PATCHED_START_TOPIC}'" in sql and PATCHED_START_TOPIC not in params, (sql, params)


@pytest.mark.parametrize("name,read,index", [*READS[:3], READS[-1]], ids=[r[0] for r in [*READS[:3], READS[-1]]])
def test_postgresql_reads_live_runs_and_unknown_effects_from_partial_indexes(
    pg_database: str, name: str, read: Callable[[EventStore], object], index: str
) -> None:
    store = EventStore(pg_database)
    asked: list[tuple[str, tuple[Any, ...]]] = []
    select = store.recorder._select

    def recorded(sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        asked.append((sql, params))
        return select(sql, params)

    store.recorder._select = recorded  # type: ignore[method-assign]
    try:
        _fill_finished_runs(store, 5000)
        assert read(store) in ([], None)
        ((query, params),) = asked
    finally:
        store.close()
    with psycopg.connect(pg_database, autocommit=True) as conn:
        plan = " ".join(r[0] for r in conn.execute("EXPLAIN " + query, params))
    assert index in plan and "Seq Scan" not in plan, (query, plan)


def test_postgresql_open_of_a_store_with_its_indexes_waits_for_no_writer(pg_database: str) -> None:
    """Opening a store must not queue behind (and ahead of) appends: CREATE INDEX IF NOT EXISTS
    takes a SHARE lock even when the index exists, so the open only checks that they do."""
    EventStore(pg_database).close()
    with psycopg.connect(pg_database) as writer:  # a transaction that writes to the index, held open
        writer.execute("LOCK TABLE agentfold_trees IN ROW EXCLUSIVE MODE")
        opened = threading.Event()

        def open_store() -> None:
            EventStore(pg_database).close()
            opened.set()

        thread = threading.Thread(target=open_store, daemon=True)
        thread.start()
        try:
            assert opened.wait(20), "the open waited for a writer's transaction on agentfold_trees"
        finally:
            writer.rollback()
            thread.join(20)


def test_postgresql_builds_an_earlier_release_s_missing_indexes_without_holding_up_appends(pg_database: str) -> None:
    """An earlier release's table gets its indexes CONCURRENTLY, after the open's transaction. A
    plain build waits for the appends in flight and, meanwhile, every new append queues behind it
    (every tree's: they lock the events table first); with CONCURRENTLY new appends go on."""
    store = EventStore(pg_database)
    try:
        _fill_finished_runs(store, 3000)
        _drop_indexes(store)
    finally:
        store.close()
    done = threading.Event()
    with psycopg.connect(pg_database) as in_flight, psycopg.connect(pg_database, autocommit=True) as later:
        in_flight.execute("UPDATE agentfold_trees SET updated_at = updated_at WHERE tree_id = %s", (f"tree:{1:032x}",))
        thread = threading.Thread(target=lambda: (EventStore(pg_database).close(), done.set()), daemon=True)
        thread.start()
        try:
            _wait_for(lambda: _waiting_builds(later) > 0)  # the open is building, behind the append in flight
            later.execute("SET lock_timeout = '2s'")
            later.execute("UPDATE agentfold_trees SET updated_at = updated_at WHERE tree_id = %s", (f"tree:{2:032x}",))
            assert not done.is_set()
        finally:
            in_flight.rollback()
            thread.join(30)
    assert done.is_set()
    reopened = EventStore(pg_database)
    try:
        assert _indexes(reopened) == set(INDEXES)
        with reopened.factory.datastore.get_connection() as conn:
            valid = conn.execute(
                "SELECT count(*) AS n FROM pg_index WHERE indisvalid AND indexrelid = ANY(%s::regclass[])",
                (list(INDEXES),),
            ).fetchone()
        assert valid is not None and valid["n"] == len(INDEXES)
    finally:
        reopened.close()


def test_postgresql_builds_again_an_index_an_interrupted_build_left_invalid(pg_database: str) -> None:
    store = EventStore(pg_database)
    try:
        _fill_finished_runs(store, 50)  # the same program on every row: a unique index on it fails
        _drop_indexes(store)
    finally:
        store.close()
    with psycopg.connect(pg_database, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute("CREATE UNIQUE INDEX CONCURRENTLY agentfold_trees_live ON agentfold_trees (program)")
        invalid = conn.execute(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = 'agentfold_trees_live'::regclass").fetchone()
        assert invalid == (False,)  # what a build that failed or was cancelled leaves behind
    reopened = EventStore(pg_database)
    try:
        assert reopened.heads(live_only=True) == []
        with reopened.factory.datastore.get_connection() as conn:
            rows = conn.execute(
                "SELECT indexrelid::regclass::text AS name, indisvalid, pg_get_indexdef(indexrelid) AS definition "
                "FROM pg_index WHERE indrelid = 'agentfold_trees'::regclass").fetchall()
    finally:
        reopened.close()
    live = [r for r in rows if r["name"] == "agentfold_trees_live"]
    assert len(live) == 1 and live[0]["indisvalid"] and "WHERE (classification <> 'terminal'" in live[0]["definition"]
    assert {r["name"] for r in rows if r["indisvalid"]} >= set(TREE_INDEXES)


def test_postgresql_builds_the_events_index_of_an_earlier_release_s_store_behind_a_long_reader(
    pg_database: str,
) -> None:
    """The events table's index is built plainly in the open's transaction, not CONCURRENTLY:
    every append locks that table, so a concurrent build held appends as long, and behind an
    older transaction (a long report, a backup) it waited for that transaction while appends
    waited for it, until PostgreSQL broke the cycle as a deadlock: the open (``serve``, ``run``)
    failed and left the index invalid (found by a review, 3 runs of 3)."""
    tree = uuid.UUID(int=41)
    store = EventStore(pg_database)
    try:
        store.recorder.insert_events(
            [StoredEvent(tree, v, "domain.events:StepCommitted", b"{}") for v in range(1, 2001)])
        with store.factory.datastore.get_connection() as conn:
            conn.execute("DROP INDEX agentfold_events_patched_starts")
    finally:
        store.close()
    opened = threading.Event()
    failures: list[BaseException] = []

    def open_store() -> None:
        try:
            EventStore(pg_database).close()  # an open that may create (serve, run, import)
            opened.set()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    with psycopg.connect(pg_database) as reader:
        reader.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        reader.execute("SELECT count(*) FROM agentfold_trees").fetchone()  # its snapshot taken, held open
        thread = threading.Thread(target=open_store, daemon=True)
        thread.start()
        try:
            assert opened.wait(20), f"the open waited for an older transaction: {failures}"
            writer = EventStore(pg_database, create=False)
            try:
                writer.recorder.insert_events([StoredEvent(tree, 2001, "domain.events:StepCommitted", b"{}")])
            finally:
                writer.close()
        finally:
            reader.rollback()
            thread.join(30)
    assert not failures
    with psycopg.connect(pg_database, autocommit=True) as conn:
        valid = conn.execute(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = 'agentfold_events_patched_starts'::regclass").fetchone()
    assert valid == (True,)


def _waiting_builds(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE query ILIKE 'CREATE INDEX%%' AND wait_event_type = 'Lock'"
    ).fetchone()
    return int(row[0]) if row else 0


def test_a_tree_with_a_hundred_unknown_effects_appends_and_is_found(store_url: str) -> None:
    """The unknown Effects' index is keyed by tree id: a long list of unknown ids (PostgreSQL
    refuses an index entry over 2,704 bytes) never stops a tree's appends."""
    child = chain_program(lambda request, context: Settlement.unknown(), name="test.index_unknown_child")
    middle = parent_program(child, count=10, name="test.index_unknown_middle")
    root = parent_program(middle, count=10, name="test.index_unknown_root")
    store = EventStore(store_url)
    try:
        with Runtime(store, Catalog([root, middle, child])) as runtime:
            handle = runtime.start(root, {"child": {"child": {"n": 1}}}, start_id="many-unknown")
            runtime.wait_idle(handle.tree_id, timeout=120)
            stored = _row_matches_the_fold(store, runtime, handle.tree_id)
        assert stored["classification"] == "parked" and len(stored["unknown_effect_ids"]) == 100
        for effect_id in stored["unknown_effect_ids"][::33]:
            assert store.tree_of_unknown_effect(effect_id) == handle.tree_id
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
            c.execute("SELECT name FROM sqlite_master WHERE type = 'index' "
                      "AND tbl_name IN ('agentfold_trees', 'agentfold_processes', 'agentfold_events')")
            return {str(r[0]) for r in c.fetchall()} & set(INDEXES)
    with store.factory.datastore.get_connection() as conn:
        rows = conn.execute("SELECT indexname FROM pg_indexes "
                            "WHERE tablename IN ('agentfold_trees', 'agentfold_processes', 'agentfold_events')").fetchall()
    return {str(r["indexname"]) for r in rows} & set(INDEXES)


def test_the_row_follows_a_change_another_runtime_made(durable_store_url: str) -> None:
    """Runtime B pauses A's run (A catches the event up); A resumes it, back to the row state
    A itself last stored: A's append must set every column again, not only the version."""
    gate = threading.Event()

    def call(request: EffectRequest, context: DispatchContext) -> Settlement:
        if request.payload["index"] == 1:
            gate.wait(30)
        return Settlement.succeeded({"value": 1})

    program = chain_program(call, name="test.index_remote")
    mine, theirs = EventStore(durable_store_url), EventStore(durable_store_url)
    try:
        with Runtime(mine, Catalog([program]), poll_interval=0.02) as a, \
                Runtime(theirs, Catalog([program]), adopt_on_admit=False, poll_interval=0) as b:
            handle = a.start(program, {"n": 4}, start_id="remote")
            tree_id = handle.tree_id
            root = a.capture(tree_id).root.process_id
            _wait_for(lambda: (mine.head(tree_id) or handle).version >= 8)  # type: ignore[union-attr]
            assert _row_matches_the_fold(mine, a, tree_id)["classification"] == "progress"
            assert b.pause(root)
            _wait_for(lambda: a.capture(tree_id).root.status == "paused")  # A caught B's event up
            assert _row_matches_the_fold(mine, a, tree_id)["status"] == "paused"
            assert a.resume(root)
            resumed = _row_matches_the_fold(mine, a, tree_id)
            assert (resumed["status"], resumed["classification"]) == ("running", "progress")
            gate.set()
            assert handle.result(timeout=30).status == "completed"
            assert _row_matches_the_fold(mine, a, tree_id)["classification"] == "terminal"
    finally:
        gate.set()
        mine.close()
        theirs.close()


def _wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_steady_state_append_sets_only_the_version_digest_and_time_on_sqlite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What keeps the partial indexes off an Effect's critical path: SQLite rewrites an index
    whenever an UPDATE sets a column it reads, whatever the value."""
    statements = _statements_sqlite(monkeypatch)
    program = chain_program(name="test.index_narrow")
    store = EventStore(f"sqlite:///{tmp_path / 'agentfold.db'}")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            result = runtime.start(program, {"n": 20}, start_id="narrow").result(timeout=60)
            assert result.status == "completed"
    finally:
        store.close()
    # The start inserts the row; every later append updates the row it starts from (the
    # update also checks the row's version and digest: the WHERE clause, not what it sets).
    writes = [q for q in statements if q.startswith(("INSERT INTO agentfold_trees", "UPDATE agentfold_trees"))]
    sets = [q.split(" WHERE ")[0] if q.startswith("UPDATE") else q for q in writes]
    narrow = [q for q in sets if "classification" not in q]
    assert len(writes) == 21  # the start, then one append per Effect
    assert writes[0].startswith("INSERT") and all(q.startswith("UPDATE") for q in writes[1:])
    assert sets[0] not in narrow and sets[-1] not in narrow  # created; completed (terminal)
    assert len(narrow) >= 18
    assert all(q.startswith("UPDATE agentfold_trees SET version = ") and "head_digest = " in q for q in narrow)

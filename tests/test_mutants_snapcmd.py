"""Mutation audit of ``agentfold snapshot`` and the events table's partial index: the
behaviours no earlier test held.

- a snapshot the store refuses (a constraint on its row) stops the command with
  ``store.append_failed``, saying how many trees it did and how many snapshots it wrote
  (never reported ``written``, nor ``failed`` while the others go on);
- a tree with an event changed under its digest (still readable JSON) fails its entry: no
  snapshot is written from a history the load did not verify (loads would never read that
  event again);
- an index row whose tree id is no tree id (written by hand) fails its own entry, saying so,
  and the other trees are done;
- a snapshot above the size a reader takes is ``skipped`` and not written;
- a tree named twice (its id and its start id) is done once;
- a read-only store is refused before any tree is read, even when none needs a snapshot;
- PostgreSQL builds an earlier release's missing Processes index CONCURRENTLY: an append
  that creates a Process does not queue behind the open;
- PostgreSQL builds again an events index an interrupted build left invalid;
- the events index is partial (it holds only the inputs stored as changes), and PostgreSQL's
  generic plan of the lookup (what a prepared statement settles on) still reads it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from eventsourcing.persistence import StoredEvent

from agentfold.adapters import cli_audit, eventstore
from agentfold.adapters.catalog import Catalog
from agentfold.adapters.codec import PATCHED_START_TOPIC
from agentfold.adapters.eventstore import CorruptStream, EventStore
from agentfold.domain.ids import TreeID
from tests.audit.support import Sql, chain_sources, cli
from tests.kernel_programs import chain_program
from tests.test_read_only_store import _mount, mount_point  # noqa: F401 - the fixture
from tests.test_snapshot_command import _finished, _loaded, _snapshot_rows
from tests.test_tree_index_scans import _drop_indexes, _wait_for, _waiting_builds

EVENTS_INDEX = "agentfold_events_patched_starts"


def _refuse_snapshots_of(url: str, tree_id: TreeID) -> None:
    """A constraint of the store (a trigger) refuses every snapshot row of ``tree_id``."""
    if url.startswith("sqlite"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            conn.execute(
                "CREATE TRIGGER refuse_snapshots BEFORE INSERT ON agentfold_snapshots "
                f"WHEN NEW.originator_id = '{tree_id.uuid.hex}' "
                "BEGIN SELECT RAISE(ABORT, 'snapshots of this tree are refused'); END"
            )
        return
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE FUNCTION refuse_snapshots() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'snapshots of this tree are refused' USING ERRCODE = 'check_violation'; END $$"
        )
        conn.execute(
            "CREATE TRIGGER refuse_snapshots BEFORE INSERT ON agentfold_snapshots FOR EACH ROW "
            f"WHEN (NEW.originator_id = '{tree_id.uuid}') EXECUTE FUNCTION refuse_snapshots()"
        )


def test_a_snapshot_the_store_refuses_stops_the_command_saying_what_it_wrote(
    capsys: pytest.CaptureFixture[str], durable_store_url: str
) -> None:
    url = durable_store_url
    program = chain_program()
    small, big, refused = _finished(url, program, 2, 30, 30)
    version = _loaded(url, program, refused)[1]
    _refuse_snapshots_of(url, refused)

    ran = cli(capsys, "snapshot", str(small), str(big), str(refused), "--min-events", "50", "--json",
              "--store", url, sources=chain_sources(program))

    assert ran.code == 1 and ran.stdout == "", (ran.code, ran.stdout, ran.stderr)
    error = json.loads(ran.stderr)["error"]
    assert error["code"] == "store.append_failed", error
    assert f"the snapshot of tree {refused} at version {version} was refused" in error["message"], error
    # small was current, big written: two trees done, one snapshot written (it stays).
    assert "stopped after 2 of 3 tree(s), 1 snapshot(s) written" in error["message"], error
    assert _snapshot_rows(url, big) == [_loaded(url, program, big)[1]]
    assert _snapshot_rows(url, refused) == [] and _snapshot_rows(url, small) == []
    assert _loaded(url, program, refused)[0] == 0  # its loads still fold, from position 1


def test_a_tree_with_an_event_changed_under_its_digest_gets_no_snapshot(
    capsys: pytest.CaptureFixture[str], durable_store_url: str
) -> None:
    """The snapshot is taken from the verified fold: written from a changed history, it would
    become the start of every later load, which then never reads the changed event again."""
    url = durable_store_url
    program = chain_program()
    changed, sound = _finished(url, program, 30, 30)
    sql = Sql(url)
    version, topic, state = next(r for r in sql.rows(changed) if r[0] == 5)
    tampered = state.replace(b'"timestamp":"2', b'"timestamp":"1', 1)
    assert tampered != state
    sql.set_row(changed, version, topic, tampered)  # valid JSON, its recorded digest kept

    ran = cli(capsys, "snapshot", str(changed), str(sound), "--min-events", "10", "--json", "--store", url,
              sources=chain_sources(program))

    assert ran.code == 1, (ran.stdout, ran.stderr)
    first, second = json.loads(ran.stdout)["trees"]
    assert first["outcome"] == "failed" and "store.corrupt" in first["reason"], first
    assert second["outcome"] == "written", second
    assert _snapshot_rows(url, changed) == []
    store = EventStore(url)
    try:
        with pytest.raises(CorruptStream):  # every load still reports it
            store.load(changed, Catalog([program]).resolve)
    finally:
        store.close()


def test_an_index_row_that_names_no_tree_fails_its_own_entry_and_the_others_are_written(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    program = chain_program()
    (tree_id,) = _finished(url, program, 30)
    Sql(url)._run(
        "INSERT INTO agentfold_trees (tree_id, start_id, root_process_id, program, status, classification, "
        "version, head_digest, unknown_effect_ids, created_at, updated_at) "
        "VALUES ('tree:zz', 's', 'process:00', 'p', 'running', 'progress', 1, 'd', '[]', '0', '0')")
    ran = cli(capsys, "snapshot", "--all", "--min-events", "10", "--json", "--store", url,
              sources=chain_sources(program))
    assert ran.code == 1, (ran.stdout, ran.stderr)
    by_tree = {e["tree_id"]: e for e in json.loads(ran.stdout)["trees"]}
    assert set(by_tree) == {str(tree_id), "tree:zz"}
    assert by_tree["tree:zz"]["outcome"] == "failed", by_tree
    assert by_tree["tree:zz"]["reason"].startswith("this is no tree id"), by_tree
    assert by_tree[str(tree_id)]["outcome"] == "written"


def test_a_snapshot_too_large_for_readers_is_skipped_and_not_written(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound is 256 MiB; lowered here so that a short run's snapshot is above it."""
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    program = chain_program()
    (tree_id,) = _finished(url, program, 30)
    store = EventStore(url)
    try:
        loaded = store.load(tree_id, Catalog([program]).resolve)
        size = len(EventStore.encode_snapshot(loaded.state, loaded.digest or ""))
    finally:
        store.close()
    bound = size - 1
    monkeypatch.setattr(eventstore, "MAX_SNAPSHOT_BYTES", bound)
    monkeypatch.setattr(cli_audit, "MAX_SNAPSHOT_BYTES", bound)

    ran = cli(capsys, "snapshot", str(tree_id), "--min-events", "10", "--json", "--store", url,
              sources=chain_sources(program))

    assert ran.code == 0, (ran.stdout, ran.stderr)
    report = json.loads(ran.stdout)
    (entry,) = report["trees"]
    assert entry["outcome"] == "skipped", entry
    assert f"its snapshot would be {size} bytes, above the {bound} a reader takes" in entry["reason"], entry
    assert (report["written"], report["skipped"]) == (0, 1)
    assert _snapshot_rows(url, tree_id) == []


def test_a_tree_named_twice_is_snapshotted_once(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    program = chain_program()
    (tree_id,) = _finished(url, program, 30)  # start id snap-0
    ran = cli(capsys, "snapshot", str(tree_id), "snap-0", "--min-events", "10", "--json", "--store", url,
              sources=chain_sources(program))
    assert ran.code == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert [(e["tree_id"], e["outcome"]) for e in report["trees"]] == [(str(tree_id), "written")], report
    assert (report["written"], report["current"]) == (1, 0)


def test_a_read_only_store_is_refused_before_any_tree_is_read(
    capsys: pytest.CaptureFixture[str], mount_point: Path  # noqa: F811 - the fixture imported above
) -> None:
    """Even when no tree needs a snapshot (``--min-events`` above every tree): refused as a
    write, not reported as done."""
    url = f"sqlite:///{mount_point / 'agentfold.db'}"
    program = chain_program()
    _finished(url, program, 30, 2)
    assert _mount(mount_point, "remount,ro")
    ran = cli(capsys, "snapshot", "--all", "--min-events", "1000000", "--json", "--store", url,
              sources=chain_sources(program))
    assert ran.code == 1 and ran.stdout == "", (ran.code, ran.stdout, ran.stderr)
    error = json.loads(ran.stderr)["error"]
    assert error["code"] == "store.read_only" and "stopped after" not in error["message"], error


def test_postgresql_builds_an_earlier_release_s_processes_index_without_holding_up_new_processes(
    pg_database: str,
) -> None:
    """As for the trees' indexes (tests/test_tree_index_scans.py): built plainly in the open's
    transaction, the Processes index would wait for the append in flight while every append
    that creates a Process (a new run, a child) queued behind it."""
    store = EventStore(pg_database)
    try:
        _drop_indexes(store)
    finally:
        store.close()
    done = threading.Event()

    def open_store() -> None:  # an open that may create (serve, run, import)
        EventStore(pg_database).close()
        done.set()

    with psycopg.connect(pg_database) as in_flight, psycopg.connect(pg_database, autocommit=True) as later:
        in_flight.execute("INSERT INTO agentfold_processes VALUES ('process:' || repeat('a', 32), 'tree:x')")
        thread = threading.Thread(target=open_store, daemon=True)
        thread.start()
        try:
            _wait_for(lambda: _waiting_builds(later) > 0)  # the open is building, behind the append in flight
            later.execute("SET lock_timeout = '2s'")
            later.execute("INSERT INTO agentfold_processes VALUES ('process:' || repeat('b', 32), 'tree:y')")
            assert not done.is_set()
        finally:
            in_flight.rollback()
            thread.join(30)
    assert done.is_set()
    with psycopg.connect(pg_database, autocommit=True) as conn:
        valid = conn.execute(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = 'agentfold_processes_by_tree'::regclass").fetchone()
    assert valid == (True,)


def test_postgresql_builds_again_an_events_index_an_interrupted_build_left_invalid(pg_database: str) -> None:
    """The release before built the events index CONCURRENTLY, and behind an older transaction
    that build deadlocked with appends and left the index invalid (commit 03603ee): an open
    must replace it, not take ``IF NOT EXISTS`` for done."""
    tree = uuid.UUID(int=43)
    store = EventStore(pg_database)
    try:
        store.recorder.insert_events([StoredEvent(tree, v, "domain.events:StepCommitted", b"{}") for v in (1, 2)])
        with store.factory.datastore.get_connection() as conn:
            conn.execute(f"DROP INDEX {EVENTS_INDEX}")
    finally:
        store.close()
    with psycopg.connect(pg_database, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.UniqueViolation):  # two rows of one topic: the build fails
            conn.execute(f"CREATE UNIQUE INDEX CONCURRENTLY {EVENTS_INDEX} ON agentfold_events (topic)")
        invalid = conn.execute(
            f"SELECT indisvalid FROM pg_index WHERE indexrelid = '{EVENTS_INDEX}'::regclass").fetchone()
        assert invalid == (False,)
    EventStore(pg_database).close()  # an open that may create (serve, run, import)
    with psycopg.connect(pg_database, autocommit=True) as conn:
        row = conn.execute(
            "SELECT indisvalid, pg_get_indexdef(indexrelid) FROM pg_index "
            f"WHERE indexrelid = '{EVENTS_INDEX}'::regclass").fetchone()
    assert row is not None and row[0] is True, row
    assert f"WHERE (topic = '{PATCHED_START_TOPIC}'::text)" in row[1], row


def test_the_events_index_holds_only_the_inputs_stored_as_changes(durable_store_url: str) -> None:
    """Partial: it costs other appends nothing, and a lookup reads only the tree's patched
    starts, not every one of its rows up to the snapshot."""
    store = EventStore(durable_store_url)
    try:
        if store.backend == "sqlite":
            with store.factory.datastore.transaction(commit=False) as c:
                c.execute("SELECT partial FROM pragma_index_list('agentfold_events') WHERE name = ?", (EVENTS_INDEX,))
                partial = c.fetchone()
                c.execute("SELECT sql FROM sqlite_master WHERE name = ?", (EVENTS_INDEX,))
                definition = str(c.fetchone()[0])
            assert partial is not None and partial[0] == 1, partial
            assert definition.endswith(f"WHERE topic = '{PATCHED_START_TOPIC}'"), definition
        else:
            with store.factory.datastore.get_connection() as conn:
                row = conn.execute(
                    "SELECT pg_get_expr(indpred, indrelid) AS condition FROM pg_index "
                    f"WHERE indexrelid = '{EVENTS_INDEX}'::regclass").fetchone()
            assert row is not None and row["condition"] == f"(topic = '{PATCHED_START_TOPIC}'::text)", row
    finally:
        store.close()


def test_postgresql_s_generic_plan_of_the_patched_starts_lookup_reads_the_partial_index(pg_database: str) -> None:
    """The store's reads are prepared statements: after five runs PostgreSQL may settle on a
    generic plan, made without the parameters' values. A topic bound as a parameter cannot
    prove the partial index's condition there (a scan of the tree's rows instead); the
    condition written out can."""
    store = EventStore(pg_database)
    asked: list[tuple[str, tuple[Any, ...]]] = []
    select = store.recorder._select

    def recorded(sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        asked.append((sql, params))
        return list(select(sql, params))

    tree = uuid.UUID(int=7)
    try:
        store.recorder.insert_events(
            [StoredEvent(tree, v, "domain.events:StepCommitted", b"{}") for v in range(1, 5001)])
        store.recorder._select = recorded
        assert store.index.holds_topic(tree, PATCHED_START_TOPIC, 10**9) is False
        ((query, params),) = asked
    finally:
        store.close()
    numbered = query
    for n in range(1, len(params) + 1):
        numbered = numbered.replace("%s", f"${n}", 1)
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute("ANALYZE agentfold_events")
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE lookup AS {numbered}")
        values = ", ".join(f"'{p}'" for p in params)
        plan = " ".join(str(r[0]) for r in conn.execute(f"EXPLAIN EXECUTE lookup({values})"))
    assert EVENTS_INDEX in plan and "Seq Scan" not in plan, (query, plan)

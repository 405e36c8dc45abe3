"""Materialized read models: the projections' tables in the store's own database.

One table per projection (docs/read-models.md), each row holding the exact JSON entry
the pure projection produces (``agentfold.projections.read_models``), plus the columns a host
filters on. A follower (``agentfold.adapters.follower``) writes them; every update of a batch
of notifications is committed **in one transaction with its tracking position**
(the eventsourcing tracking table, application name ``agentfold.read_models``), so a
crash before the commit loses the whole batch, and the follower simply does it again:
exactly once, resumable, rebuildable from zero. The position is compared and set first
in that transaction (it must still be the one the batch was read from), so several
followers on one store take turns and each notification is applied by exactly one of them.

A tree whose stored history cannot be read (``store.corrupt``) gets a row in
``agentfold_rm_corrupt_trees`` instead of rows in the other tables, written in the
batch's transaction like any other row, so one damaged tree never stops the read
models of the others and a rebuild records it again the same way.

Supported on SQLite and PostgreSQL stores. The memory store has no database to put
tables in: hosts of a memory store fold (``agentfold.adapters.queries`` does that by itself).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from eventsourcing.persistence import IntegrityError
from eventsourcing.sqlite import SQLiteTrackingRecorder

from agentfold.adapters.eventstore import CorruptStream, EventStore
from agentfold.adapters.recorders import on_a_live_connection
from agentfold.domain.errors import InvalidInput, NotFound
from agentfold.domain.ids import TreeID
from agentfold.projections.host_views import gate_inputs
from agentfold.projections.read_models import Entry, TreeRows

log = logging.getLogger(__name__)

APPLICATION = "agentfold.read_models"
TRACKING_TABLE = "agentfold_tracking"
RUNS = "agentfold_rm_runs"
ROUNDS = "agentfold_rm_settled_results"
DELEGATES = "agentfold_rm_delegates"
PENDING = "agentfold_rm_pending_inputs"
UNKNOWN = "agentfold_rm_unknown_effects"
CORRUPT = "agentfold_rm_corrupt_trees"
GATES = "agentfold_rm_input_gates"
TREE_TABLES = (RUNS, ROUNDS, DELEGATES, PENDING, UNKNOWN, GATES)  # a tree's rows (none once it is corrupt)
TABLES = (*TREE_TABLES, CORRUPT)

# Column lists (the DDL below adds types); ``body`` is the entry's JSON text.
_DDL = (
    f"CREATE TABLE IF NOT EXISTS {RUNS} (tree_id TEXT PRIMARY KEY, start_id TEXT NOT NULL, "
    "root_process_id TEXT NOT NULL, program TEXT NOT NULL, status TEXT NOT NULL, classification TEXT NOT NULL, "
    "version BIGINT NOT NULL, events_projected BIGINT NOT NULL, created_position BIGINT NOT NULL, "
    "position BIGINT NOT NULL, unknown_count INTEGER NOT NULL, pending_count INTEGER NOT NULL, body TEXT NOT NULL)",
    f"CREATE INDEX IF NOT EXISTS {RUNS}_by_created ON {RUNS} (created_position)",
    f"CREATE INDEX IF NOT EXISTS {RUNS}_by_status ON {RUNS} (status, created_position)",
    # GET /runs?classification=parked: without it a rare classification walked every run (a soak audit:
    # 15 ms at 35k runs against 4 ms for a status, growing with the store).
    f"CREATE INDEX IF NOT EXISTS {RUNS}_by_classification ON {RUNS} (classification, created_position)",
    f"CREATE TABLE IF NOT EXISTS {ROUNDS} (tree_id TEXT NOT NULL, ord INTEGER NOT NULL, process_id TEXT NOT NULL, "
    "model_call_sequence BIGINT NOT NULL, call_count INTEGER NOT NULL, entry_count INTEGER NOT NULL, "
    "complete BOOLEAN NOT NULL, digest TEXT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (tree_id, ord))",
    f"CREATE TABLE IF NOT EXISTS {DELEGATES} (tree_id TEXT NOT NULL, ord INTEGER NOT NULL, process_id TEXT NOT NULL, "
    "model_call_sequence BIGINT NOT NULL, tool_call_index INTEGER NOT NULL, tool_call_ref TEXT NOT NULL, "
    "child_key TEXT NOT NULL, child_process_id TEXT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (tree_id, ord))",
    f"CREATE INDEX IF NOT EXISTS {DELEGATES}_by_process ON {DELEGATES} (process_id)",
    f"CREATE TABLE IF NOT EXISTS {PENDING} (tree_id TEXT NOT NULL, ord INTEGER NOT NULL, "
    "created_position BIGINT NOT NULL, process_id TEXT NOT NULL, wait_id TEXT NOT NULL, tool_call_ref TEXT, "
    "body TEXT NOT NULL, PRIMARY KEY (tree_id, ord))",
    f"CREATE INDEX IF NOT EXISTS {PENDING}_by_created ON {PENDING} (created_position, ord)",
    f"CREATE INDEX IF NOT EXISTS {PENDING}_by_wait ON {PENDING} (wait_id)",
    f"CREATE TABLE IF NOT EXISTS {UNKNOWN} (tree_id TEXT NOT NULL, ord INTEGER NOT NULL, "
    "created_position BIGINT NOT NULL, process_id TEXT NOT NULL, effect_id TEXT NOT NULL, kind TEXT NOT NULL, "
    "tool_call_ref TEXT, body TEXT NOT NULL, PRIMARY KEY (tree_id, ord))",
    f"CREATE INDEX IF NOT EXISTS {UNKNOWN}_by_created ON {UNKNOWN} (created_position, ord)",
    f"CREATE INDEX IF NOT EXISTS {UNKNOWN}_by_effect ON {UNKNOWN} (effect_id)",
    # ``position`` is the tree position where reading failed (as in the listings' entries),
    # ``found_at`` the notification id of the event the follower could not apply.
    f"CREATE TABLE IF NOT EXISTS {CORRUPT} (tree_id TEXT PRIMARY KEY, start_id TEXT, "
    "created_position BIGINT NOT NULL, position BIGINT NOT NULL, rule TEXT NOT NULL, detail TEXT NOT NULL, "
    "found_at BIGINT NOT NULL, body TEXT NOT NULL)",
    f"CREATE INDEX IF NOT EXISTS {CORRUPT}_by_created ON {CORRUPT} (created_position)",
    # Added 2026-12-05: the first follower of a newer release to open tables without it creates it
    # and fills it for every live run (``ReadModels._gates_to_fill``).
    f"CREATE TABLE IF NOT EXISTS {GATES} (tree_id TEXT NOT NULL, ord INTEGER NOT NULL, "
    "created_position BIGINT NOT NULL, process_id TEXT NOT NULL, wait_id TEXT NOT NULL, parent_id TEXT, "
    "body TEXT NOT NULL, PRIMARY KEY (tree_id, ord))",
    f"CREATE INDEX IF NOT EXISTS {GATES}_by_created ON {GATES} (created_position, ord)",
    f"CREATE INDEX IF NOT EXISTS {GATES}_by_wait ON {GATES} (wait_id)",
)

#: Every table and index the DDL creates.
_OBJECTS = tuple(name for statement in _DDL for name in re.findall(r"IF NOT EXISTS (\w+)", statement))


@dataclass(frozen=True, slots=True)
class TreeUpdate:
    """The new rows of one tree after a batch, and how many of its events the batch held."""

    rows: TreeRows
    events: int
    created_position: int


@dataclass(frozen=True, slots=True)
class CorruptTree:
    """A tree the follower could not read: no rows of it in the other tables from then on.

    ``position``, ``rule`` and ``detail`` are the decoder's or the fold's (``CorruptStream``);
    ``start_id`` is the tree index's (None without an index row); ``created_position`` the
    notification id of the tree's first event (0 if unknown); ``found_at`` the notification id
    of the first of its events the follower could not apply (the corrupt event itself, unless
    the damage is in an event it had already applied).
    """

    tree_id: str
    start_id: str | None
    created_position: int
    position: int
    rule: str
    detail: str
    found_at: int

    def entry(self) -> Entry:
        """How a store-wide listing names it (the shape of ``agentfold.adapters.queries.corrupt_tree_entry``)."""
        return {
            "tree_id": self.tree_id,
            "start_id": self.start_id,
            "code": "store.corrupt",
            "position": self.position,
            "rule": self.rule,
            "detail": self.detail,
        }


class ProjectionCrash(BaseException):
    """Raised by a crash hook in tests; never caught by the follower."""


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


# The columns of each row derived from its entry (``body``): the queries filter, order and
# count on them, so ``_write_tree`` writes them from the entry with these functions and
# ``tree_rows_counted`` checks the stored ones against them (``audit verify``). A row's other
# columns: ``tree_id``, ``ord`` (its index in the tree's list), ``created_position`` (the
# run's, on its pending and unknown rows), the run row's follower counters.
RUN_COLUMNS = "start_id, root_process_id, program, status, classification, version, unknown_count, pending_count"
ROUND_COLUMNS = "process_id, model_call_sequence, call_count, entry_count, complete, digest"
DELEGATE_COLUMNS = "process_id, model_call_sequence, tool_call_index, tool_call_ref, child_key, child_process_id"
PENDING_COLUMNS = "process_id, wait_id, tool_call_ref"
UNKNOWN_COLUMNS = "process_id, effect_id, kind, tool_call_ref"
GATE_COLUMNS = "process_id, wait_id, parent_id"


def _run_columns(run: Entry, version: int, unknown: int, pending: int) -> tuple[Any, ...]:
    return (str(run["start_id"]), str(run["root_process_id"]), str(run["program"]), str(run["status"]),
            str(run["classification"]), version, unknown, pending)


def _round_columns(r: Entry) -> tuple[Any, ...]:
    return (r["process_id"], r["model_call_sequence"], r["call_count"], len(r["entries"]), bool(r["complete"]),
            r["digest"])


def _delegate_columns(d: Entry) -> tuple[Any, ...]:
    return (d["process_id"], d["model_call_sequence"], d["tool_call_index"], d["tool_call_ref"], d["child_key"],
            d["child_process_id"])


def _pending_columns(p: Entry) -> tuple[Any, ...]:
    return (p["process_id"], p["wait_id"], p["tool_call_ref"])


def _unknown_columns(u: Entry) -> tuple[Any, ...]:
    return (u["process_id"], u["effect_id"], u["kind"], u["tool_call_ref"])


def _gate_columns(g: Entry) -> tuple[Any, ...]:
    return (g["process_id"], g["wait_id"], g["parent_id"])


def _stored_columns(row: Any, columns: str) -> tuple[Any, ...]:
    """A row's columns as the writer gives them (SQLite stores a boolean as 0/1)."""
    names = [name.strip() for name in columns.split(",")]
    return tuple(bool(row[name]) if name == "complete" else row[name] for name in names)


class _SQLiteTracking(SQLiteTrackingRecorder):
    """eventsourcing's SQLite tracking recorder, on our table name."""

    def __init__(self, datastore: Any) -> None:
        super().__init__(datastore)
        self.insert_tracking_statement = self.insert_tracking_statement.replace(
            "INTO tracking", f"INTO {TRACKING_TABLE}"
        ).replace("WHERE tracking.", f"WHERE {TRACKING_TABLE}.")
        self.select_max_tracking_id_statement = self.select_max_tracking_id_statement.replace(
            "FROM tracking", f"FROM {TRACKING_TABLE}"
        )

    def construct_create_table_statements(self) -> list[str]:
        return [s.replace("EXISTS tracking", f"EXISTS {TRACKING_TABLE}") for s in super().construct_create_table_statements()]


def table_exists(cursor: Any, backend: str, name: str) -> bool:
    """Whether table ``name`` exists in an SQLite or PostgreSQL store (``cursor``: in a transaction)."""
    if backend == "sqlite":
        cursor.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name = ?", (name,))
        return cursor.fetchone() is not None
    cursor.execute("SELECT to_regclass(%s) AS t", (name,))
    row = cursor.fetchone()
    return row is not None and row["t"] is not None


def tracking_recorder(store: EventStore, *, create: bool = True) -> Any:
    """eventsourcing's tracking recorder on ``agentfold_tracking`` in a SQLite or PostgreSQL store
    (one row per follower: the read models, each Kafka publisher), its table created unless not ``create``."""
    if create:
        store.check_writable()  # a store on a read-only file system: said so, not "give this user write access"
    datastore = store.factory.datastore
    if store.backend == "sqlite":
        recorder: Any = _SQLiteTracking(datastore)
    else:
        from eventsourcing.postgres import PostgresTrackingRecorder  # psycopg: PostgreSQL stores only

        recorder = PostgresTrackingRecorder(datastore, tracking_table_name=TRACKING_TABLE)
    if create:
        with store.schema_lock():  # eventsourcing decides on its migration row before its transaction
            recorder.create_table()
    return recorder


class PositionMoved(IntegrityError):
    """A batch's compare-and-set of the tracking position found another position: another
    follower (or a rebuild's reset) committed since the batch was read, and nothing of it was
    written. Only this is retried: any other constraint failure of a batch is a fault that
    would fail every retry the same way."""


class ReadModels:
    """The read-model tables of one store, their tracking position, and their queries.

    ``create=False``: the tables exist (``exist``) and are only read; no DDL is run, so a
    role that may only read can query them.
    """

    def __init__(self, store: EventStore, *, create: bool = True) -> None:
        if store.backend not in ("sqlite", "postgresql"):
            raise InvalidInput(
                "projection.store_unsupported",
                f"read models live in the store's database; a {store.backend} store has none",
                hint="use a sqlite:/// or postgresql:// store (hosts of a memory store fold instead)",
            )
        self.store = store
        self.backend = store.backend
        datastore = store.factory.datastore
        self.datastore = datastore
        self.tracking = tracking_recorder(store, create=create)
        # Tables a release added after the first (created below; a reader looks: ``_has_table``).
        self._tables_seen: set[str] = {CORRUPT, GATES} if create else set()
        if not create or not self._missing():
            return
        fill = self._gates_to_fill()
        with datastore.transaction(commit=True) as c:
            if self.backend == "postgresql":
                c.execute("SELECT pg_advisory_xact_lock(7406170101)")  # concurrent first opens
            else:
                # Take SQLite's write lock before reading: a transaction that read first and then
                # writes after another opener's commit fails at once ("database is locked", no busy
                # wait). Nothing has been done since eventsourcing's BEGIN.
                c.execute("COMMIT")
                c.execute("BEGIN IMMEDIATE")
            if not self._missing(c):
                return  # another opener created them while this one waited for the lock
            had_gates = table_exists(c, self.backend, GATES)
            for statement in _DDL:
                c.execute(self._sql(statement))
            if fill and not had_gates:
                for tree_id, created_position, gates in fill:
                    c.execute(self._sql(f"DELETE FROM {GATES} WHERE tree_id = ?"), (tree_id,))
                    self._insert_gates(c, tree_id, created_position, gates)

    def _gates_to_fill(self) -> list[tuple[str, int, list[Entry]]]:
        """The InputGates table's rows of every live run, when the tables exist without it (an
        older follower created them): each run's gates as of the version its run row reflects,
        folded from the store. The table is created and filled in one transaction, so a reader
        never takes an empty table for "no gate waits". Its later rows come with the follower's
        batches, as every table's. A run that cannot be read is left without rows (logged): the
        follower records it corrupt when it reads it, and ``audit verify`` reports it."""
        with self.datastore.transaction(commit=False) as c:
            if not table_exists(c, self.backend, RUNS) or table_exists(c, self.backend, GATES):
                return []
            c.execute(self._sql(f"SELECT tree_id, version, created_position FROM {RUNS} WHERE classification <> ? "
                                "ORDER BY created_position"), ("terminal",))
            runs = [(str(r["tree_id"]), int(r["version"]), int(r["created_position"])) for r in c.fetchall()]
        fill = []
        for tree_id, version, created_position in runs:
            try:
                state = self.store.load(TreeID(tree_id), upto=version).state
            except (CorruptStream, NotFound) as exc:
                log.warning("read models: tree %s has no InputGate rows (it cannot be read: %s)", tree_id, exc)
                continue
            gates = [gate.to_json() for gate in gate_inputs(state)]
            if gates:
                fill.append((tree_id, created_position, gates))
        return fill

    def _missing(self, cursor: Any = None) -> bool:
        """Whether a table or index of the read models is missing (the DDL has to run).

        The DDL runs only then: on PostgreSQL ``CREATE INDEX IF NOT EXISTS`` takes a SHARE lock
        on its table even when the index exists, and a follower starting (or restarting after a
        failure) while another follower commits a batch deadlocked with it."""
        if cursor is None:
            with self.datastore.transaction(commit=False) as c:
                return self._missing(c)
        if self.backend == "sqlite":
            marks = ",".join("?" * len(_OBJECTS))
            cursor.execute(f"SELECT count(*) AS n FROM sqlite_master WHERE name IN ({marks})", _OBJECTS)
        else:
            cursor.execute("SELECT count(to_regclass(n)) AS n FROM unnest(%s::text[]) AS n", (list(_OBJECTS),))
        row = cursor.fetchone()
        return row is None or int(row["n"]) < len(_OBJECTS)

    def _sql(self, statement: str) -> str:
        # The tables live in the connection's default schema (PostgreSQL: public, as the events).
        return statement if self.backend == "sqlite" else statement.replace("?", "%s")

    @staticmethod
    @on_a_live_connection
    def exist(store: EventStore) -> bool:
        """Whether a follower ever created the tables in this store (without creating them)."""
        if store.backend not in ("sqlite", "postgresql"):
            return False
        datastore = store.factory.datastore
        with datastore.transaction(commit=False) as c:
            return table_exists(c, store.backend, RUNS)

    # -- position ------------------------------------------------------------

    def position(self) -> int:
        """The notification id of the last event the tables reflect (0: none)."""
        return int(self.tracking.max_tracking_id(APPLICATION) or 0)

    def is_current(self) -> bool:
        return self.position() >= self.store.max_notification_id()

    def wait_for(self, position: int, timeout: float = 5.0, interval: float = 0.01) -> bool:
        """Wait until the tables reflect ``position`` (read your own writes); False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            if self.position() >= position:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(interval)

    # -- writes --------------------------------------------------------------

    def write(
        self,
        updates: Sequence[TreeUpdate],
        notification_id: int,
        *,
        after: int,
        corrupt: Sequence[CorruptTree] = (),
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        """Replace the rows of every updated tree, record the trees found corrupt (dropping
        every row they had) and move the tracking position from ``after`` (the position the
        batch was read from) to ``notification_id``, atomically.

        The position is compared and set **first**, so the transaction holds the tracking
        row from its first statement on: writers of the tables (several followers, a
        rebuild's reset) take turns, and a batch read from a position that is no longer the
        committed one (another follower committed meanwhile) writes nothing: ``PositionMoved``,
        the whole transaction rolled back. So every notification is applied exactly once,
        whichever follower applies it, and ``events_projected + n`` counts it once.
        """
        with self.datastore.transaction(commit=True) as c:
            self._advance_position(c, after, notification_id)
            for update in updates:
                self._write_tree(c, update, notification_id)
            for found in corrupt:
                self._write_corrupt(c, found)
            if before_commit is not None:
                before_commit()

    def _tracking_table(self) -> str:
        if self.backend == "sqlite":
            return TRACKING_TABLE
        schema = str(getattr(self.datastore, "schema", "") or "public").replace('"', '""')
        return f'"{schema}"."{TRACKING_TABLE}"'  # where eventsourcing's recorder keeps it

    def _advance_position(self, c: Any, after: int, notification_id: int) -> None:
        """Compare-and-set of the tracking position, ``after`` -> ``notification_id``.

        eventsourcing's own tracking upsert only refuses a position that is not greater than
        the stored one: a follower whose batch started at the same position as another's but
        ended further on committed after it, and applied the overlap a second time (rows
        replaced, but ``events_projected`` counted twice; on PostgreSQL, under READ COMMITTED,
        its DELETEs also missed the rows the other had just inserted, so stale rows stayed).
        Here the row must still hold ``after``; the UPDATE (or, from nothing, the INSERT) locks
        it until the commit, and a concurrent writer waits for it, then finds another value.
        """
        table = self._tracking_table()
        if not 0 <= after < notification_id:
            raise InvalidInput("projection.position_invalid",
                               f"a batch must move the position forward, not from {after} to {notification_id}")
        c.execute(
            self._sql(f"UPDATE {table} SET notification_id = ? WHERE application_name = ? AND notification_id = ? "
                      "RETURNING notification_id"),
            (notification_id, APPLICATION, after),
        )
        if c.fetchone() is not None:
            return
        if after == 0:
            # No row yet (a new store, or after a rebuild's reset): the first to insert it wins.
            c.execute(
                self._sql(f"INSERT INTO {table} (application_name, notification_id) VALUES (?, ?) "
                          "ON CONFLICT (application_name) DO NOTHING RETURNING notification_id"),
                (APPLICATION, notification_id),
            )
            if c.fetchone() is not None:
                return
        raise PositionMoved(
            f"tracking position of {APPLICATION} is no longer {after}: another follower committed first "
            f"(batch up to {notification_id} dropped)"
        )

    def _write_tree(self, c: Any, update: TreeUpdate, position: int) -> None:
        rows = update.rows
        tree_id = rows.tree_id
        run = rows.run
        sql = self._sql
        for table in (ROUNDS, DELEGATES, PENDING, UNKNOWN, GATES):
            c.execute(sql(f"DELETE FROM {table} WHERE tree_id = ?"), (tree_id,))
        c.execute(
            sql(
                f"INSERT INTO {RUNS} (tree_id, {RUN_COLUMNS}, events_projected, created_position, position, body) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (tree_id) DO UPDATE SET status = excluded.status, "
                "classification = excluded.classification, version = excluded.version, "
                f"events_projected = {RUNS}.events_projected + excluded.events_projected, "
                "position = excluded.position, unknown_count = excluded.unknown_count, "
                "pending_count = excluded.pending_count, body = excluded.body"
            ),
            (
                tree_id, *_run_columns(run, rows.version, len(rows.unknown), len(rows.pending)), update.events,
                update.created_position, position, _dumps(run),
            ),
        )
        self._insert(c, ROUNDS, f"tree_id, ord, {ROUND_COLUMNS}, body",
                     [(tree_id, i, *_round_columns(r), _dumps(r)) for i, r in enumerate(rows.rounds)])
        self._insert(c, DELEGATES, f"tree_id, ord, {DELEGATE_COLUMNS}, body",
                     [(tree_id, i, *_delegate_columns(d), _dumps(d)) for i, d in enumerate(rows.delegates)])
        self._insert(c, PENDING, f"tree_id, ord, created_position, {PENDING_COLUMNS}, body",
                     [(tree_id, i, update.created_position, *_pending_columns(p), _dumps(p))
                      for i, p in enumerate(rows.pending)])
        self._insert(c, UNKNOWN, f"tree_id, ord, created_position, {UNKNOWN_COLUMNS}, body",
                     [(tree_id, i, update.created_position, *_unknown_columns(u), _dumps(u))
                      for i, u in enumerate(rows.unknown)])
        self._insert_gates(c, tree_id, update.created_position, rows.gates)

    def _insert_gates(self, c: Any, tree_id: str, created_position: int, gates: Sequence[Entry]) -> None:
        self._insert(c, GATES, f"tree_id, ord, created_position, {GATE_COLUMNS}, body",
                     [(tree_id, i, created_position, *_gate_columns(g), _dumps(g)) for i, g in enumerate(gates)])

    def _write_corrupt(self, c: Any, found: CorruptTree) -> None:
        # Its rows reflect a history that cannot be read from here on: a listing must never
        # serve them (it names the tree instead), whatever version they were projected at.
        for table in TREE_TABLES:
            c.execute(self._sql(f"DELETE FROM {table} WHERE tree_id = ?"), (found.tree_id,))
        # DO NOTHING: a tree is recorded once (its later events are skipped); batches are
        # applied one at a time and exactly once (``_advance_position``), so this is a guard.
        c.execute(
            self._sql(
                f"INSERT INTO {CORRUPT} (tree_id, start_id, created_position, position, rule, detail, found_at, body) "
                "VALUES (?,?,?,?,?,?,?,?) ON CONFLICT (tree_id) DO NOTHING"
            ),
            (found.tree_id, found.start_id, found.created_position, found.position, found.rule, found.detail,
             found.found_at, _dumps(found.entry())),
        )

    def _insert(self, c: Any, table: str, columns: str, rows: list[tuple[Any, ...]]) -> None:
        if not rows:
            return
        marks = ",".join("?" * (columns.count(",") + 1))
        statement = self._sql(f"INSERT INTO {table} ({columns}) VALUES ({marks})")
        c.executemany(statement, rows)

    def reset(self) -> None:
        """Empty every table and forget the tracking position (before a rebuild), atomically.

        The tracking row goes first, so the reset waits for a follower's batch in progress
        (which holds that row) and every follower's next batch then fails its compare-and-set
        and starts again from the tables' position (zero, or what the rebuild reached)."""
        with self.datastore.transaction(commit=True) as c:
            c.execute(self._sql(f"DELETE FROM {self._tracking_table()} WHERE application_name = ?"), (APPLICATION,))
            for table in TABLES:
                c.execute(self._sql(f"DELETE FROM {table} WHERE 1 = 1"))

    # -- queries ---------------------------------------------------------------

    @on_a_live_connection
    def _bodies(self, statement: str, params: Iterable[Any] = ()) -> list[Entry]:
        with self.datastore.transaction(commit=False) as c:
            c.execute(self._sql(statement), tuple(params))
            rows = c.fetchall()
        return [orjson.loads(r["body"]) for r in rows]

    @on_a_live_connection
    def runs(self, *, status: str | None = None, classification: str | None = None, limit: int = 100,
             after: int = 0) -> list[Entry]:
        """Runs in creation order, after the run created at ``after`` (a page cursor)."""
        where = ["created_position > ?"]
        params: list[Any] = [after]
        if status is not None:
            where.append("status = ?")
            params.append(status)
        if classification is not None:
            where.append("classification = ?")
            params.append(classification)
        statement = (
            f"SELECT body, created_position FROM {RUNS} WHERE {' AND '.join(where)} ORDER BY created_position LIMIT ?"
        )
        with self.datastore.transaction(commit=False) as c:
            c.execute(self._sql(statement), (*params, limit))
            rows = c.fetchall()
        return [{**orjson.loads(r["body"]), "cursor": int(r["created_position"])} for r in rows]

    def run(self, tree_id: str) -> Entry | None:
        found = self._bodies(f"SELECT body FROM {RUNS} WHERE tree_id = ?", (tree_id,))
        return found[0] if found else None

    @on_a_live_connection
    def created_position(self, tree_id: str) -> int:
        """The notification id of the event that created the tree (0 if it has no row yet)."""
        with self.datastore.transaction(commit=False) as c:
            c.execute(self._sql(f"SELECT created_position FROM {RUNS} WHERE tree_id = ?"), (tree_id,))
            row = c.fetchone()
        return int(row["created_position"]) if row else 0

    def rounds(self, tree_id: str) -> list[Entry]:
        return self._bodies(f"SELECT body FROM {ROUNDS} WHERE tree_id = ? ORDER BY ord", (tree_id,))

    def delegates(self, process_id: str) -> list[Entry]:
        return self._bodies(f"SELECT body FROM {DELEGATES} WHERE process_id = ? ORDER BY ord", (process_id,))

    def pending(self, tree_id: str | None = None, *, limit: int | None = None, after: int = 0) -> list[Entry]:
        if tree_id is not None:
            return self._bodies(f"SELECT body FROM {PENDING} WHERE tree_id = ? ORDER BY ord", (tree_id,))
        statement = f"SELECT body FROM {PENDING} WHERE created_position > ? ORDER BY created_position, ord"
        params: tuple[Any, ...] = (after,)
        if limit is not None:
            statement += " LIMIT ?"
            params = (after, limit)
        return self._bodies(statement, params)

    @on_a_live_connection
    def ordered(self, table: str, *, after: tuple[int, int] | None = None, limit: int | None = None,
                created: int | None = None) -> list[tuple[int, int, str, Entry]]:
        """Rows of the pending, unknown or gates table as (created_position, ord, tree_id, entry), in
        that order: every row, the first ``limit`` after the key ``after`` (created_position,
        ord), or the rows of the run created at ``created``."""
        if table not in (PENDING, UNKNOWN, GATES):
            raise ValueError(table)
        statement = f"SELECT created_position, ord, tree_id, body FROM {table}"
        params: list[Any] = []
        if created is not None:
            statement += " WHERE created_position = ?"
            params.append(created)
        elif after is not None:
            statement += " WHERE (created_position, ord) > (?, ?)"
            params += after
        statement += " ORDER BY created_position, ord"
        if limit is not None:
            statement += " LIMIT ?"
            params.append(limit)
        with self.datastore.transaction(commit=False) as c:
            c.execute(self._sql(statement), tuple(params))
            rows = c.fetchall()
        return [(int(r["created_position"]), int(r["ord"]), str(r["tree_id"]), orjson.loads(r["body"])) for r in rows]

    def pending_wait(self, wait_id: str) -> Entry | None:
        found = self._bodies(f"SELECT body FROM {PENDING} WHERE wait_id = ?", (wait_id,))
        return found[0] if found else None

    def gates(self, tree_id: str) -> list[Entry]:
        return self._bodies(f"SELECT body FROM {GATES} WHERE tree_id = ? ORDER BY ord", (tree_id,))

    def unknown(self, tree_id: str | None = None) -> list[Entry]:
        if tree_id is not None:
            return self._bodies(f"SELECT body FROM {UNKNOWN} WHERE tree_id = ? ORDER BY ord", (tree_id,))
        return self._bodies(f"SELECT body FROM {UNKNOWN} ORDER BY created_position, ord")

    def tree_rows(self, tree_id: str) -> dict[str, Any]:
        """Everything stored about one tree, shaped like ``TreeRows.to_json()`` (for checks),
        as of one moment (``tree_rows_counted``)."""
        return self.tree_rows_counted(tree_id)[0]

    @on_a_live_connection
    def tree_rows_counted(
        self, tree_id: str, created: int | None = None,
    ) -> tuple[dict[str, Any], tuple[int, int] | None, list[str]]:
        """``tree_rows``, ``counter`` and the faults of the rows' other columns, read in one
        transaction that sees one moment: a follower writes a tree's rows in one transaction,
        and rows read in several (a run row at version 200, rounds a commit later) are no state
        the tree ever had, which ``audit verify`` would report as a mismatch. SQLite's read
        transaction in WAL mode sees one snapshot; PostgreSQL's needs REPEATABLE READ (READ
        COMMITTED takes one per statement).

        A fault: a column the queries filter, order or count on that does not say what the
        row's entry says (``_run_columns`` and the others: the writer's own functions), an
        ``ord`` out of sequence, a run row whose ``created_position`` is not ``created`` (the
        log position of the tree's first event, when the caller read it), a pending or unknown
        row whose ``created_position`` is not its run's (listings page by it). The entries alone
        would not show such damage, and the queries would answer wrongly (a delegate attribution
        lost, a wait listed twice, runs listed out of order)."""
        faults: list[str] = []
        with self.datastore.transaction(commit=False) as c:
            if self.backend == "postgresql":
                c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            c.execute(self._sql(f"SELECT * FROM {RUNS} WHERE tree_id = ?"), (tree_id,))
            row = c.fetchone()
            run = orjson.loads(row["body"]) if row is not None else None
            counted = None if row is None else (int(row["version"]), int(row["events_projected"]))
            if row is not None and created is not None and row["created_position"] != created:
                faults.append(f"{RUNS}: created_position {row['created_position']} is not the log position of the "
                              f"tree's first event ({created})")
            if created is None and row is not None:
                created = row["created_position"]

            def bodies(table: str, columns: str, derive: Callable[[Entry], tuple[Any, ...]], *,
                       positioned: bool = False) -> list[Entry]:
                c.execute(self._sql(f"SELECT * FROM {table} WHERE tree_id = ? ORDER BY ord"), (tree_id,))
                entries = []
                for index, stored in enumerate(c.fetchall()):
                    entry = orjson.loads(stored["body"])
                    entries.append(entry)
                    where = f"{table} ord {stored['ord']}"
                    if stored["ord"] != index:
                        faults.append(f"{where}: ord is not {index} (the rows of a tree are numbered from 0)")
                    try:
                        expected = derive(entry)
                    except (KeyError, TypeError):
                        continue  # the entry itself differs from the projection: reported as such
                    if _stored_columns(stored, columns) != expected:
                        faults.append(f"{where}: the columns ({columns}) do not say what its entry says")
                    if positioned and stored["created_position"] != created:
                        faults.append(f"{where}: created_position {stored['created_position']} is not its run's "
                                      f"({created}, the log position of the tree's first event)")
                return entries

            if row is not None and run is not None:
                try:
                    derived: tuple[Any, ...] | None = _run_columns(run, run["version"], 0, 0)[:6]  # counts: below
                except (KeyError, TypeError):
                    derived = None  # the entry itself differs from the projection: reported as such
                if derived is not None and _stored_columns(row, RUN_COLUMNS)[:6] != derived:
                    faults.append(f"{RUNS}: the columns (start_id ... version) do not say what its entry says")
            pending = bodies(PENDING, PENDING_COLUMNS, _pending_columns, positioned=True)
            unknown = bodies(UNKNOWN, UNKNOWN_COLUMNS, _unknown_columns, positioned=True)
            has_gates = self._has_table(GATES, c)  # in this transaction, which sees one moment
            gates = bodies(GATES, GATE_COLUMNS, _gate_columns, positioned=True) if has_gates else None
            rows = {
                "tree_id": tree_id,
                "version": run["version"] if run is not None else 0,
                "run": run,
                "rounds": bodies(ROUNDS, ROUND_COLUMNS, _round_columns),
                "delegates": bodies(DELEGATES, DELEGATE_COLUMNS, _delegate_columns),
                "pending": pending,
                "unknown": unknown,
                "gates": gates,
            }
            if row is not None and (row["unknown_count"], row["pending_count"]) != (len(unknown), len(pending)):
                faults.append(f"{RUNS}: unknown_count {row['unknown_count']} and pending_count {row['pending_count']} "
                              f"are not the tree's {len(unknown)} unknown and {len(pending)} pending rows")
        return rows, counted, faults

    @on_a_live_connection
    def tree_ids_with_rows(self) -> set[str]:
        """Every tree id any read-model table holds a row of (``audit verify --all`` looks for rows
        of trees the store does not have)."""
        tables = [RUNS, ROUNDS, DELEGATES, PENDING, UNKNOWN] + ([GATES] if self.has_gates() else []) + (
            [CORRUPT] if self._corrupt_table_exists() else [])
        with self.datastore.transaction(commit=False) as c:
            c.execute(self._sql(" UNION ".join(f"SELECT DISTINCT tree_id FROM {table}" for table in tables)))
            return {str(r["tree_id"]) for r in c.fetchall()}

    @on_a_live_connection
    def corrupt_trees(self) -> list[CorruptTree]:
        """The trees the follower found corrupt, in creation order (oldest run first)."""
        if not self._corrupt_table_exists():
            return []  # tables written by a follower older than this table: none recorded
        with self.datastore.transaction(commit=False) as c:
            c.execute(self._sql(
                f"SELECT tree_id, start_id, created_position, position, rule, detail, found_at FROM {CORRUPT} "
                "ORDER BY created_position, tree_id"))
            rows = c.fetchall()
        return [
            CorruptTree(str(r["tree_id"]), None if r["start_id"] is None else str(r["start_id"]),
                        int(r["created_position"]), int(r["position"]), str(r["rule"]), str(r["detail"]),
                        int(r["found_at"]))
            for r in rows
        ]

    def has_gates(self) -> bool:
        """Whether the tables hold InputGates: a reader may open tables an older follower
        created without that table (it is created, and filled, by the first newer follower)."""
        return self._has_table(GATES)

    def _corrupt_table_exists(self) -> bool:
        return self._has_table(CORRUPT)

    def _has_table(self, name: str, cursor: Any = None) -> bool:
        """Whether table ``name`` exists: a reader (create=False) may open tables an older
        follower created without it; once it exists it stays, so a yes is remembered
        (``cursor``: look in that transaction)."""
        if name in self._tables_seen:
            return True
        found = self._look_for_table(name) if cursor is None else table_exists(cursor, self.backend, name)
        if found:
            self._tables_seen.add(name)
        return found

    @on_a_live_connection
    def _look_for_table(self, name: str) -> bool:
        with self.datastore.transaction(commit=False) as c:
            return table_exists(c, self.backend, name)

    @on_a_live_connection
    def counter(self, tree_id: str) -> tuple[int, int] | None:
        """One tree's (version its run row reflects, events the followers applied to it), or
        None without a run row; they are equal unless an event was applied twice or skipped."""
        with self.datastore.transaction(commit=False) as c:
            c.execute(self._sql(f"SELECT version, events_projected FROM {RUNS} WHERE tree_id = ?"), (tree_id,))
            row = c.fetchone()
        return None if row is None else (int(row["version"]), int(row["events_projected"]))

    @on_a_live_connection
    def counters(self) -> dict[str, tuple[int, int]]:
        """Per tree with a run row: (version the row reflects, events the follower applied to it).

        A corrupt tree (``corrupt_trees``) has no run row, so no counters: none of its
        events count once it is found corrupt, and the rows it had are dropped."""
        with self.datastore.transaction(commit=False) as c:
            c.execute(self._sql(f"SELECT tree_id, version, events_projected FROM {RUNS}"))
            return {str(r["tree_id"]): (int(r["version"]), int(r["events_projected"])) for r in c.fetchall()}


def crash_hook_from_env() -> Callable[[int], Callable[[], None] | None]:
    """``AGENTFOLD_FOLLOWER_CRASH=view-written:N``: die after writing the N-th batch's views
    (and its tracking position), before the commit (real process death, for the follower
    crash tests)."""
    spec = os.environ.get("AGENTFOLD_FOLLOWER_CRASH", "")
    if not spec:
        return lambda batch: None
    kind, _, n = spec.partition(":")
    if kind != "view-written" or not (n.isascii() and n.isdigit()):
        raise InvalidInput("projection.crash_spec", f"AGENTFOLD_FOLLOWER_CRASH={spec!r} is not view-written:N")
    target = int(n)

    def hook(batch: int) -> Callable[[], None] | None:
        if batch != target:
            return None

        def die() -> None:
            os._exit(75)

        return die

    return hook

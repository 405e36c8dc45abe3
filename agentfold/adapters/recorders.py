"""eventsourcing application recorders that also keep the tree index, atomically.

Every append writes the tree's events and, in the same transaction, upserts one row
of ``agentfold_trees`` (the tree's head: version, head digest, root status,
classification, unknown effect ids) and inserts one row of ``agentfold_processes``
per new Process. The index is therefore never ahead of or behind the events, and it
anchors the digest chain: a truncated stream no longer reaches the recorded head.

Tables (documented in docs/read-models.md):

* ``agentfold_events``  (eventsourcing's events table; notification ids are the feed order)
* ``agentfold_snapshots`` (folded tree states, so a long tree loads without folding from zero)
* ``agentfold_trees``, ``agentfold_processes`` (the index described above)
"""

from __future__ import annotations

import collections
import functools
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar
from uuid import UUID

import orjson
from eventsourcing.persistence import (
    ConnectionPoolClosedError,
    InterfaceError,
    Notification,
    OperationalError,
    StoredEvent,
)
from eventsourcing.popo import POPOAggregateRecorder, POPOApplicationRecorder
from eventsourcing.sqlite import (
    SQLITE3_DEFAULT_LOCK_TIMEOUT,
    SQLiteAggregateRecorder,
    SQLiteApplicationRecorder,
    SQLiteConnection,
    SQLiteConnectionPool,
    SQLiteCursor,
)

from agentfold.adapters.codec import PATCHED_START_TOPIC

P = ParamSpec("P")
R = TypeVar("R")

EVENTS_TABLE = "agentfold_events"
SNAPSHOTS_TABLE = "agentfold_snapshots"
TREES_TABLE = "agentfold_trees"
PROCESSES_TABLE = "agentfold_processes"


@dataclass(frozen=True, slots=True)
class TreeHead:
    """One row of ``agentfold_trees``."""

    tree_id: str
    start_id: str
    root_process_id: str
    program: str
    status: str
    classification: str
    version: int
    head_digest: str
    unknown_effect_ids: tuple[str, ...] = ()
    created_at: str = ""
    updated_at: str = ""
    new_processes: tuple[str, ...] = field(default=(), compare=False)
    #: Only ``version``, ``head_digest`` and ``updated_at`` differ from the row the same writer
    #: stored with its previous append (see ``Runtime``): the SQLite update then leaves the
    #: other columns, so the partial indexes on them (``TREES_INDEXES``) are not rewritten.
    progress_only: bool = field(default=False, compare=False)
    #: The ``(version, head_digest)`` the stored row must hold for the append that writes this
    #: one (``version`` 0: no row yet); None writes it whatever the row holds (an import, which
    #: verified the whole history first). A row that anchors a later end than the append's
    #: start means events were deleted or replaced under it: the append is refused
    #: (``IndexHeadMismatch``) instead of chaining onto the damage and erasing its evidence.
    expect: tuple[int, str] | None = field(default=None, compare=False)

    def with_digest(self, head_digest: str, expect: tuple[int, str] | None = None) -> TreeHead:
        """This row with its head digest (what ``dataclasses.replace`` does, a few times cheaper)."""
        return TreeHead(
            self.tree_id, self.start_id, self.root_process_id, self.program, self.status, self.classification,
            self.version, head_digest, self.unknown_effect_ids, self.created_at, self.updated_at, self.new_processes,
            self.progress_only, expect,
        )

    @property
    def row_state(self) -> tuple[str, str, tuple[str, ...]]:
        """What an append changes in the row besides its version, digest and time."""
        return self.status, self.classification, self.unknown_effect_ids

    def to_json(self) -> dict[str, Any]:
        return {
            "tree_id": self.tree_id,
            "start_id": self.start_id,
            "root_process_id": self.root_process_id,
            "program": self.program,
            "status": self.status,
            "classification": self.classification,
            "version": self.version,
            "head_digest": self.head_digest,
            "unknown_effect_ids": list(self.unknown_effect_ids),
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }

    def row(self) -> tuple[Any, ...]:
        return (
            self.tree_id, self.start_id, self.root_process_id, self.program, self.status, self.classification,
            self.version, self.head_digest, orjson.dumps(list(self.unknown_effect_ids)).decode(),
            self.created_at or self.updated_at, self.updated_at,
        )


def head_params(head: TreeHead) -> list[str]:
    """The ``p_head`` argument of PostgreSQL's append function: the row, then what it must hold."""
    values = [str(v) for v in head.row()]
    if head.expect is not None:
        values += [str(head.expect[0]), head.expect[1]]
    return values


class IndexHeadMismatch(Exception):
    """The tree's index row does not anchor the end an append starts from (its
    ``TreeHead.expect``): the stream under it was cut or changed; nothing was written."""

    def __init__(self, tree_id: str, expected: tuple[int, str], stored: tuple[int, str] | None) -> None:
        super().__init__(f"{INDEX_MISMATCH_MARK} {tree_id}")
        self.tree_id = tree_id
        self.expected = expected
        self.stored = stored


#: What PostgreSQL's append function raises when the row does not match (the message).
INDEX_MISMATCH_MARK = "agentfold.index_head_mismatch"
#: PostgreSQL's append function (one statement per append). Releases before 2026-12-01 called
#: ``agentfold_append``, which writes the index row without comparing it.
APPEND_FUNCTION = "agentfold_append_checked"


HEAD_COLUMNS = (
    "tree_id, start_id, root_process_id, program, status, classification, version, head_digest, "
    "unknown_effect_ids, created_at, updated_at"
)


#: The tree index's secondary indexes, as (name, columns and condition). A listing reads its
#: rows in creation order (``HeadFilter``); the live trees (which ``serve`` scans every few
#: seconds for runs nobody owns) and the trees holding unknown Effects (a settlement by
#: Effect id looks its tree up) are a small part of a store that keeps every finished run:
#: each has a partial index, so those reads cost what they find, not the store's size.
#: The conditions are written exactly as the queries write them (SQLite uses a partial
#: index only for a query whose WHERE contains the index's condition). The unknown Effects'
#: index is keyed by the tree id alone: their JSON list grows with the tree (PostgreSQL
#: refuses an index entry over 2,704 bytes, i.e. ~37 unknown Effects).
LIVE_CONDITION = "classification <> 'terminal'"
UNKNOWN_CONDITION = "unknown_effect_ids <> '[]'"
TREES_INDEXES = (
    (f"{TREES_TABLE}_by_created", "(created_at, tree_id)"),
    (f"{TREES_TABLE}_live", f"(created_at, tree_id) WHERE {LIVE_CONDITION}"),
    (f"{TREES_TABLE}_with_unknown", f"(tree_id) WHERE {UNKNOWN_CONDITION}"),
)


def count_live_statements(table: str) -> tuple[str, str]:
    """The live trees per classification, and the live trees holding unknown Effects (a
    finished run keeps its unknown Effects' ids as evidence, but nobody can resolve them)."""
    return (
        f"SELECT classification, count(*) AS n FROM {table} WHERE {LIVE_CONDITION} GROUP BY classification",
        f"SELECT count(*) AS n FROM {table} WHERE {UNKNOWN_CONDITION} AND {LIVE_CONDITION}",
    )


#: The Processes' index by tree: ``audit verify`` reads a tree's rows of ``agentfold_processes``
#: to find those naming a Process its history lacks. Written only when a Process is created.
PROCESSES_INDEXES = ((f"{PROCESSES_TABLE}_by_tree", "(tree_id, process_id)"),)


#: The events' partial index: the inputs stored as changes (``EffectDeclared@2``, a
#: team's Turns), by tree and position. A load of a tree whose snapshot is of format 3 asks
#: whether its history holds one up to the snapshot (``EventStore.reads_snapshot_format``):
#: without the index that read walked the tree's rows (20 ms at 100,000 events on SQLite).
#: Partial, so it holds only those events and costs other appends nothing but its condition.
PATCHED_START_CONDITION = f"topic = '{PATCHED_START_TOPIC}'"
EVENTS_INDEXES = ((f"{EVENTS_TABLE}_patched_starts", f"(originator_id, originator_version) WHERE {PATCHED_START_CONDITION}"),)
#: Topics a reader may look events up by (``holds_topic``), each written into the query as the
#: index's condition is, so that the planner can prove the index covers it without looking at
#: a parameter's value (PostgreSQL's generic plans do not; SQLite 3.40 does, but 3x slower).
INDEXED_TOPICS = {PATCHED_START_TOPIC: PATCHED_START_CONDITION}


#: Tables whose missing indexes PostgreSQL builds ``CONCURRENTLY`` in an existing store. Not
#: the events table: every append locks it (EXCLUSIVE, which conflicts with a concurrent
#: build's lock), so a concurrent build holds appends just as long, and while it waits for
#: older transactions (a long read, a backup) the appends wait too, until PostgreSQL breaks
#: the cycle as a deadlock. Its index is built plainly in the open's transaction.
CONCURRENT_BUILD_TABLES = (TREES_TABLE, PROCESSES_TABLE)


def index_statements(schema: str = "", *, concurrently: bool = False) -> list[tuple[str, str, bool]]:
    """(index name, its CREATE INDEX statement, whether it is built CONCURRENTLY) for each of
    ``TREES_INDEXES``, ``PROCESSES_INDEXES`` and ``EVENTS_INDEXES``; ``schema`` prefixes the
    table names (PostgreSQL: ``'"public".'``); ``concurrently`` applies to
    ``CONCURRENT_BUILD_TABLES``."""
    statements = []
    for table, indexes in (
        (TREES_TABLE, TREES_INDEXES), (PROCESSES_TABLE, PROCESSES_INDEXES), (EVENTS_TABLE, EVENTS_INDEXES)
    ):
        concurrent = concurrently and table in CONCURRENT_BUILD_TABLES
        for name, spec in indexes:
            how = "CONCURRENTLY " if concurrent else ""
            statements.append((name, f"CREATE INDEX {how}IF NOT EXISTS {name} ON {schema}{table} {spec}", concurrent))
    return statements


def topic_condition(topic: str) -> str:
    """The WHERE condition ``holds_topic`` reads ``topic`` with (``INDEXED_TOPICS``)."""
    try:
        return INDEXED_TOPICS[topic]
    except KeyError:
        raise ValueError(f"events are not looked up by the topic {topic!r}: only by {sorted(INDEXED_TOPICS)}") from None


def head_from_row(row: Any) -> TreeHead:
    """An index row as read. Every writer stores an integer version and a JSON list of ids;
    a row edited by hand into anything else is read as it is, not refused here: a version
    that is no integer is ``MALFORMED_VERSION`` (below every event, as ``select_anchors``
    reads it: a load or an append refuses the tree), unknown Effect ids that are no JSON list
    of text are the column's text as its one id. So listings still show the tree, and
    ``audit verify`` reports the row (``index.head_mismatch``, ``index.row_mismatch``)
    instead of failing on it."""
    version = row["version"]
    if not isinstance(version, int) or isinstance(version, bool):
        version = MALFORMED_VERSION  # 'abc', or 68.5 (SQLite keeps a REAL): int() would truncate it
    raw = row["unknown_effect_ids"]
    try:
        ids = orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError):
        ids = None
    unknown = tuple(ids) if isinstance(ids, list) and all(isinstance(i, str) for i in ids) else (str(raw),)
    return TreeHead(
        str(row["tree_id"]), str(row["start_id"]), str(row["root_process_id"]), str(row["program"]),
        str(row["status"]), str(row["classification"]), version, str(row["head_digest"]),
        unknown, str(row["created_at"]), str(row["updated_at"]),
    )


@dataclass(frozen=True, slots=True)
class HeadFilter:
    """Which index rows a listing wants: not terminal (``live_only``), a root status, a
    classification; only rows after ``after`` (a ``(created_at, tree_id)`` key: the
    index's order); ``last``: only the N most recently created (still oldest first); else
    ``limit`` rows after the first ``offset`` (a page; ``offset`` is read only with ``limit``)."""

    live_only: bool = False
    status: str | None = None
    classification: str | None = None
    last: int | None = None
    offset: int = 0
    limit: int | None = None
    after: tuple[str, str] | None = None

    def sql(self, table: str, mark: str) -> tuple[str, list[Any]]:
        """The SELECT of the rows, in creation order (``mark``: the driver's placeholder)."""
        conditions, params = [], []
        if self.live_only or self.classification not in (None, "terminal"):
            conditions.append(LIVE_CONDITION)  # implied by any other classification: the live index
        if self.status is not None:
            conditions.append(f"status = {mark}")
            params.append(self.status)
        if self.classification is not None:
            conditions.append(f"classification = {mark}")
            params.append(self.classification)
        if self.after is not None:
            conditions.append(f"(created_at, tree_id) > ({mark}, {mark})")
            params += self.after
        sql = f"SELECT {HEAD_COLUMNS} FROM {table}" + (" WHERE " + " AND ".join(conditions) if conditions else "")
        if self.last is None:
            sql += " ORDER BY created_at, tree_id"
            if self.limit is None:
                return sql, params
            return sql + f" LIMIT {mark} OFFSET {mark}", [*params, self.limit, self.offset]
        newest = sql + f" ORDER BY created_at DESC, tree_id DESC LIMIT {mark}"
        return f"SELECT * FROM ({newest}) AS newest ORDER BY created_at, tree_id", [*params, self.last]

    def keeps(self, head: TreeHead) -> bool:
        return (
            (not self.live_only or head.classification != "terminal")
            and (self.status is None or head.status == self.status)
            and (self.classification is None or head.classification == self.classification)
            and (self.after is None or (head.created_at, head.tree_id) > self.after)
        )


#: The version an index row whose version column is not an integer anchors (SQLite keeps
#: whatever a hand edit wrote): below every event, so each is refused as past its end.
MALFORMED_VERSION = -1


class IndexQueries:
    """Queries over the tree index, implemented per backend."""

    def select_heads(self, only: HeadFilter = HeadFilter()) -> list[TreeHead]:
        raise NotImplementedError

    def select_head(self, tree_id: str) -> TreeHead | None:
        raise NotImplementedError

    def select_tree_ids(self) -> list[str]:
        """Every tree id of the index, in creation order (the rows' other columns unread)."""
        raise NotImplementedError

    def count_live(self) -> tuple[dict[str, int], int]:
        """The live trees per classification, and the live trees holding unknown Effects (both
        read from their partial indexes: they cost what they count)."""
        raise NotImplementedError

    def select_anchors(self, tree_ids: Sequence[str]) -> dict[str, tuple[int, str]]:
        """The version and head digest of each tree's index row (trees without one are left out)."""
        raise NotImplementedError

    def tree_of_process(self, process_id: str) -> str | None:
        raise NotImplementedError

    def processes_of_tree(self, tree_id: str) -> list[str]:
        """The Process ids ``agentfold_processes`` indexes under ``tree_id``, in id order."""
        raise NotImplementedError

    def tree_of_unknown_effect(self, effect_id: str) -> str | None:
        raise NotImplementedError

    def holds_topic(self, originator_id: UUID, topic: str, upto: int) -> bool:
        """Whether an event of the tree at a position up to ``upto`` has ``topic`` (no state read);
        ``ValueError`` for a topic that is not indexed (``INDEXED_TOPICS``)."""
        raise NotImplementedError

    def select_changes(self, after: int, upto: int, limit: int) -> list[tuple[str | None, int, int, int, int]]:
        """Which trees the first ``limit`` events after notification ``after`` (up to ``upto``)
        belong to, without reading their states: per tree (uuid hex), its first notification id
        there, its lowest and highest position there, and its last notification id there."""
        raise NotImplementedError

    def select_tree_notifications(self, tree_hex: str, from_version: int, limit: int) -> list[Notification]:
        """One tree's events from position ``from_version`` on, in position order (at most
        ``limit``), with their notification ids."""
        raise NotImplementedError

    def select_position_before(self, tree_hex: str, notification_id: int) -> int:
        """The highest position of one tree among the notifications before ``notification_id`` (0: none)."""
        raise NotImplementedError

    def select_raw_notifications(self, after: int, limit: int) -> list[Notification]:
        """The notifications after ``after`` (at most ``limit``) with their columns as stored,
        not converted: a row changed by hand (a NULL or malformed column) is still returned,
        for its reader to name it (eventsourcing's own read raises on it)."""
        raise NotImplementedError


# ---------------------------------------------------------------------------
# SQLite


#: Prepared statements each SQLite connection keeps (sqlite3's default is 128).
SQLITE_STATEMENT_CACHE = 128


#: Every read-write SQLite connection commits with a sync of the WAL: an append has reached the
#: disk before it returns, so before any Effect it permits is dispatched. SQLite's default for
#: WAL mode is a build option (``SQLITE_DEFAULT_WAL_SYNCHRONOUS``); some builds use NORMAL, which
#: syncs only at checkpoints: a power loss would then drop acknowledged appends, and a tool whose
#: permission was dropped could be called again after the restart. Set per connection (a
#: connection's own setting), whatever the build's default.
SQLITE_DURABLE_COMMITS = "PRAGMA synchronous=FULL"


class _SQLiteCursor(SQLiteCursor):
    """eventsourcing's cursor, with nothing to close once its connection is closed."""

    def __init__(self, sqlite_cursor: sqlite3.Cursor, connection: SQLiteConnection) -> None:
        super().__init__(sqlite_cursor)
        self._connection = connection

    def __exit__(self, *args: object, **kwargs: Any) -> None:
        if not self._connection.closed:
            super().__exit__(*args, **kwargs)


class _SQLiteConnection(SQLiteConnection):
    """eventsourcing's SQLite connection, with nothing to close or roll back once it is closed:
    a command ending on Ctrl-C while a call waits for another process's write lock closes its
    store (and the connection in use) under the call, whose cleanup then raised "Cannot operate
    on a closed database" (printed as a traceback after the command's one error line). Closing
    the connection closed its cursors, and SQLite rolled the transaction back."""

    def cursor(self) -> SQLiteCursor:
        return _SQLiteCursor(self._sqlite_conn.cursor(), self)

    def rollback(self) -> None:
        if not self.closed:
            super().rollback()


class StatementCachingSQLitePool(SQLiteConnectionPool):
    """eventsourcing's SQLite connections, with a statement cache that holds an append's statements.

    eventsourcing 9.5 opens its connections with ``cached_statements=True``, which sqlite3
    reads as a cache of ONE statement: every append prepared BEGIN, the event INSERT and the
    index upsert again (~15 us per append, measured with scripts/bench). Its connections
    also commit durably whatever SQLite's build says (``SQLITE_DURABLE_COMMITS``). Everything
    else is as the library does it: autocommit (explicit BEGIN), WAL, ``sqlite3.Row`` rows.
    """

    #: ``file:`` URI the connections open instead of ``db_name`` (a store read on a read-only file
    #: system: ``EventStore`` sets it, see ``sqlite_read_only_uri``); None: the file, read-write.
    connect_uri: str | None = None

    def _create_connection(self) -> SQLiteConnection:
        read_only = self.connect_uri is not None  # nothing to create, switch or watch: it only reads
        if not read_only and getattr(self, "_opened_once", False) and not self.is_sqlite_memory_mode and not os.path.exists(self.db_name):
            # The store file was removed while this process had it open: a new connection would
            # create an empty file in its place (sqlite3 creates what it does not find), which
            # later writes would go to behind the operator's back (EventStore.check_file).
            raise InterfaceError(f"the SQLite store file {self.db_name} was removed while this process had it open")
        try:
            connection = sqlite3.connect(
                database=self.connect_uri or self.db_name,
                uri=True,
                check_same_thread=False,
                isolation_level=None,
                cached_statements=SQLITE_STATEMENT_CACHE,
                timeout=self.lock_timeout or SQLITE3_DEFAULT_LOCK_TIMEOUT,
            )
        except (sqlite3.Error, TypeError) as exc:
            raise InterfaceError(exc) from exc
        if not read_only and not self.is_sqlite_memory_mode and not self.is_journal_mode_wal:
            try:
                mode = connection.execute("PRAGMA journal_mode").fetchone()[0]
                if str(mode).lower() != "wal":
                    connection.execute("PRAGMA journal_mode=WAL")
                    self.journal_mode_was_changed_to_wal = True
            except sqlite3.Error as exc:  # e.g. "file is not a database": a classified store failure
                connection.close()
                raise InterfaceError(exc) from exc
            self.is_journal_mode_wal = True
        if not read_only and not self.is_sqlite_memory_mode:
            try:
                connection.execute(SQLITE_DURABLE_COMMITS)
            except sqlite3.Error as exc:
                connection.close()
                raise InterfaceError(exc) from exc
        connection.row_factory = sqlite3.Row
        self._opened_once = True
        return _SQLiteConnection(sqlite_conn=connection, max_age=self.max_age)

    def put_connection(self, conn: SQLiteConnection) -> None:
        """As eventsourcing's, except when the store was closed under the call handing ``conn``
        back: a command that ends on Ctrl-C while a call waits for another process's write lock
        closes its store, and the call's cleanup, once the wait ends, met ``Pool is closed``
        (printed as a traceback after the command's one error line). Closing the pool closed
        ``conn`` with the others; there is nothing to give back."""
        try:
            super().put_connection(conn)
        except ConnectionPoolClosedError:
            conn.close()


class _MostRecentFirst(collections.deque[Any]):
    """A pool's idle connections, handed out most recently returned first (both the SQLite
    pool of eventsourcing and psycopg_pool take the oldest from the left and return to the right).

    eventsourcing's pool appends returned connections and pops the oldest: as soon as a
    second connection exists (the runtime's watcher reads the index now and then), a
    tree's consecutive appends alternate between two connections, and each finds the
    other's writes invalidated its page cache (~15 us per append, measured with
    scripts/bench). Popping the oldest of this deque gives the newest.
    """

    def append(self, connection: Any) -> None:
        self.appendleft(connection)


def cache_statements(datastore: Any) -> None:
    """Make ``datastore`` open its SQLite connections with a statement cache (before any is
    open) and hand out the most recently used idle connection first."""
    pool = datastore.pool
    if type(pool) is SQLiteConnectionPool:
        pool.__class__ = StatementCachingSQLitePool
        pool._pool = _MostRecentFirst(pool._pool)


#: Seconds a store call waits for a pooled PostgreSQL connection before it fails
#: (``AGENTFOLD_PG_POOL_WAIT`` sets it).
PG_POOL_WAIT = 30.0


#: Rows per multi-row INSERT of events (a steady-state append has four; a start or a large
#: batch takes several statements).
SQLITE_ROWS_PER_INSERT = 16


_SQLITE_UPSERT = (
    f"INSERT INTO {TREES_TABLE} ({HEAD_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?) "
    "ON CONFLICT(tree_id) DO UPDATE SET status=excluded.status, classification=excluded.classification, "
    "version=excluded.version, head_digest=excluded.head_digest, "
    "unknown_effect_ids=excluded.unknown_effect_ids, updated_at=excluded.updated_at"
)
#: A tree's first append (``TreeHead.expect`` version 0): the row must not exist yet.
_SQLITE_INSERT_FIRST = _SQLITE_UPSERT + f" WHERE {TREES_TABLE}.version = ? AND {TREES_TABLE}.head_digest = ?"
#: Every later append: an UPDATE of the row the append starts from, which must exist (an
#: upsert would re-create a deleted row, and with it the evidence of a cut history).
_SQLITE_UPDATE_EXPECTING = (
    f"UPDATE {TREES_TABLE} SET status = ?, classification = ?, version = ?, head_digest = ?, "
    "unknown_effect_ids = ?, updated_at = ? WHERE tree_id = ? AND version = ? AND head_digest = ?"
)
_SQLITE_UPDATE_PROGRESS_EXPECTING = (
    f"UPDATE {TREES_TABLE} SET version = ?, head_digest = ?, updated_at = ? "
    "WHERE tree_id = ? AND version = ? AND head_digest = ?"
)


class SQLiteTreeRecorder(SQLiteApplicationRecorder, IndexQueries):
    def __init__(self, datastore: Any, events_table_name: str = EVENTS_TABLE) -> None:
        super().__init__(datastore, events_table_name)
        self._insert_statements: dict[int, str] = {}

    def construct_create_table_statements(self) -> list[str]:
        statements = super().construct_create_table_statements()
        statements.append(
            f"CREATE TABLE IF NOT EXISTS {TREES_TABLE} (tree_id TEXT PRIMARY KEY, start_id TEXT NOT NULL, "
            "root_process_id TEXT NOT NULL, program TEXT NOT NULL, status TEXT NOT NULL, "
            "classification TEXT NOT NULL, version INTEGER NOT NULL, head_digest TEXT NOT NULL, "
            "unknown_effect_ids TEXT NOT NULL, created_at TEXT NOT NULL, updated_at TEXT NOT NULL)"
        )
        statements.append(
            f"CREATE TABLE IF NOT EXISTS {PROCESSES_TABLE} (process_id TEXT PRIMARY KEY, tree_id TEXT NOT NULL)"
        )
        statements += [sql for _, sql, _ in index_statements()]  # an earlier release's store too
        return statements

    def _insert_events(self, c: SQLiteCursor, stored_events: Sequence[StoredEvent], **kwargs: Any) -> Sequence[int] | None:
        ids = self._insert_rows(c, stored_events)
        head: TreeHead | None = kwargs.get("head")
        if head is not None:
            row = head.row()
            if head.expect is None:  # an import: written whatever the row holds
                c.execute(_SQLITE_UPSERT, row)
            elif head.expect[0] == 0:
                c.execute(_SQLITE_INSERT_FIRST, (*row, *head.expect))
            elif head.progress_only:
                # SQLite rewrites an index when the UPDATE sets a column it reads, whatever the
                # value: setting only what moved keeps a steady-state append off the partial indexes.
                c.execute(_SQLITE_UPDATE_PROGRESS_EXPECTING,
                          (head.version, head.head_digest, head.updated_at, head.tree_id, *head.expect))
            else:
                c.execute(_SQLITE_UPDATE_EXPECTING, (head.status, head.classification, head.version, head.head_digest,
                                                     row[8], head.updated_at, head.tree_id, *head.expect))
            if head.expect is not None and c.sqlite_cursor.rowcount != 1:
                # The row anchors another end, or is gone: roll the events back.
                c.execute(f"SELECT version, head_digest FROM {TREES_TABLE} WHERE tree_id = ?", (head.tree_id,))
                found = c.fetchone()
                raise IndexHeadMismatch(head.tree_id, head.expect, (int(found[0]), str(found[1])) if found else None)
            for pid in head.new_processes:
                c.execute(f"INSERT INTO {PROCESSES_TABLE} (process_id, tree_id) VALUES (?, ?)", (pid, head.tree_id))
        snapshot: StoredEvent | None = kwargs.get("snapshot")
        if snapshot is not None:
            originator = snapshot.originator_id.hex  # type: ignore[union-attr]
            c.execute(
                # A row already at this version (planted by hand) is replaced, never a conflict of the events.
                f"INSERT OR REPLACE INTO {SNAPSHOTS_TABLE} (originator_id, originator_version, topic, state) "
                "VALUES (?,?,?,?)",
                (originator, snapshot.originator_version, snapshot.topic, snapshot.state),
            )
            c.execute(
                f"DELETE FROM {SNAPSHOTS_TABLE} WHERE originator_id = ? AND originator_version < ?",
                (originator, snapshot.originator_version),
            )
        return ids

    def _insert_rows(self, c: SQLiteCursor, stored_events: Sequence[StoredEvent]) -> list[int]:
        """Insert the events with one statement per ``SQLITE_ROWS_PER_INSERT`` rows; their
        notification ids (rowids) in order.

        eventsourcing executes one INSERT per event; a steady-state append holds four, and
        each statement execution is ~3 us of the owner's critical path (scripts/bench). The
        rows of one INSERT get consecutive rowids (each is the table's largest plus one, under
        the write lock this transaction holds), so the last one gives them all.
        """
        ids: list[int] = []
        for start in range(0, len(stored_events), SQLITE_ROWS_PER_INSERT):
            chunk = stored_events[start : start + SQLITE_ROWS_PER_INSERT]
            params: list[Any] = []
            for s in chunk:
                originator = s.originator_id
                params += (originator.hex if isinstance(originator, UUID) else originator, s.originator_version, s.topic, s.state)
            statement = self._insert_statements.get(len(chunk))
            if statement is None:
                statement = self._insert_statements[len(chunk)] = (
                    f"INSERT INTO {self.events_table_name} VALUES " + ",".join(["(?,?,?,?)"] * len(chunk))
                )
            c.execute(statement, params)
            last = int(c.lastrowid)
            ids.extend(range(last - len(chunk) + 1, last + 1))
        return ids

    def select_heads(self, only: HeadFilter = HeadFilter()) -> list[TreeHead]:
        sql, params = only.sql(TREES_TABLE, "?")
        with self.datastore.transaction(commit=False) as c:
            c.execute(sql, params)
            return [head_from_row(r) for r in c.fetchall()]

    def select_head(self, tree_id: str) -> TreeHead | None:
        with self.datastore.transaction(commit=False) as c:
            c.execute(f"SELECT {HEAD_COLUMNS} FROM {TREES_TABLE} WHERE tree_id = ?", (tree_id,))
            row = c.fetchone()
        return head_from_row(row) if row else None

    def select_tree_ids(self) -> list[str]:
        with self.datastore.transaction(commit=False) as c:
            c.execute(f"SELECT tree_id FROM {TREES_TABLE} ORDER BY created_at, tree_id")
            return [str(r[0]) for r in c.fetchall()]

    def count_live(self) -> tuple[dict[str, int], int]:
        by_classification, with_unknown = count_live_statements(TREES_TABLE)
        with self.datastore.transaction(commit=False) as c:
            c.execute(by_classification)
            live = {str(r[0]): int(r[1]) for r in c.fetchall()}
            c.execute(with_unknown)
            row = c.fetchone()
        return live, int(row[0]) if row else 0

    def select_anchors(self, tree_ids: Sequence[str]) -> dict[str, tuple[int, str]]:
        out: dict[str, tuple[int, str]] = {}
        with self.datastore.transaction(commit=False) as c:
            for start in range(0, len(tree_ids), 500):
                chunk = list(tree_ids[start : start + 500])
                c.execute(
                    f"SELECT tree_id, version, head_digest FROM {TREES_TABLE} "
                    f"WHERE tree_id IN ({','.join('?' * len(chunk))})",
                    chunk,
                )
                out.update({str(r[0]): (r[1] if isinstance(r[1], int) else MALFORMED_VERSION, str(r[2]))
                            for r in c.fetchall()})
        return out

    def tree_of_process(self, process_id: str) -> str | None:
        with self.datastore.transaction(commit=False) as c:
            c.execute(f"SELECT tree_id FROM {PROCESSES_TABLE} WHERE process_id = ?", (process_id,))
            row = c.fetchone()
        return str(row[0]) if row else None

    def holds_topic(self, originator_id: UUID, topic: str, upto: int) -> bool:
        condition = topic_condition(topic)
        with self.datastore.transaction(commit=False) as c:
            c.execute(f"SELECT 1 FROM {self.events_table_name} WHERE originator_id = ? AND originator_version <= ? "
                      f"AND {condition} LIMIT 1", (originator_id.hex, upto))
            return c.fetchone() is not None

    def processes_of_tree(self, tree_id: str) -> list[str]:
        with self.datastore.transaction(commit=False) as c:
            c.execute(f"SELECT process_id FROM {PROCESSES_TABLE} WHERE tree_id = ? ORDER BY process_id", (tree_id,))
            return [str(r[0]) for r in c.fetchall()]

    def tree_of_unknown_effect(self, effect_id: str) -> str | None:
        with self.datastore.transaction(commit=False) as c:
            c.execute(
                f"SELECT tree_id FROM {TREES_TABLE} WHERE {UNKNOWN_CONDITION} AND unknown_effect_ids LIKE ?",
                (f'%"{effect_id}"%',),
            )
            row = c.fetchone()
        return str(row[0]) if row else None

    def select_changes(self, after: int, upto: int, limit: int) -> list[tuple[str | None, int, int, int, int]]:
        with self.datastore.transaction(commit=False) as c:
            c.execute(
                "SELECT originator_id, MIN(n), MIN(originator_version), MAX(originator_version), MAX(n) FROM "
                f"(SELECT rowid AS n, originator_id, originator_version FROM {self.events_table_name} "
                "WHERE rowid > ? AND rowid <= ? ORDER BY rowid LIMIT ?) GROUP BY originator_id",
                (after, upto, limit),
            )
            # (A NULL id, written by hand, stays None: EventStore.changes names the row.)
            return [(None if r[0] is None else str(r[0]).replace("-", ""), int(r[1]), int(r[2]), int(r[3]), int(r[4]))
                    for r in c.fetchall()]

    def select_tree_notifications(self, tree_hex: str, from_version: int, limit: int) -> list[Notification]:
        with self.datastore.transaction(commit=False) as c:
            c.execute(
                f"SELECT rowid, originator_version, topic, state FROM {self.events_table_name} "
                "WHERE originator_id = ? AND originator_version >= ? ORDER BY originator_version LIMIT ?",
                (tree_hex, from_version, limit),
            )
            return [Notification(originator_id=UUID(hex=tree_hex), originator_version=r[1], topic=r[2], state=r[3],
                                 id=int(r[0])) for r in c.fetchall()]

    def select_raw_notifications(self, after: int, limit: int) -> list[Notification]:
        with self.datastore.transaction(commit=False) as c:
            c.execute(f"SELECT rowid, originator_id, originator_version, topic, state FROM {self.events_table_name} "
                      "WHERE rowid > ? ORDER BY rowid LIMIT ?", (after, limit))
            return [Notification(originator_id=r[1], originator_version=r[2], topic=r[3], state=r[4], id=int(r[0]))
                    for r in c.fetchall()]

    def select_position_before(self, tree_hex: str, notification_id: int) -> int:
        with self.datastore.transaction(commit=False) as c:
            c.execute(f"SELECT max(originator_version) FROM {self.events_table_name} WHERE originator_id = ? AND rowid < ?",
                      (tree_hex, notification_id))
            row = c.fetchone()
            return int(row[0]) if row is not None and isinstance(row[0], int) else 0


class SQLiteSnapshotRecorder(SQLiteAggregateRecorder):
    def __init__(self, datastore: Any) -> None:
        super().__init__(datastore, SNAPSHOTS_TABLE)

    def prune(self, originator_id: Any, below_version: int) -> None:
        """Delete snapshots older than ``below_version`` (a newer one supersedes them)."""
        with self.datastore.transaction(commit=True) as c:
            c.execute(
                f"DELETE FROM {SNAPSHOTS_TABLE} WHERE originator_id = ? AND originator_version < ?",
                (originator_id.hex, below_version),
            )


# ---------------------------------------------------------------------------
# PostgreSQL

#: Attempts of one query or append on dead pooled connections: the pool may hold up to its
#: maximum size (4 + 8 overflow) of idle connections that one server restart ended.
LIVE_CONNECTION_ATTEMPTS = 13


def psycopg_error(exc: BaseException | None, *kinds: str) -> bool:
    """Whether ``exc`` is one of psycopg's error classes ``kinds`` (any of its errors when none
    is named). Never in a process that has not imported psycopg (one on an SQLite store, which
    this module leaves without it): no psycopg error can exist there."""
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and isinstance(exc, tuple(getattr(psycopg, kind) for kind in kinds or ("Error",)))


def on_a_live_connection(fn: Callable[P, R]) -> Callable[P, R]:
    """Call ``fn`` again when it met a dead pooled connection, as eventsourcing retries its own
    PostgreSQL queries.

    A pooled connection whose server session ended (a restart, a failover,
    ``pg_terminate_backend``) fails once and the pool drops it; without this, that failure
    reached the caller: an append stopped its tree. Retrying an append is safe: if the lost
    reply hid a commit, the retry meets the unique (tree, version) key, and the owner finds
    its own events (``EventStore.append`` at the head, ``_Driver._launch_committed`` after
    a reload). Not retried: a pool that could not hand out any connection within its wait
    (the server is down: :class:`NoConnection`, not an ``OperationalError``), which would
    otherwise hold the caller (an owner line, an HTTP request) for minutes; the caller
    reports the failure instead.
    """

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        for attempt in range(1, LIVE_CONNECTION_ATTEMPTS + 1):
            try:
                return fn(*args, **kwargs)
            except (InterfaceError, OperationalError) as exc:
                cause = exc.__cause__
                # Only a PostgreSQL session can die under a pooled connection; a SQLite error
                # (a lock held past its 30 s timeout) would only be waited for again.
                if attempt == LIVE_CONNECTION_ATTEMPTS or not psycopg_error(cause):
                    raise
                time.sleep(0.05)
        raise AssertionError("unreachable")  # pragma: no cover

    return call


# ---------------------------------------------------------------------------
# Memory


class MemoryTreeRecorder(POPOApplicationRecorder, IndexQueries):
    def __init__(self) -> None:
        super().__init__()
        self._heads: dict[str, TreeHead] = {}
        self._processes: dict[str, str] = {}
        self._index_lock = threading.Lock()

    def _update_table(self, stored_events: Sequence[StoredEvent], **kwargs: Any) -> Sequence[int] | None:
        ids = super()._update_table(stored_events, **kwargs)
        head: TreeHead | None = kwargs.get("head")
        if head is not None:
            with self._index_lock:
                previous = self._heads.get(head.tree_id)
                created = previous.created_at if previous else head.updated_at
                self._heads[head.tree_id] = TreeHead(
                    head.tree_id, head.start_id, head.root_process_id, head.program, head.status,
                    head.classification, head.version, head.head_digest, head.unknown_effect_ids,
                    created, head.updated_at,
                )
                for pid in head.new_processes:
                    self._processes[pid] = head.tree_id
        return ids

    def select_heads(self, only: HeadFilter = HeadFilter()) -> list[TreeHead]:
        with self._index_lock:
            heads = sorted((h for h in self._heads.values() if only.keeps(h)), key=lambda h: (h.created_at, h.tree_id))
        if only.last is not None:
            return heads[max(0, len(heads) - only.last) :]
        return heads if only.limit is None else heads[only.offset : only.offset + only.limit]

    def select_head(self, tree_id: str) -> TreeHead | None:
        with self._index_lock:
            return self._heads.get(tree_id)

    def select_tree_ids(self) -> list[str]:
        return [h.tree_id for h in self.select_heads()]

    def count_live(self) -> tuple[dict[str, int], int]:
        with self._index_lock:
            heads = list(self._heads.values())
        live: dict[str, int] = {}
        for head in heads:
            if head.classification != "terminal":
                live[head.classification] = live.get(head.classification, 0) + 1
        return live, sum(1 for head in heads if head.unknown_effect_ids and head.classification != "terminal")

    def select_anchors(self, tree_ids: Sequence[str]) -> dict[str, tuple[int, str]]:
        with self._index_lock:
            return {t: (self._heads[t].version, self._heads[t].head_digest) for t in tree_ids if t in self._heads}

    def tree_of_process(self, process_id: str) -> str | None:
        with self._index_lock:
            return self._processes.get(process_id)

    def holds_topic(self, originator_id: UUID, topic: str, upto: int) -> bool:
        topic_condition(topic)  # the same topics as the other stores
        return any(s.topic == topic for s in self.select_events(originator_id, lte=upto))

    def processes_of_tree(self, tree_id: str) -> list[str]:
        with self._index_lock:
            return sorted(pid for pid, tree in self._processes.items() if tree == tree_id)

    def tree_of_unknown_effect(self, effect_id: str) -> str | None:
        with self._index_lock:
            for head in self._heads.values():
                if effect_id in head.unknown_effect_ids:
                    return head.tree_id
        return None

    def select_changes(self, after: int, upto: int, limit: int) -> list[tuple[str | None, int, int, int, int]]:
        trees: dict[str, list[int]] = {}
        for n in self.select_notifications(after + 1, limit, stop=upto):
            tree = UUID(str(n.originator_id)).hex
            seen = trees.get(tree)
            if seen is None:
                trees[tree] = [n.id, n.originator_version, n.originator_version, n.id]
            else:
                seen[1:] = [min(seen[1], n.originator_version), max(seen[2], n.originator_version), n.id]
        return [(tree, first, low, high, last) for tree, (first, low, high, last) in trees.items()]


class MemorySnapshotRecorder(POPOAggregateRecorder):
    def prune(self, originator_id: Any, below_version: int) -> None:
        """Forget snapshots older than ``below_version`` (they stay in the list, unreachable by id)."""
        with self._database_lock:
            index = self._stored_events_index[str(originator_id)]
            for version in [v for v in index if v < below_version]:
                del index[version]

"""The PostgreSQL recorders of the tree index (agentfold.adapters.recorders has the common
parts, SQLite's and memory's), and what a PostgreSQL store's connection pool is set up with.

A module of its own so that a process on an SQLite store never imports psycopg (about a
tenth of a second of every CLI command): agentfold.adapters.eventstore imports it when it
opens a PostgreSQL store.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any
from uuid import UUID

from eventsourcing.persistence import Notification, PersistenceError, StoredEvent
from eventsourcing.postgres import PostgresAggregateRecorder, PostgresApplicationRecorder
from psycopg.sql import SQL, Composed, Identifier
from psycopg_pool import PoolTimeout
from psycopg_pool.base import AttemptWithBackoff

from agentfold.adapters.eventstore import connect_reason, too_many_connections
from agentfold.adapters.recorders import (
    APPEND_FUNCTION,
    EVENTS_TABLE,
    HEAD_COLUMNS,
    INDEX_MISMATCH_MARK,
    PROCESSES_TABLE,
    SNAPSHOTS_TABLE,
    TREES_TABLE,
    UNKNOWN_CONDITION,
    HeadFilter,
    IndexHeadMismatch,
    IndexQueries,
    TreeHead,
    _MostRecentFirst,
    count_live_statements,
    head_from_row,
    head_params,
    index_statements,
    on_a_live_connection,
    topic_condition,
)
from agentfold.domain.errors import StoreFailure

#: The advisory lock that serializes agentfold's DDL across processes opening one PostgreSQL
#: database at once (session-level; distinct from the transaction-level keys taken inside it).
SCHEMA_LOCK_KEY = 7406170102


@contextlib.contextmanager
def postgres_schema_lock(datastore: Any) -> Iterator[None]:
    """Hold ``SCHEMA_LOCK_KEY`` while this process creates tables in a PostgreSQL database.

    ``CREATE TABLE IF NOT EXISTS`` is not safe against a concurrent identical statement
    (the second fails on ``pg_type_typname_nsp_index``), and eventsourcing's tracking table
    decides whether to insert its ``__migration__`` row before its transaction begins: two
    servers starting together on a new database failed with one of those errors, reported
    as ``store.unavailable``. Under this lock the second finds the tables made.
    """
    with datastore.get_connection() as conn:  # autocommit: the lock outlives the statement
        conn.execute("SELECT pg_advisory_lock(%s)", (SCHEMA_LOCK_KEY,))
        try:
            yield
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (SCHEMA_LOCK_KEY,))


def prefer_recent_connections(datastore: Any) -> None:
    """Make a PostgreSQL datastore's pool hand out its most recently used idle connection.

    psycopg_pool takes the oldest idle connection and returns connections at the other
    end, so a single tree's consecutive appends rotate through every pooled connection,
    and so through as many server processes, each with caches the others' work evicted:
    ~0.12 ms more per append inside the runtime's chain (fsync on, measured with
    scripts/bench). The pool still shrinks to its minimum size after ``max_idle`` as it
    does by itself. Must run before the pool is opened.
    """
    pool = datastore.pool
    idle = getattr(pool, "_pool", None)
    if not isinstance(idle, collections.deque) or idle:
        raise TypeError("prefer_recent_connections needs an unopened psycopg_pool pool")
    pool._pool = _MostRecentFirst(idle)



class NoConnection(StoreFailure, PersistenceError):
    """The connection pool handed out no PostgreSQL connection within its wait: the server
    is down or unreachable, or every pooled connection stayed busy. Nothing was sent.

    A ``StoreFailure`` (``store.unavailable``, HTTP 503, exit 1) that is also a library
    ``PersistenceError`` (what code around eventsourcing catches), but NOT one of the
    ``InterfaceError``/``OperationalError`` that eventsourcing retries: its recorders retry
    those up to 10 times, and a pool timeout retried so held a request for 5 minutes
    (``GET /runs`` answered its 503 after 152 s during an outage)."""


def fail_fast_without_connection(datastore: Any, wait: float) -> None:
    """Make ``datastore``'s pool wait ``wait`` seconds for a connection and then raise
    :class:`NoConnection` (not retried), instead of psycopg_pool's ``PoolTimeout`` (a
    ``psycopg.OperationalError``, which eventsourcing turns into its retried
    ``OperationalError``). Must run before the pool is opened."""
    pool = datastore.pool
    pool.timeout = wait
    getconn = pool.getconn
    connect: Any = getattr(pool, "_connect", None)
    where = f"{datastore.pool.kwargs.get('host')}:{datastore.pool.kwargs.get('port')}"
    # Why the pool's latest attempt to open a connection failed (what the server or libpq
    # said), until an attempt succeeds again.
    failed: list[str] = []

    def connect_noting(timeout: float | None = None) -> Any:
        try:
            conn = connect(timeout)
        except Exception as exc:
            failed[:] = [connect_reason(exc)]
            raise
        failed.clear()
        return conn

    def getconn_or_fail(timeout: float | None = None) -> Any:
        try:
            return getconn(timeout)
        except PoolTimeout as exc:
            waited = f"{pool.timeout if timeout is None else timeout:g}"
            latest = failed[:1]  # one read: the pool's workers change it meanwhile
            reason = latest[0] if latest else None
            # A server at its connection limit is up and reachable: say which limit (SQLSTATE 53300).
            crowded = too_many_connections(reason, where) if reason is not None else None
            if crowded is not None:
                raise NoConnection(crowded.code, f"no PostgreSQL connection within {waited} s: {crowded.message}",
                                   hint=crowded.hint) from exc
            raise NoConnection(
                "store.unavailable",
                f"no PostgreSQL connection within {waited} s: the server at "
                f"{where} is down or unreachable, or all {pool.max_size} pooled connections stayed busy"
                + (f" (the last connection attempt: {reason})" if reason is not None else ""),
                hint="nothing was sent to the database; retry once PostgreSQL answers (agentfold reconnects by "
                "itself); AGENTFOLD_PG_POOL_WAIT sets the wait",
            ) from exc

    if callable(connect):  # psycopg_pool's own (private) method: without it, the message names no reason
        pool._connect = connect_noting
    pool.getconn = getconn_or_fail


#: The longest pause between two attempts of the pool to replace a connection it lost.
PG_RECONNECT_EVERY = 2.0


class _SteadyReconnect(AttemptWithBackoff):
    """psycopg_pool's reconnection back-off (1, 2, 4 ... s), capped at ``PG_RECONNECT_EVERY``
    give or take 20% (processes that lost the server together do not reconnect in step)."""

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        if self.delay > PG_RECONNECT_EVERY:
            self.delay = PG_RECONNECT_EVERY * random.uniform(0.8, 1.2)


class _EveryThirtySeconds(logging.Filter):
    """Lets one of psycopg_pool's "error connecting" warnings through every 30 s: it logs one per
    failed attempt, and with attempts every 2 s per lost connection an outage wrote hundreds
    of lines (agentfold's own messages say that the server is down)."""

    def __init__(self) -> None:
        super().__init__()
        self._next = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("error connecting in"):
            return True
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + 30.0
        return True


_POOL_LOG_FILTER = _EveryThirtySeconds()


def reconnect_steadily(datastore: Any) -> None:
    """Make ``datastore``'s pool try to replace a lost connection every ``PG_RECONNECT_EVERY``
    seconds, not with psycopg_pool's doubling pauses: after an outage of a minute, its next
    attempt came up to a minute after the server was back, and every request meanwhile
    waited for a connection and failed (``GET /health`` 503 for 51 s after a 70 s outage).
    A server that is down refuses each attempt at once; the pool still gives a connection
    up after its ``reconnect_timeout`` (5 min) and opens one again when a caller waits."""
    pool = datastore.pool
    add_connection = pool._add_connection
    pool_log = logging.getLogger("psycopg.pool")
    if _POOL_LOG_FILTER not in pool_log.filters:
        pool_log.addFilter(_POOL_LOG_FILTER)

    def add_steadily(attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        if attempt is None:
            attempt = _SteadyReconnect(timeout=pool.reconnect_timeout)
        add_connection(attempt, growing=growing)

    pool._add_connection = add_steadily



def _composed(statement: str) -> Composed:
    """A DDL statement as eventsourcing's create statements are typed (a Composed)."""
    return Composed([SQL(statement)])


class _NullStates:
    """Reads that take a row whose ``state`` is NULL (an edit by hand) as a state of None, as
    SQLite's recorder does, instead of failing on it with a bare TypeError (the library
    converts each state with ``bytes()``): decoding it then says the row is damaged
    (``store.corrupt`` / an ``integrity.format`` finding), and store-wide commands, the
    read-model follower and the feed go on with the other trees. Only after the library's
    read failed so: the usual path is unchanged. ``select_events`` serves loads and tree reads,
    ``select_notifications`` the notification log (followers, publishers, exports)."""

    datastore: Any
    select_events_statement: Any
    events_table_name: str

    def select_events(
        self, originator_id: UUID | str, *, gt: int | None = None, lte: int | None = None, desc: bool = False,
        limit: int | None = None,
    ) -> Sequence[StoredEvent]:
        try:
            found: Sequence[StoredEvent] = super().select_events(  # type: ignore[misc]
                originator_id, gt=gt, lte=lte, desc=desc, limit=limit
            )
            return found
        except TypeError:
            pass
        statement = self.select_events_statement
        params: list[Any] = [originator_id]
        if gt is not None:
            params.append(gt)
            statement += SQL(" AND originator_version > %s")
        if lte is not None:
            params.append(lte)
            statement += SQL(" AND originator_version <= %s")
        statement += SQL(" ORDER BY originator_version DESC" if desc else " ORDER BY originator_version ASC")
        if limit is not None:
            params.append(limit)
            statement += SQL(" LIMIT %s")
        return [StoredEvent(row["originator_id"], row["originator_version"], row["topic"], _state(row))
                for row in self._rows_again(statement, params)]

    def select_notifications(
        self, start: int | None, limit: int, stop: int | None = None, topics: Sequence[str] = (), *,
        inclusive_of_start: bool = True,
    ) -> Sequence[Notification]:
        try:
            found: Sequence[Notification] = super().select_notifications(  # type: ignore[misc]
                start, limit, stop, topics, inclusive_of_start=inclusive_of_start
            )
            return found
        except TypeError:
            pass
        conditions: list[str] = []
        params: list[Any] = []
        if start is not None:
            conditions.append("notification_id >= %s" if inclusive_of_start else "notification_id > %s")
            params.append(start)
        if stop is not None:
            conditions.append("notification_id <= %s")
            params.append(stop)
        if topics:
            conditions.append("topic = ANY(%s)")
            params.append(list(topics))
        params.append(limit)
        statement = SQL("SELECT * FROM {schema}.{table}").format(
            schema=Identifier(self.datastore.schema), table=Identifier(self.events_table_name),
        ) + SQL((" WHERE " + " AND ".join(conditions) if conditions else "") + " ORDER BY notification_id LIMIT %s")
        return [Notification(id=row["notification_id"], originator_id=row["originator_id"],
                             originator_version=row["originator_version"], topic=row["topic"], state=_state(row))
                for row in self._rows_again(statement, params)]

    def _rows_again(self, statement: Any, params: list[Any]) -> list[Any]:
        """The rows of a read the library could not convert, as they are."""
        with self.datastore.get_connection() as conn, conn.cursor() as curs:
            curs.execute(statement, params, prepare=True)
            return list(curs.fetchall())


def _state(row: Any) -> bytes:
    """A row's state as bytes, or None when it is NULL (typed as the library's field)."""
    state = row["state"]
    return None if state is None else bytes(state)  # type: ignore[return-value]


class PostgresTreeRecorder(_NullStates, PostgresApplicationRecorder, IndexQueries):
    def __init__(self, datastore: Any, *, events_table_name: str = EVENTS_TABLE) -> None:
        super().__init__(datastore, events_table_name=events_table_name)
        schema = self.datastore.schema
        self.sql_create_statements.append(
            _composed(
                f'CREATE TABLE IF NOT EXISTS "{schema}".{TREES_TABLE} (tree_id text PRIMARY KEY, '
                "start_id text NOT NULL, root_process_id text NOT NULL, program text NOT NULL, "
                "status text NOT NULL, classification text NOT NULL, version bigint NOT NULL, "
                "head_digest text NOT NULL, unknown_effect_ids text NOT NULL, created_at text NOT NULL, "
                "updated_at text NOT NULL)"
            )
        )
        self.sql_create_statements.append(
            _composed(
                f'CREATE TABLE IF NOT EXISTS "{schema}".{PROCESSES_TABLE} '
                "(process_id text PRIMARY KEY, tree_id text NOT NULL)"
            )
        )
        events = f'"{schema}".{events_table_name}'
        # One statement per append: lock (insert order = commit order for followers),
        # notify, insert the events, upsert the index. In autocommit it is one round
        # trip and one commit, where the library's default path needs a pipeline, a
        # sync and a separate COMMIT. The events go first: another writer's event at the
        # same position is a unique violation (a version conflict) before the index row
        # is compared with the end this append starts from (p_head[12], p_head[13]:
        # TreeHead.expect; absent, the row is written whatever it holds; past version 0 the
        # row must exist). A new name for the function that checks the row: a database an
        # earlier release created keeps its unchecked ``agentfold_append`` for that release's
        # processes, and this one installs its own at the first append if it is missing.
        self._create_append = _composed(
            f'CREATE OR REPLACE FUNCTION "{schema}".{APPEND_FUNCTION}('
            "p_originator uuid, p_versions bigint[], p_topics text[], p_states bytea[], "
            "p_head text[], p_new_processes text[]) RETURNS SETOF bigint LANGUAGE plpgsql AS $body$ "
            "BEGIN "
            f"LOCK TABLE {events} IN EXCLUSIVE MODE; "
            f"NOTIFY {events_table_name}; "
            f"RETURN QUERY INSERT INTO {events} (originator_id, originator_version, topic, state) "
            "SELECT p_originator, x.v, x.t, x.s FROM unnest(p_versions, p_topics, p_states) AS x(v, t, s) "
            "ORDER BY x.v RETURNING notification_id; "
            "IF p_head IS NOT NULL THEN "
            "IF p_head[12] IS NOT NULL AND p_head[12]::bigint > 0 THEN "
            f'UPDATE "{schema}".{TREES_TABLE} AS t SET status = p_head[5], classification = p_head[6], '
            "version = p_head[7]::bigint, head_digest = p_head[8], unknown_effect_ids = p_head[9], "
            "updated_at = p_head[11] "
            "WHERE t.tree_id = p_head[1] AND t.version = p_head[12]::bigint AND t.head_digest = p_head[13]; "
            "ELSE "
            f'INSERT INTO "{schema}".{TREES_TABLE} AS t ({HEAD_COLUMNS}) VALUES (p_head[1], p_head[2], '
            "p_head[3], p_head[4], p_head[5], p_head[6], p_head[7]::bigint, p_head[8], p_head[9], p_head[10], "
            "p_head[11]) "
            "ON CONFLICT (tree_id) DO UPDATE SET status=excluded.status, "
            "classification=excluded.classification, version=excluded.version, "
            "head_digest=excluded.head_digest, unknown_effect_ids=excluded.unknown_effect_ids, "
            "updated_at=excluded.updated_at "
            "WHERE p_head[12] IS NULL OR (t.version = p_head[12]::bigint AND t.head_digest = p_head[13]); "
            "END IF; "
            "IF NOT FOUND THEN "
            f"RAISE EXCEPTION '{INDEX_MISMATCH_MARK} %', p_head[1]; "
            "END IF; "
            f'INSERT INTO "{schema}".{PROCESSES_TABLE} (process_id, tree_id) '
            "SELECT unnest(p_new_processes), p_head[1]; "
            "END IF; "
            "END $body$"
        )
        self.sql_create_statements.append(self._create_append)
        # Binary parameters (%b): a text-format bytea[] is hex-escaped element by element in
        # Python and parsed again by the server; binary halves the client CPU of an append.
        self._append = f'SELECT * FROM "{schema}".{APPEND_FUNCTION}(%b, %b, %b, %b, %b, %b)'
        # A snapshot goes in the append's transaction, as two more statements before it (one
        # append in every max(1000, version/8) events); the function keeps its signature.
        self._insert_snapshot = (
            f'INSERT INTO "{schema}".{SNAPSHOTS_TABLE} (originator_id, originator_version, topic, state) '
            "VALUES (%b, %b, %b, %b) ON CONFLICT (originator_id, originator_version) "
            "DO UPDATE SET topic = excluded.topic, state = excluded.state"
        )
        self._prune_snapshots = (
            f'DELETE FROM "{schema}".{SNAPSHOTS_TABLE} WHERE originator_id = %b AND originator_version < %b'
        )
        self._schema = schema
        self._build_later: list[tuple[str, str]] = []  # indexes to build once the tables are committed

    def create_table(self) -> None:
        self._build_later = []
        super().create_table()
        for name, statement in self._build_later:
            self._build_concurrently(name, statement)

    def _create_table(self, curs: Any) -> None:
        # Two processes opening one new database race on CREATE OR REPLACE FUNCTION
        # ("tuple concurrently updated"): serialize schema creation.
        curs.execute("SELECT pg_advisory_xact_lock(7406170100)")
        curs.execute("SELECT to_regclass(%s) AS t", (f'"{self._schema}".{TREES_TABLE}',))
        row = curs.fetchone()
        new_table = row is None or row["t"] is None
        super()._create_table(curs)
        # Only the missing indexes: CREATE INDEX IF NOT EXISTS takes a SHARE lock on the table
        # even when the index exists. A new table gets them here; an earlier release's table,
        # which appends may be writing to, after this transaction and CONCURRENTLY: a plain
        # build holds every tree's appends (they lock the events table first) while it reads
        # the whole index (0.9 s at 1,000,000 rows, measured). The events table's own index is
        # built here in any case (``CONCURRENT_BUILD_TABLES``: appends would wait for a
        # concurrent build as long, and deadlock with it behind an older transaction).
        for name, statement, concurrent in index_statements(f'"{self._schema}".', concurrently=not new_table):
            valid = self._index_valid(curs, name)
            if not valid:  # missing, or left invalid by an interrupted build
                if concurrent:
                    self._build_later.append((name, statement))
                    continue
                if valid is False:
                    curs.execute(f'DROP INDEX "{self._schema}".{name}')
                curs.execute(statement)

    def _index_valid(self, curs: Any, name: str) -> bool | None:
        """Whether index ``name`` is valid; None when it does not exist."""
        curs.execute(
            "SELECT i.indisvalid AS valid FROM pg_index i WHERE i.indexrelid = to_regclass(%s)",
            (f'"{self._schema}".{name}',),
        )
        row = curs.fetchone()
        return None if row is None else bool(row["valid"])

    def _build_concurrently(self, name: str, statement: str) -> None:
        """Build one missing index without holding up appends (autocommit: CONCURRENTLY runs
        outside a transaction). A build that failed before (another open interrupted) leaves
        an invalid index, which is dropped and built again."""
        with self.datastore.get_connection() as conn, conn.cursor() as curs:
            valid = self._index_valid(curs, name)
            if valid:
                return
            if valid is False:
                curs.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{self._schema}".{name}')
            curs.execute(statement)

    def _install_append_function(self) -> None:
        with self.datastore.get_connection() as conn, conn.transaction(), conn.cursor() as curs:
            curs.execute("SELECT pg_advisory_xact_lock(7406170100)")  # as _create_table: one at a time
            curs.execute(self._create_append)

    @on_a_live_connection
    def insert_events(
        self, stored_events: Sequence[StoredEvent], *, _installing: bool = False, **kwargs: Any
    ) -> Sequence[int] | None:
        if not stored_events:
            return []
        head: TreeHead | None = kwargs.get("head")
        snapshot: StoredEvent | None = kwargs.get("snapshot")
        originator = stored_events[0].originator_id
        if any(e.originator_id != originator for e in stored_events) or (
            snapshot is not None and snapshot.originator_id != originator
        ):
            raise ValueError("one append writes one tree's stream")
        params = (
            originator,
            [e.originator_version for e in stored_events],
            [e.topic for e in stored_events],
            [e.state for e in stored_events],
            head_params(head) if head is not None else None,
            list(head.new_processes) if head is not None else [],
        )
        try:
            with self.datastore.get_connection() as conn, conn.cursor() as curs:
                if snapshot is None:
                    curs.execute(self._append, params, prepare=True)
                    return [row[APPEND_FUNCTION] for row in curs.fetchall()]
                # The snapshot statements first: the append takes the events table's lock (every
                # tree's appends wait for it), which is then held only until the COMMIT that follows.
                with conn.transaction():
                    version = snapshot.originator_version
                    curs.execute(
                        self._insert_snapshot, (originator, version, snapshot.topic, snapshot.state), prepare=True
                    )
                    curs.execute(self._prune_snapshots, (originator, version), prepare=True)
                    curs.execute(self._append, params, prepare=True)
                    ids = [row[APPEND_FUNCTION] for row in curs.fetchall()]
                return ids
        except PersistenceError as exc:
            if APPEND_FUNCTION in str(exc) and "does not exist" in str(exc) and not _installing:
                # A database an earlier release created, opened without create_table: install
                # this release's append function once (CREATE OR REPLACE: concurrent opens agree).
                try:
                    self._install_append_function()
                except PersistenceError as failure:
                    raise type(failure)(
                        f"{failure}: this release appends with the function {self._schema}.{APPEND_FUNCTION}, "
                        "which a database an earlier release created does not have yet, and this role may not "
                        "create it (docs/events.md, upgrading): run one writing command as a role that may "
                        "create functions in the schema (its owner), or grant this role CREATE on it"
                    ) from failure
                return self.insert_events(stored_events, _installing=True, **kwargs)
            if head is None or head.expect is None or INDEX_MISMATCH_MARK not in str(exc):
                raise
            stored = self.select_head(head.tree_id)
            raise IndexHeadMismatch(
                head.tree_id, head.expect, (stored.version, stored.head_digest) if stored else None
            ) from exc

    @on_a_live_connection
    def _select(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        with self.datastore.get_connection() as conn, conn.cursor() as curs:
            curs.execute(sql, params, prepare=True)
            return list(curs.fetchall())

    def select_heads(self, only: HeadFilter = HeadFilter()) -> list[TreeHead]:
        sql, params = only.sql(f'"{self._schema}".{TREES_TABLE}', "%s")
        return [head_from_row(r) for r in self._select(sql, tuple(params))]

    def select_head(self, tree_id: str) -> TreeHead | None:
        rows = self._select(f'SELECT {HEAD_COLUMNS} FROM "{self._schema}".{TREES_TABLE} WHERE tree_id = %s', (tree_id,))
        return head_from_row(rows[0]) if rows else None

    def select_tree_ids(self) -> list[str]:
        rows = self._select(f'SELECT tree_id FROM "{self._schema}".{TREES_TABLE} ORDER BY created_at, tree_id')
        return [str(r["tree_id"]) for r in rows]

    def count_live(self) -> tuple[dict[str, int], int]:
        by_classification, with_unknown = count_live_statements(f'"{self._schema}".{TREES_TABLE}')
        live = {str(r["classification"]): int(r["n"]) for r in self._select(by_classification)}
        rows = self._select(with_unknown)
        return live, int(rows[0]["n"]) if rows else 0

    def select_anchors(self, tree_ids: Sequence[str]) -> dict[str, tuple[int, str]]:
        rows = self._select(
            f'SELECT tree_id, version, head_digest FROM "{self._schema}".{TREES_TABLE} WHERE tree_id = ANY(%s)',
            (list(tree_ids),),
        )
        return {str(r["tree_id"]): (int(r["version"]), str(r["head_digest"])) for r in rows}

    def tree_of_process(self, process_id: str) -> str | None:
        rows = self._select(
            f'SELECT tree_id FROM "{self._schema}".{PROCESSES_TABLE} WHERE process_id = %s', (process_id,)
        )
        return str(rows[0]["tree_id"]) if rows else None

    def holds_topic(self, originator_id: UUID, topic: str, upto: int) -> bool:
        # The condition as a literal: a bound parameter would not prove the partial index's.
        return bool(self._select(
            f'SELECT 1 FROM "{self._schema}".{self.events_table_name} WHERE originator_id = %s '
            f"AND originator_version <= %s AND {topic_condition(topic)} LIMIT 1", (originator_id, upto)
        ))

    def processes_of_tree(self, tree_id: str) -> list[str]:
        rows = self._select(
            f'SELECT process_id FROM "{self._schema}".{PROCESSES_TABLE} WHERE tree_id = %s ORDER BY process_id',
            (tree_id,),
        )
        return [str(r["process_id"]) for r in rows]

    def tree_of_unknown_effect(self, effect_id: str) -> str | None:
        rows = self._select(
            f'SELECT tree_id FROM "{self._schema}".{TREES_TABLE} '
            f"WHERE {UNKNOWN_CONDITION} AND unknown_effect_ids LIKE %s",
            (f'%"{effect_id}"%',),
        )
        return str(rows[0]["tree_id"]) if rows else None

    def select_changes(self, after: int, upto: int, limit: int) -> list[tuple[str | None, int, int, int, int]]:
        rows = self._select(
            "SELECT originator_id, MIN(n) AS first, MIN(originator_version) AS low, MAX(originator_version) AS high, "
            "MAX(n) AS last FROM (SELECT notification_id AS n, originator_id, originator_version "
            f'FROM "{self._schema}".{self.events_table_name} WHERE notification_id > %s AND notification_id <= %s '
            "ORDER BY notification_id LIMIT %s) AS recent GROUP BY originator_id",
            (after, upto, limit),
        )
        return [(UUID(str(r["originator_id"])).hex, int(r["first"]), int(r["low"]), int(r["high"]), int(r["last"]))
                for r in rows]

    def select_tree_notifications(self, tree_hex: str, from_version: int, limit: int) -> list[Notification]:
        rows = self._select(
            "SELECT notification_id, originator_version, topic, state "
            f'FROM "{self._schema}".{self.events_table_name} WHERE originator_id = %s AND originator_version >= %s '
            "ORDER BY originator_version LIMIT %s",
            (UUID(hex=tree_hex), from_version, limit),
        )
        return [Notification(originator_id=UUID(hex=tree_hex), originator_version=r["originator_version"],
                             topic=r["topic"], state=r["state"], id=int(r["notification_id"]))
                for r in rows]

    def select_raw_notifications(self, after: int, limit: int) -> list[Notification]:
        rows = self._select(
            "SELECT notification_id, originator_id, originator_version, topic, state "
            f'FROM "{self._schema}".{self.events_table_name} WHERE notification_id > %s '
            "ORDER BY notification_id LIMIT %s",
            (after, limit),
        )
        return [Notification(originator_id=r["originator_id"], originator_version=r["originator_version"],
                             topic=r["topic"], state=r["state"], id=int(r["notification_id"])) for r in rows]

    def select_position_before(self, tree_hex: str, notification_id: int) -> int:
        rows = self._select(
            f'SELECT max(originator_version) AS v FROM "{self._schema}".{self.events_table_name} '
            "WHERE originator_id = %s AND notification_id < %s",
            (UUID(hex=tree_hex), notification_id),
        )
        return int(rows[0]["v"]) if rows and rows[0]["v"] is not None else 0


class PostgresSnapshotRecorder(_NullStates, PostgresAggregateRecorder):
    def __init__(self, datastore: Any) -> None:
        super().__init__(datastore, events_table_name=SNAPSHOTS_TABLE)

    @on_a_live_connection
    def prune(self, originator_id: Any, below_version: int) -> None:
        """Delete snapshots older than ``below_version`` (a newer one supersedes them)."""
        with self.datastore.get_connection() as conn, conn.cursor() as curs:
            curs.execute(
                f'DELETE FROM "{self.datastore.schema}".{SNAPSHOTS_TABLE} '
                "WHERE originator_id = %s AND originator_version < %s",
                (originator_id, below_version),
                prepare=True,
            )

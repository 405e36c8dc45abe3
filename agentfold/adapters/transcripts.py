"""The transcript consumer: product transcripts in SQLite or PostgreSQL, built from the Kafka feed.

:class:`TranscriptConsumer` reads the feed's topic in a consumer group (kafka-python,
``enable_auto_commit=False``) and, for every polled batch:

1. applies the envelopes with the pure builder (``agentfold.projections.transcripts``), tree by
   tree, on the tree's stored builder state;
2. commits, in **one database transaction**, the new entries, the changed transcript
   headers and each tree's builder state with its high-water mark (the last applied
   position and notification id of the tree: the processed notification ids);
3. only then commits the consumer offsets.

A crash between 2 and 3 re-delivers the batch; every envelope at or below its tree's
high-water mark is skipped, so no entry is duplicated, and none is lost because the
offsets never move past what the database holds. A following consumer
(:meth:`TranscriptConsumer.follow_until_stopped`) outlives failures of its database the
same way: it reports each one, waits (``agentfold.adapters.follower.retry_until_stopped``), opens a
new connection and goes back to the committed offsets. An envelope past a missing position
of its tree stops the consumer (:class:`~agentfold.projections.transcripts.TranscriptGap`): it
never writes a transcript with a hole in it. Nor with an envelope that contradicts what the
tables hold for its tree (:class:`FeedIntegrityError`): the next position must chain onto the
tree's last digest (``feed.chain_broken``, checked with the publisher's
:class:`~agentfold.adapters.feed.ChainCheck`), and a position applied already is a duplicate
only with the digest applied there (``feed.digest_conflict``; every applied digest is kept in
``agentfold_transcript_digests``). A record that is not a valid envelope is kept in
``agentfold_transcript_rejects`` and skipped.

:class:`TranscriptStore` is the embedder's API over the same tables
(``transcript(process_id)``, ``transcripts(tree_id)``, ``apply(envelopes)``), and
:func:`transcripts_from_store` builds the same transcripts straight from an event store.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from agentfold.adapters.codec import chain_tag
from agentfold.adapters.eventstore import (
    PG_CONNECT_TIMEOUT,
    CorruptStream,
    EventStore,
    create_private,
    end_session,
    ensure_durable_commits,
    interruptible_connection,
    lower_scheme,
    pg_tcp_params,
    pg_tcp_timeout,
    redact,
    set_server_tcp,
)
from agentfold.adapters.feed import (
    DEFAULT_CONNECT_TIMEOUT,
    ChainCheck,
    FeedError,
    bootstrap_config,
    check_topic,
    store_envelopes,
    unreachable,
)
from agentfold.adapters.recorders import SQLITE_DURABLE_COMMITS
from agentfold.domain.errors import AgentfoldError, InvalidInput, NotFound, StoreFailure
from agentfold.domain.ids import TreeID
from agentfold.domain.integrity import content_bytes
from agentfold.projections.transcripts import (
    Entry,
    Envelope,
    EnvelopeInvalid,
    SchemaVersionUnsupported,
    TranscriptGap,
    TreeTranscripts,
    build_transcripts,
    check_envelope,
    transcript_json,
)

TRANSCRIPTS = "agentfold_transcripts"
ENTRIES = "agentfold_transcript_entries"
TREES = "agentfold_transcript_trees"
REJECTS = "agentfold_transcript_rejects"
DIGESTS = "agentfold_transcript_digests"
CRASH_EXIT = 75
#: Transactions one batch gets when its inserts meet the same records committed by another writer
#: meanwhile (``TranscriptStore.apply``); each new one reads them, so one more is usually enough.
UNIQUE_TRIES = 3

_DDL = (
    f"CREATE TABLE IF NOT EXISTS {TRANSCRIPTS} (process_id TEXT PRIMARY KEY, tree_id TEXT NOT NULL, "
    "parent_process_id TEXT, tool_call_ref TEXT, status TEXT NOT NULL, entry_count INTEGER NOT NULL, "
    "created_notification_id BIGINT NOT NULL, updated_notification_id BIGINT NOT NULL, body TEXT NOT NULL)",
    f"CREATE INDEX IF NOT EXISTS {TRANSCRIPTS}_by_tree ON {TRANSCRIPTS} (tree_id, created_notification_id)",
    f"CREATE TABLE IF NOT EXISTS {ENTRIES} (process_id TEXT NOT NULL, seq INTEGER NOT NULL, tree_id TEXT NOT NULL, "
    "kind TEXT NOT NULL, notification_id BIGINT NOT NULL, position BIGINT NOT NULL, tool_call_ref TEXT, "
    "event_timestamp TEXT NOT NULL, recorded_at TEXT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (process_id, seq))",
    f"CREATE INDEX IF NOT EXISTS {ENTRIES}_by_notification ON {ENTRIES} (notification_id)",
    f"CREATE TABLE IF NOT EXISTS {TREES} (tree_id TEXT PRIMARY KEY, position BIGINT NOT NULL, "
    "notification_id BIGINT NOT NULL, state TEXT NOT NULL)",
    f"CREATE TABLE IF NOT EXISTS {REJECTS} (topic TEXT NOT NULL, partition_id INTEGER NOT NULL, "
    "record_offset BIGINT NOT NULL, error TEXT NOT NULL, value TEXT, PRIMARY KEY (topic, partition_id, record_offset))",
    f"CREATE TABLE IF NOT EXISTS {DIGESTS} (tree_id TEXT NOT NULL, position BIGINT NOT NULL, "
    "notification_id BIGINT NOT NULL, digest TEXT NOT NULL, PRIMARY KEY (tree_id, position))",
)


def _dumps(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(slots=True)
class ApplyReport:
    """What one batch did."""

    envelopes: int = 0
    applied: int = 0
    duplicates: int = 0
    entries: int = 0
    rejected: int = 0
    tree_updates: int = 0  # trees written, summed over batches

    def add(self, other: ApplyReport) -> None:
        for name in ("envelopes", "applied", "duplicates", "entries", "rejected", "tree_updates"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_json(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in ("envelopes", "applied", "duplicates", "entries", "rejected", "tree_updates")}


@dataclass(frozen=True, slots=True)
class Rejected:
    """A record that is not a valid envelope: where it was and why."""

    topic: str
    partition: int
    offset: int
    error: str
    value: str


FEED_TRUST_HINT = (
    "the topic holds a record that is not the store's event (a second producer, or a forged record: "
    "protect the topic with ACLs); this tree's transcripts cannot be trusted: publish the store to a new "
    "topic and rebuild the tables from it in a new group (docs/kafka.md#what-the-consumer-verifies)"
)


class FeedIntegrityError(AgentfoldError):
    """An envelope that contradicts what the transcript tables hold for its tree: its digest does
    not chain onto the tree's previous event (``feed.chain_broken``), or its position was applied
    already with another digest (``feed.digest_conflict``). Nothing of its batch is committed and
    the consumer stops, as on a gap (``feed.gap``)."""

    def __init__(self, code: str, tree_id: str, position: int, message: str) -> None:
        super().__init__(code, message, FEED_TRUST_HINT, tree_id=tree_id, position=position)
        self.tree_id = tree_id
        self.position = position


UNAVAILABLE_HINT = (
    "check --db: a PostgreSQL server that is running and reachable from here, with the right host, port, "
    "user, password and database in the URL; or an SQLite file that is a transcript database"
)


def _unavailable(url: str, exc: BaseException) -> StoreFailure:
    """``transcripts.unavailable``: the URL without its password (``eventstore.redact``), also in the
    driver's message."""
    why = str(exc).replace(url, redact(url))
    return StoreFailure("transcripts.unavailable", f"cannot open {redact(url)}: {why}", hint=UNAVAILABLE_HINT)


def _no_tables(url: str, why: str) -> NotFound:
    return NotFound(
        "transcripts.not_found", f"no transcript database at {redact(url)}: {why}",
        hint="`agentfold transcripts --db URL` creates and fills it; check --db",
    )


class TranscriptStore:
    """The transcript tables in one SQLite file or PostgreSQL database."""

    def __init__(self, url: str, *, create: bool = True) -> None:
        """``create=False`` (reading transcripts): a database without the tables is
        ``transcripts.not_found`` and nothing is created (a mistyped ``--db`` must not leave
        an empty database, or directories, behind)."""
        url = lower_scheme(url)  # a URL's scheme is case-insensitive, as a store URL's
        self.url = url
        if url.startswith("sqlite:///"):
            path = url[len("sqlite:///") :]
            if not path:
                raise InvalidInput("transcripts.url_invalid", f"sqlite URL {url!r} names no file",
                                   hint="use sqlite:///path.db")
            if create:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                create_private(Path(path))  # 0600: it holds the conversations, as the store does
            elif not Path(path).is_file():
                raise _no_tables(url, "the file does not exist")
            self.backend = "sqlite"
        elif url.startswith(("postgresql://", "postgres://")):
            port: int | None = None
            try:
                parts = urlsplit(url)
            except ValueError:  # a malformed host: the connection string's own parse says so below
                parts = None
            if parts is not None:
                try:
                    port = parts.port
                except ValueError:
                    port = 0
            if port == 0:  # libpq would say "invalid integer value" only once connecting
                raise InvalidInput("transcripts.url_invalid",
                                   f"PostgreSQL URL {redact(url)} has no valid port: a port is a number from 1 to 65535",
                                   hint="use postgresql://user:pass@host:port/db")
            self.backend = "postgresql"
        else:
            raise InvalidInput(
                "transcripts.url_invalid", f"unsupported database URL {redact(url)!r}",
                hint="use sqlite:///path.db or postgresql://user:pass@host:port/db",
            )
        self._conn: Any = self._connect(create)
        self._lock = threading.Lock()
        if not create:
            try:
                present = self._has_tables()
            except sqlite3.DatabaseError as exc:  # e.g. "file is not a database"
                self.close()
                raise _unavailable(url, exc) from exc
            if not present:
                self.close()
                raise _no_tables(url, "it has no transcript tables")
            return
        with self._transaction() as c:
            if self.backend == "postgresql":
                c.execute("SELECT pg_advisory_xact_lock(7406170105)")  # concurrent first opens
            for statement in _DDL:
                c.execute(statement)

    def _has_tables(self) -> bool:
        if self.backend == "sqlite":
            found = self._conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (TRANSCRIPTS,))
        else:
            found = self._conn.execute("SELECT 1 WHERE to_regclass(%s) IS NOT NULL", (TRANSCRIPTS,))
        return found.fetchone() is not None

    def close(self) -> None:
        self._conn.close()

    def interrupt(self) -> None:
        """Make the statement in progress fail now, for a consumer that stops while the database
        does not answer (``agentfold.adapters.follower.StopGuard``); safe from any thread. Its transaction
        is committed as a whole or not at all, and the offsets are committed only after it."""
        if self.backend == "postgresql":
            end_session(self._conn)
        else:
            self._conn.interrupt()  # a statement in progress; a lock wait ends by its own 30 s

    def reconnect(self) -> None:
        """Replace the connection (after it failed: a restarted server, a terminated session)."""
        with self._lock:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001 - it is broken already; nothing of it is needed
                pass
            self._conn = self._connect()

    def _connect(self, create: bool = True) -> Any:
        if self.backend == "sqlite":
            conn = sqlite3.connect(self.url[len("sqlite:///") :], timeout=30, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            if create:  # a reader leaves the file as it is
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute(SQLITE_DURABLE_COMMITS)  # offsets are committed after the tables
            return conn
        import psycopg
        from psycopg.conninfo import conninfo_to_dict
        from psycopg.rows import dict_row

        # libpq waits for ever for a server that does not answer unless told (eventstore.pg_conninfo),
        # and neither end notices for hours that the other vanished (eventstore.pg_tcp_params,
        # set_server_tcp); what the URL itself says wins.
        tcp_timeout = pg_tcp_timeout()
        try:
            given = conninfo_to_dict(self.url)
        except psycopg.Error as exc:  # its message may quote the whole URL, password included
            why = str(exc).replace(self.url, redact(self.url))
            raise InvalidInput(
                "transcripts.url_invalid", f"cannot read the database URL {redact(self.url)!r}: {why}",
                hint="use postgresql://user:pass@host:port/db (percent-encode special characters)",
            ) from exc
        params: dict[str, Any] = {} if os.environ.get("PGCONNECT_TIMEOUT") else {"connect_timeout": PG_CONNECT_TIMEOUT}
        params.update(pg_tcp_params(tcp_timeout))
        params = {k: v for k, v in params.items() if k not in given}
        try:
            # Interruptible: ``interrupt`` ends its statement from another thread (end_session).
            conn = interruptible_connection().connect(self.url, autocommit=True, row_factory=dict_row, **params)
        except psycopg.Error as exc:
            raise _unavailable(self.url, exc) from exc
        try:
            set_server_tcp(conn, tcp_timeout)
            # The consumer commits its offsets after its tables: a commit the server acknowledged
            # but did not flush would be skipped for good after a crash (ensure_durable_commits).
            ensure_durable_commits(conn)
        except psycopg.Error as exc:
            conn.close()
            raise _unavailable(self.url, exc) from exc
        return conn

    # -- plumbing ----------------------------------------------------------------

    def _sql(self, statement: str) -> str:
        return statement if self.backend == "sqlite" else statement.replace("?", "%s")

    class _Tx:
        def __init__(self, store: TranscriptStore) -> None:
            self.store = store
            self._pg_tx: Any = None

        def __enter__(self) -> Any:
            self.store._lock.acquire()
            try:
                if self.store.backend == "sqlite":
                    # IMMEDIATE: take the write lock now, so two consumers serialize per batch.
                    self.store._conn.execute("BEGIN IMMEDIATE")
                    return self.store._conn.cursor()
                self._pg_tx = self.store._conn.transaction()
                self._pg_tx.__enter__()
                return self.store._conn.cursor()
            except BaseException:
                self.store._lock.release()
                raise

        def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
            try:
                if self.store.backend == "sqlite":
                    self.store._conn.execute("COMMIT" if kind is None else "ROLLBACK")
                else:
                    self._pg_tx.__exit__(kind, exc, tb)
            finally:
                self.store._lock.release()

    def _transaction(self) -> TranscriptStore._Tx:
        return TranscriptStore._Tx(self)

    # -- writes ------------------------------------------------------------------

    def apply(
        self,
        envelopes: Iterable[Envelope],
        *,
        rejected: Sequence[Rejected] = (),
        before_commit: Callable[[], None] | None = None,
    ) -> ApplyReport:
        """Apply envelopes (any trees, each tree's in position order) in one transaction.

        Another writer of the same tables that committed the same records while this transaction
        wrote them (one that does not take ``_lock_trees``' locks: a release before them) makes
        an insert fail on a unique key: the batch is then applied again, and meets those records
        as what they are (duplicates, or ``feed.digest_conflict``). A unique key that fails on
        every try means the tables contradict themselves (rows changed or deleted by hand):
        ``store.append_failed``, never the driver's error."""
        checked = [check_envelope(envelope) for envelope in envelopes]
        for tries in range(1, UNIQUE_TRIES + 1):
            try:
                return self._apply_once(checked, rejected, before_commit)
            except Exception as exc:  # only a unique violation is handled here; the rest is raised
                if not _unique_violation(exc):
                    raise
                if tries == UNIQUE_TRIES:
                    raise StoreFailure(
                        "store.append_failed",
                        f"the transcript tables of {redact(self.url)} refused a write {tries} times: "
                        f"{' '.join(str(exc).split())}; they contradict themselves (rows changed or deleted by hand?)",
                        hint="rebuild them: empty the tables (TranscriptStore.reset()) and consume the topic again "
                             "in a new group (docs/kafka.md#tables)",
                    ) from exc
        raise AssertionError("unreachable")

    def _apply_once(
        self, envelopes: Sequence[Envelope], rejected: Sequence[Rejected], before_commit: Callable[[], None] | None,
    ) -> ApplyReport:
        report = ApplyReport()
        by_tree: dict[str, list[Envelope]] = {}
        for envelope in envelopes:
            report.envelopes += 1
            by_tree.setdefault(str(envelope["tree_id"]), []).append(envelope)
        recorded_at = _now()
        # One chain per transaction: nothing it remembers outlives a batch that was not committed.
        chain = ChainCheck(None)
        with self._transaction() as c:
            states = self._lock_trees(c, by_tree)
            for tree_id, items in by_tree.items():
                self._apply_tree(c, tree_id, items, report, recorded_at, chain, states)
            for r in rejected:
                c.execute(
                    self._sql(
                        f"INSERT INTO {REJECTS} (topic, partition_id, record_offset, error, value) VALUES (?,?,?,?,?) "
                        "ON CONFLICT (topic, partition_id, record_offset) DO NOTHING"
                    ),
                    (r.topic, r.partition, r.offset, r.error, r.value),
                )
                report.rejected += 1
            if before_commit is not None:
                before_commit()
        return report

    def _lock_trees(self, c: Any, trees: Iterable[str]) -> dict[str, Any] | None:
        """On PostgreSQL, lock the row of each tree of the batch, for the transaction, and return
        each tree's stored builder state (None: a new tree); on SQLite (``BEGIN IMMEDIATE`` holds
        the whole database) None, and each tree's row is read as it is applied.

        Several consumers may write one database (the members of a group during a rebalance, the
        groups that share it): the second to apply a tree's records must wait for the first and
        then see them, as duplicates. ``SELECT ... FOR UPDATE`` alone locks no row for a tree
        that has none yet, and both would insert its first positions (a unique violation on
        ``agentfold_transcript_digests``). So a row is inserted first for every tree that has
        none (position 0: "no state", replaced in this transaction, never committed as it is:
        a new tree's first envelope is applied or the transaction fails); a second inserter of
        the same tree waits for the first transaction, then finds its row. Both statements go
        through the trees in one order (sorted), so that two batches with trees in common never
        wait for each other in a cycle (a deadlock, one batch aborted)."""
        if self.backend == "sqlite":
            return None
        ordered = sorted(trees)
        if not ordered:
            return {}
        c.execute(
            f"INSERT INTO {TREES} (tree_id, position, notification_id, state) "
            "SELECT t, 0, 0, 'null' FROM unnest(%s::text[]) AS u(t) ON CONFLICT (tree_id) DO NOTHING",
            (ordered,),
        )
        c.execute(f"SELECT tree_id, position, state FROM {TREES} WHERE tree_id = ANY(%s) ORDER BY tree_id FOR UPDATE",
                  (ordered,))
        return {str(r["tree_id"]): orjson.loads(r["state"]) if int(r["position"]) > 0 else None for r in c.fetchall()}

    def _apply_tree(
        self, c: Any, tree_id: str, items: Sequence[Envelope], report: ApplyReport, recorded_at: str,
        chain: ChainCheck, states: dict[str, Any] | None,
    ) -> None:
        """Apply one tree's envelopes: a position already held is a duplicate only with the digest
        held for it (else ``feed.digest_conflict``); the next position only if its digest chains
        onto the last one held (else ``feed.chain_broken``); a later one is a gap. Each raises:
        nothing of the batch is committed. ``states``: the trees' states as ``_lock_trees`` read
        them (None: read the tree's row here)."""
        if states is None:
            c.execute(self._sql(f"SELECT state FROM {TREES} WHERE tree_id = ?"), (tree_id,))
            row = c.fetchone()
            state = orjson.loads(row["state"]) if row else None
        else:
            state = states.get(tree_id)
        builder = TreeTranscripts(tree_id, state)
        initial_position = builder.position
        known = self._held_digests(c, tree_id, items, builder)
        if builder.digest is not None:
            chain.seed(TreeID(tree_id), builder.position, builder.digest)
        before = {pid: dict(h) for pid, h in builder.headers.items()}
        entries: list[Entry] = []
        applied: list[tuple[Any, ...]] = []
        for envelope in items:
            position, digest = int(envelope["position"]), str(envelope["digest"])
            if position <= builder.position:
                if known.get(position, digest) != digest:
                    raise FeedIntegrityError(
                        "feed.digest_conflict", tree_id, position,
                        f"tree {tree_id} position {position} (notification id {envelope['notification_id']}) "
                        f"has digest {digest}, but the transcripts applied {known[position]} at that position",
                    )
                report.duplicates += 1
                continue
            # A tree saved by a release that kept no digest is verified from its next envelope on.
            if position == builder.position + 1 and (position == 1 or builder.digest is not None):
                self._verify_chain(chain, tree_id, envelope)
            made = builder.apply(envelope)  # raises TranscriptGap: nothing of this batch is committed
            assert made is not None  # a duplicate was skipped above
            known[position] = digest
            chain.seed(TreeID(tree_id), position, digest)  # also one taken unverified (no digest held before it)
            applied.append((tree_id, position, int(envelope["notification_id"]), digest))
            report.applied += 1
            entries.extend(made)
        if builder.position == initial_position:
            return  # only duplicates
        report.tree_updates += 1
        report.entries += len(entries)
        c.executemany(
            self._sql(f"INSERT INTO {DIGESTS} (tree_id, position, notification_id, digest) VALUES (?,?,?,?)"), applied,
        )
        if entries:
            c.executemany(
                self._sql(
                    f"INSERT INTO {ENTRIES} (process_id, seq, tree_id, kind, notification_id, position, tool_call_ref, "
                    "event_timestamp, recorded_at, body) VALUES (?,?,?,?,?,?,?,?,?,?)"
                ),
                [
                    (e["process_id"], e["seq"], tree_id, e["kind"], e["notification_id"], e["position"],
                     e.get("tool_call_ref"), e["timestamp"], recorded_at, _dumps(e))
                    for e in entries
                ],
            )
        changed = [h for pid, h in builder.headers.items() if before.get(pid) != h]
        for h in changed:
            c.execute(
                self._sql(
                    f"INSERT INTO {TRANSCRIPTS} (process_id, tree_id, parent_process_id, tool_call_ref, status, "
                    "entry_count, created_notification_id, updated_notification_id, body) VALUES (?,?,?,?,?,?,?,?,?) "
                    "ON CONFLICT (process_id) DO UPDATE SET status = excluded.status, "
                    "entry_count = excluded.entry_count, updated_notification_id = excluded.updated_notification_id, "
                    "body = excluded.body"
                ),
                (h["process_id"], tree_id, h["parent_process_id"], h["tool_call_ref"], h["status"], h["entry_count"],
                 h["created_notification_id"], h["updated_notification_id"], _dumps(h)),
            )
        c.execute(
            self._sql(
                f"INSERT INTO {TREES} (tree_id, position, notification_id, state) VALUES (?,?,?,?) "
                "ON CONFLICT (tree_id) DO UPDATE SET position = excluded.position, "
                "notification_id = excluded.notification_id, state = excluded.state"
            ),
            (tree_id, builder.position, builder.notification_id, _dumps(builder.to_json())),
        )

    def _held_digests(self, c: Any, tree_id: str, items: Sequence[Envelope], builder: TreeTranscripts) -> dict[int, str]:
        """The digests held for the positions of ``items`` that the tree has applied already
        (one query, only when some came again); none for positions applied by a release that
        kept no digests."""
        known: dict[int, str] = {}
        if builder.digest is not None:
            known[builder.position] = builder.digest
        again = [int(e["position"]) for e in items if int(e["position"]) < builder.position]
        if again:
            c.execute(
                self._sql(f"SELECT position, digest FROM {DIGESTS} WHERE tree_id = ? AND position >= ? AND position <= ?"),
                (tree_id, min(again), max(again)),
            )
            known.update({int(r["position"]): str(r["digest"]) for r in c.fetchall()})
        return known

    @staticmethod
    def _verify_chain(chain: ChainCheck, tree_id: str, envelope: Envelope) -> None:
        """The envelope's digest must be the one its tree's previous digest and its own content
        give (``ChainCheck``, as the publisher and ``transcripts_from_store`` verify)."""
        position = int(envelope["position"])
        content = content_bytes(dict(envelope["payload"]), str(envelope["timestamp"]))
        try:
            tag = chain_tag(str(envelope["type"]), int(envelope["schema_version"]))
            chain.check(TreeID(tree_id), position, tag, content, str(envelope["digest"]))
        except CorruptStream as exc:
            raise FeedIntegrityError(
                "feed.chain_broken", tree_id, position,
                f"tree {tree_id} position {position} (notification id {envelope['notification_id']}) does not chain "
                f"onto the event the transcripts hold before it: {exc.detail}",
            ) from exc

    def reset(self) -> None:
        """Empty every table (before rebuilding from the start of a topic)."""
        with self._transaction() as c:
            for table in (ENTRIES, TRANSCRIPTS, TREES, REJECTS, DIGESTS):
                c.execute(f"DELETE FROM {table}")

    # -- queries -----------------------------------------------------------------

    def _rows(self, statement: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._lock:
            cursor = self._conn.cursor()
            cursor.execute(self._sql(statement), tuple(params))
            rows = cursor.fetchall()
            if self.backend == "sqlite":
                cursor.close()
            return list(rows)

    def transcript(self, process_id: str) -> dict[str, Any] | None:
        """One transcript: its header and its entries in order (None if there is none)."""
        headers = self._rows(f"SELECT body FROM {TRANSCRIPTS} WHERE process_id = ?", (process_id,))
        if not headers:
            return None
        entries = self._rows(f"SELECT body FROM {ENTRIES} WHERE process_id = ? ORDER BY seq", (process_id,))
        return transcript_json(orjson.loads(headers[0]["body"]), [orjson.loads(r["body"]) for r in entries])

    def transcripts(self, tree_id: str | None = None) -> dict[str, dict[str, Any]]:
        """Every transcript (of one tree, or all), by process id."""
        where, params = ("WHERE tree_id = ?", (tree_id,)) if tree_id is not None else ("", ())
        headers = self._rows(f"SELECT process_id, body FROM {TRANSCRIPTS} {where} ORDER BY created_notification_id", params)
        out: dict[str, dict[str, Any]] = {str(r["process_id"]): transcript_json(orjson.loads(r["body"]), []) for r in headers}
        for r in self._rows(f"SELECT process_id, body FROM {ENTRIES} {where} ORDER BY process_id, seq", params):
            out[str(r["process_id"])]["entries"].append(orjson.loads(r["body"]))
        return out

    def tree_positions(self) -> dict[str, int]:
        """Per tree: the last position the tables reflect."""
        return {str(r["tree_id"]): int(r["position"]) for r in self._rows(f"SELECT tree_id, position FROM {TREES}")}

    def events_applied(self) -> int:
        """How many distinct events the tables reflect (the sum of the trees' positions)."""
        rows = self._rows(f"SELECT COALESCE(SUM(position), 0) AS n FROM {TREES}")
        return int(rows[0]["n"])

    def entry_lags(self) -> list[float]:
        """Seconds from each entry's event timestamp (the append) to its row's commit time."""
        out = []
        for r in self._rows(f"SELECT event_timestamp, recorded_at FROM {ENTRIES}"):
            out.append(_seconds(str(r["recorded_at"])) - _seconds(str(r["event_timestamp"])))
        return out

    def rejects(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._rows(f"SELECT topic, partition_id, record_offset, error FROM {REJECTS}")]


def _seconds(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def transcripts_from_store(store: EventStore) -> dict[str, dict[str, Any]]:
    """The transcripts built straight from the store's notification log (no broker)."""
    return build_transcripts(store_envelopes(store))


# ---------------------------------------------------------------------------
# The consumer


def consumer_config(bootstrap: str, group: str, *, group_instance_id: str | None = None, **extra: Any) -> dict[str, Any]:
    """Consumer settings that work on Kafka and on the test broker (docs/kafka.md)."""
    config: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "group_id": group,
        "client_id": "agentfold-transcripts",
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 1000,
        "fetch_max_wait_ms": 100,
        "max_partition_fetch_bytes": 8 * 1024 * 1024,
        # A consumer never creates the topic it reads (a typo in --topic would otherwise make
        # an empty topic and consume it for ever); see TranscriptConsumer.run.
        "allow_auto_create_topics": False,
    }
    if group_instance_id:
        config["group_instance_id"] = group_instance_id
    config.update(extra)
    return config


def crash_hook_from_env() -> Callable[[int], Callable[[], None] | None]:
    """``AGENTFOLD_TRANSCRIPTS_CRASH=after-db-commit:N``: die (os._exit) after the N-th batch's
    database commit and before its offset commit (real process death, for the crash tests)."""
    spec = os.environ.get("AGENTFOLD_TRANSCRIPTS_CRASH", "")
    if not spec:
        return lambda batch: None
    kind, _, n = spec.partition(":")
    if kind != "after-db-commit" or not (n.isascii() and n.isdigit()):
        raise InvalidInput("feed.crash_spec", f"AGENTFOLD_TRANSCRIPTS_CRASH={spec!r} is not after-db-commit:N")
    target = int(n)

    def hook(batch: int) -> Callable[[], None] | None:
        if batch != target:
            return None

        def die() -> None:
            os._exit(CRASH_EXIT)

        return die

    return hook


@dataclass(slots=True)
class ConsumeReport:
    totals: ApplyReport = field(default_factory=ApplyReport)
    batches: int = 0
    commit_failures: int = 0
    failures: int = 0  # database (or offset-fetch) failures retried while following

    def to_json(self) -> dict[str, int]:
        return {
            **self.totals.to_json(), "batches": self.batches, "commit_failures": self.commit_failures,
            "failures": self.failures,
        }


def _unique_violation(exc: BaseException) -> bool:
    """A write refused on a unique key (SQLite's ``UNIQUE constraint failed``, PostgreSQL's 23505)."""
    if isinstance(exc, sqlite3.IntegrityError):
        return getattr(exc, "sqlite_errorname", "") in ("SQLITE_CONSTRAINT_UNIQUE", "SQLITE_CONSTRAINT_PRIMARYKEY")
    return getattr(exc, "sqlstate", None) == "23505"  # psycopg.errors.UniqueViolation


def consume_failed(exc: BaseException) -> bool:
    """The failures a following consumer retries: its database's (as the read models' follower
    does, ``agentfold.adapters.follower.store_failed``) and the broker's retriable ones. A gap in a tree
    (``feed.gap``) or a group that assigns nothing (``feed.unavailable``) stops it."""
    from kafka.errors import KafkaError

    from agentfold.adapters.follower import store_failed

    if isinstance(exc, (sqlite3.OperationalError, sqlite3.IntegrityError)):  # locked, I/O; a concurrent writer
        return True
    if isinstance(exc, KafkaError):
        return bool(exc.retriable)
    return store_failed(exc)


class TranscriptConsumer:
    """One member of a consumer group that keeps a TranscriptStore current."""

    def __init__(
        self,
        store: TranscriptStore,
        bootstrap: str,
        topic: str,
        group: str,
        *,
        group_instance_id: str | None = None,
        max_records: int = 1000,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        consumer: Any = None,
    ) -> None:
        self.store = store
        self.topic = check_topic(topic)
        self.max_records = max_records
        if consumer is None:
            from kafka import KafkaConsumer
            from kafka.errors import KafkaError

            try:
                consumer = KafkaConsumer(**consumer_config(
                    bootstrap, group, group_instance_id=group_instance_id, **bootstrap_config(bootstrap, connect_timeout)
                ))
            except KafkaError as exc:
                raise unreachable(bootstrap, connect_timeout, exc) from exc
            self._subscribed = False  # once the topic exists (run)
        else:
            self._subscribed = True
        self.bootstrap = bootstrap
        self.consumer = consumer
        self.report = ConsumeReport()
        self._crash = crash_hook_from_env()
        self._interrupted = False
        self.on_batch: Callable[[ApplyReport], None] | None = None

    def assigned(self) -> bool:
        return bool(self.consumer.assignment())

    def poll_once(self, timeout: float = 0.5) -> ApplyReport | None:
        """Poll one batch, commit it to the database, then commit the offsets. None if nothing came."""
        polled = self.consumer.poll(timeout_ms=int(timeout * 1000), max_records=self.max_records)
        records = [record for batch in polled.values() for record in batch]
        if not records:
            return None
        envelopes: list[Envelope] = []
        rejected: list[Rejected] = []
        for record in records:
            try:
                value = orjson.loads(record.value)
                envelopes.append(check_envelope(value))
            except SchemaVersionUnsupported as exc:
                # Named where it is: the operator finds the record (and its tree) on the topic.
                tree = str(value["tree_id"])  # an envelope of the schema: only its version is unknown
                raise SchemaVersionUnsupported(
                    exc.version, exc.type_name,
                    f"topic {record.topic} partition {record.partition} offset {record.offset}, tree {tree}",
                    unknown_type=exc.unknown_type,
                    topic=record.topic, partition=record.partition, offset=record.offset, tree_id=tree,
                ) from None
            except (orjson.JSONDecodeError, EnvelopeInvalid, TypeError) as exc:
                raw = record.value.decode("utf-8", "replace") if isinstance(record.value, bytes) else repr(record.value)
                # PostgreSQL text cannot hold NUL: kept escaped, else the reject itself would fail the batch.
                raw, error = raw[:4096].replace("\x00", "\\u0000"), str(exc).replace("\x00", "\\u0000")
                rejected.append(Rejected(record.topic, record.partition, record.offset, error, raw))
        try:
            report = self.store.apply(envelopes, rejected=rejected)
        except TranscriptGap as exc:
            # Nothing of the batch was committed, and the offsets stay where they were.
            raise AgentfoldError(
                "feed.gap", str(exc),
                "an event is missing from the topic (retention, another producer?): rebuild from a complete topic",
                tree_id=exc.tree_id, position=exc.got, expected=exc.expected,
            ) from exc
        self.report.batches += 1  # committed batches: one that failed comes again (see ``rewind``)
        die = self._crash(self.report.batches)
        if die is not None:
            die()
        self._commit_offsets()
        self.report.totals.add(report)
        if self.on_batch is not None:
            self.on_batch(report)
        return report

    def rewind(self) -> dict[str, int | None]:
        """Move every assigned partition back to its committed offset (its start when none), so
        what was polled since comes again: after a batch failed, nothing of it is lost, and what
        the database holds already is skipped as duplicates. Returns ``{"topic/partition": offset}``."""
        rewound: dict[str, int | None] = {}
        for tp in sorted(self.consumer.assignment()):
            committed = self.consumer.committed(tp)
            if committed is None:
                self.consumer.seek_to_beginning(tp)
            else:
                self.consumer.seek(tp, committed)
            rewound[f"{tp.topic}/{tp.partition}"] = committed
        return rewound

    def follow_until_stopped(
        self, stop: threading.Event, say: Callable[[str], None], *, backoff: float = 0.5, max_backoff: float = 30.0
    ) -> ConsumeReport:
        """``run`` until ``stop`` is set, through the failures ``consume_failed`` accepts.

        Each failure is one line (``say``), then a wait (``retry_until_stopped``); the next
        attempt opens a new database connection and rewinds to the committed offsets: a batch
        whose database transaction failed comes again (none of it was committed), and a batch
        whose commit succeeded unseen is skipped by the trees' high-water marks. Nothing is
        lost, no entry is written twice. Anything else is raised.
        """
        from agentfold.adapters.follower import retry_until_stopped

        again = False

        def attempt() -> None:
            nonlocal again
            if again:
                self.store.reconnect()
                rewound = self.rewind()
                at = ", ".join(f"{tp} at {'the start' if o is None else o}" for tp, o in rewound.items())
                say("following again from the committed offsets" + (f" ({at})" if at else ""))
            again = True
            self.run(stop)

        def failed() -> None:
            self.report.failures += 1  # as it happens: the report at the last resort shows it

        # Progress is a committed batch: an attempt that waits on a database that is down and
        # then fails does not reset the wait, however long it took (the wait keeps growing).
        retry_until_stopped(
            attempt, stop, say, retryable=consume_failed, backoff=backoff, max_backoff=max_backoff, on_failure=failed,
            progress=lambda: self.report.batches,
        )
        return self.report

    def _commit_offsets(self) -> None:
        from kafka.errors import CommitFailedError, KafkaError

        try:
            self.consumer.commit()
        except (CommitFailedError, KafkaError):
            # A rebalance took the partitions away: their next owner re-reads from the last
            # committed offsets and skips what the database already holds.
            self.report.commit_failures += 1

    def run(
        self,
        stop: threading.Event | None = None,
        *,
        idle_exit: float | None = None,
        until: Callable[[], bool] | None = None,
        poll_timeout: float = 0.5,
        join_timeout: float = 60.0,
    ) -> ConsumeReport:
        """Consume until ``stop`` is set, ``until()`` holds, or nothing came for ``idle_exit`` seconds
        (counted once the group assigned partitions to this member)."""
        stop = stop or threading.Event()
        self._subscribe(stop, wait=0.0 if idle_exit is not None else join_timeout)
        assigned_at = time.monotonic()  # the start, then the last poll after which partitions were assigned
        idle_since: float | None = None
        while not stop.is_set():
            got = self.poll_once(poll_timeout)
            if until is not None and until():
                break
            if got is not None:
                idle_since = None
                assigned_at = time.monotonic()
                continue
            if not self.assigned():
                # Counted from the last time it had partitions, not from the start: a long-running
                # member waits out a rebalance (or a rejoin after a long database outage) too.
                if time.monotonic() - assigned_at > join_timeout:
                    raise FeedError(f"no partition of {self.topic} was assigned within {join_timeout:g} s",
                                    retriable=False)
                continue
            assigned_at = time.monotonic()
            if idle_exit is not None:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= idle_exit:
                    break
        return self.report

    def _subscribe(self, stop: threading.Event, wait: float) -> None:
        """Join the group on the topic once it exists on the broker: at once for a batch job
        (``wait`` 0), else waiting up to ``wait`` seconds (a follower started before the first
        ``publish`` made the topic). A topic that does not exist is ``feed.unavailable``.

        Subscribing to a missing topic asks the broker's metadata for it, which creates it on
        brokers that auto-create topics (the test broker does, whatever the client asks): a
        wrong ``--topic`` then consumed an empty topic and reported success."""
        if self._subscribed:
            return
        deadline = time.monotonic() + wait
        while self.topic not in self.consumer.topics():
            if stop.is_set():
                return
            if time.monotonic() >= deadline:
                raise FeedError(
                    f"the topic {self.topic!r} does not exist on the broker at {self.bootstrap}"
                    + (f" (waited {wait:g} s)" if wait else "")
                    + "; check --topic (`agentfold publish` creates it)",
                    retriable=False,
                )
            stop.wait(min(1.0, max(0.0, deadline - time.monotonic())))
        self.consumer.subscribe([self.topic])
        self._subscribed = True

    def wait_assigned(self, timeout: float = 60.0) -> None:
        """Poll until the group assigned partitions (the broker misbehaves if a member leaves earlier)."""
        deadline = time.monotonic() + timeout
        while not self.assigned():
            if time.monotonic() > deadline:
                raise FeedError(f"no partition of {self.topic} was assigned within {timeout:g} s", retriable=False)
            self.poll_once(0.2)

    def interrupt(self) -> None:
        """End the database statement in progress now (``TranscriptStore.interrupt``) and leave
        the group at ``close`` without waiting for an assignment, for a consumer that stops
        (``agentfold.adapters.follower.StopGuard``). Safe from any thread."""
        self._interrupted = True
        self.store.interrupt()

    def close(self) -> None:
        # Leaving before the first join completes leaves the group stuck on the test broker.
        if self._subscribed and not self.assigned() and not self._interrupted:
            try:
                self.wait_assigned(15.0)
            except FeedError:
                pass
        self.consumer.close(autocommit=False)


def consume_all(
    store: TranscriptStore, bootstrap: str, topic: str, group: str, *, expected_events: int, timeout: float = 60.0,
    settle: float = 0.0, **options: Any,
) -> ConsumeReport:
    """Consume until the tables reflect ``expected_events`` distinct events (tests, batch jobs),
    then on until nothing more arrived for ``settle`` seconds (to see trailing duplicates)."""
    consumer = TranscriptConsumer(store, bootstrap, topic, group, **options)
    deadline = time.monotonic() + timeout
    try:
        def done() -> bool:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the transcripts reflect {store.events_applied()} of {expected_events} events")
            return store.events_applied() >= expected_events

        if not done():
            consumer.run(until=done)
        if settle > 0:
            consumer.run(idle_exit=settle)
        return consumer.report
    finally:
        consumer.close()

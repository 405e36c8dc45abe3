"""The event store: one eventsourcing stream per root tree, on memory, SQLite or PostgreSQL.

Store URLs:

* ``memory:`` - a volatile store inside this process (tests);
* ``sqlite:///path/to/file.db`` (``sqlite:////abs/path.db``) - the embedded default;
* ``postgresql://user:password@host:port/dbname`` - production. No query string: TLS and
  other connection settings come from libpq's environment variables (``PGSSLMODE``,
  ``PGSSLROOTCERT``, ``PGCONNECT_TIMEOUT``, ...; docs/cli.md).

``EventStore(url)`` creates agentfold's tables in a new database (or a new SQLite file);
``EventStore(url, create=False)`` creates nothing and refuses a store without them
(``store.not_found``), so a role that may only read can open an existing store.
Opening a PostgreSQL store first makes one direct connection with a short timeout, so a
wrong password, a missing database or an unreachable server is reported at once with the
server's own reason (not after the connection pool's 30 s wait).

An append writes a list of events atomically at an expected version (optimistic
concurrency). A duplicate version raises :class:`VersionConflict`, unless the very
same events (same digests) are already the head of the stream, which makes a retry
after a lost response idempotent. Loading a tree reads its latest snapshot and folds
only the events after it, verifying the digest chain of every event read.

``EventStore.interrupt()`` makes every PostgreSQL call of a store fail at once, for a
command that stops while the server does not answer (``agentfold.adapters.follower.StopGuard``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import re
import shutil
import socket
import sqlite3
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import unquote, urlsplit

import orjson
from eventsourcing.persistence import (
    InfrastructureFactory,
    IntegrityError,
    Notification,
    PersistenceError,
    StoredEvent,
)
from eventsourcing.utils import Environment

from agentfold.adapters.codec import (
    MAX_SNAPSHOT_BYTES,
    PATCHED_START_TOPIC,
    STATE_COMPRESSOR,
    DecodeError,
    OrjsonTranscoder,
    PydanticMapper,
    RecordedEvent,
    stored_json,
)
from agentfold.adapters.leases import FileLeases, LeaseManager, MemoryLeases, PostgresLeases, RefusedLeases
from agentfold.adapters.recorders import (
    EVENTS_TABLE,
    MALFORMED_VERSION,
    PG_POOL_WAIT,
    PROCESSES_TABLE,
    SNAPSHOTS_TABLE,
    TREES_TABLE,
    HeadFilter,
    IndexHeadMismatch,
    IndexQueries,
    MemorySnapshotRecorder,
    MemoryTreeRecorder,
    SQLiteSnapshotRecorder,
    SQLiteTreeRecorder,
    TreeHead,
    cache_statements,
)
from agentfold.domain.errors import AgentfoldError, InvalidInput, NotFound, Rejected, StoreFailure, recorded_text
from agentfold.domain.events import TreeEvent
from agentfold.domain.ids import ProcessID, StartID, TreeID
from agentfold.domain.integrity import SealError, unseal
from agentfold.domain.program import ProgramResolver
from agentfold.domain.tree import FoldError, TreeState

log = logging.getLogger("agentfold.store")

DEFAULT_STORE = "sqlite:///./agentfold.db"
SNAPSHOT_TOPIC = "agentfold:TreeSnapshot"

#: The shape of a storage snapshot's tree. 1: before mailbox compaction (every consumed record
#: kept, no ``arrivals``/``consumed_through`` counters; releases before 2026-11-29 21:20 UTC);
#: 2: compacted mailboxes. Snapshots of 2 written before the member existed have no ``format``.
#: A snapshot of another format is not used (but see ``FORMAT_WITHOUT_INPUT_PATCHES``): the load
#: folds the events (the truth), and the runtime's next append writes a current snapshot. Bump it
#: whenever the tree's JSON changes in a way ``TreeState.from_json`` cannot read back to the state
#: a fold gives.
#: 3: sealed (``snapshot_seal``): a snapshot whose tree was edited under its digest is not used.
#: 4: a Process whose start stored its input as changes (``input_patch``, a team's Turns) holds
#: that patch in place of its input (2026-12-05): a reader of format 3 would fail on it (no input).
SNAPSHOT_FORMAT = 4

#: A format-3 snapshot is format 4 for a tree with no input stored as changes up to its version
#: (the only difference): loads use it when no event there is ``EffectDeclared@2`` (what stores
#: one), so an upgrade leaves every other tree's snapshot in use.
FORMAT_WITHOUT_INPUT_PATCHES = 3


def snapshot_seal(tree: dict[str, Any], digest: str) -> str:
    """The seal of a snapshot: a sha256 of its tree's canonical JSON bound to the digest of
    the event it was taken at. A snapshot's ``digest`` only says which event it claims to
    follow; without the seal, a tree edited under it (a hand edit, a bad migration) was
    loaded, shown and driven on as if folded from the events."""
    body = orjson.dumps(tree, option=orjson.OPT_SORT_KEYS)
    return "sha256:" + hashlib.sha256(b"agentfold.snapshot\x00" + digest.encode("ascii") + b"\x00" + body).hexdigest()


def snapshot_format(data: dict[str, Any]) -> int:
    """The format of a stored snapshot's JSON (-1 when it names one that is not a number)."""
    given = data.get("format")
    if given is not None:
        return given if isinstance(given, int) and not isinstance(given, bool) else -1
    compacted = all("arrivals" in process["mailbox"] for process in data["tree"]["processes"])
    return 2 if compacted else 1


@dataclass(frozen=True, slots=True)
class StoredSnapshot:
    """A snapshot row's state, decoded (``decode_snapshot``)."""

    format: int  # SNAPSHOT_FORMAT, an earlier or later one, or -1: a format member that is no number
    tree: dict[str, Any]
    digest: str
    seal: str | None = None

    @property
    def sealed(self) -> bool:
        """Whether its tree is the one sealed with its digest (``snapshot_seal``)."""
        return self.seal is not None and self.seal == snapshot_seal(self.tree, self.digest)


def decode_snapshot(state: bytes) -> StoredSnapshot:
    """A stored snapshot row's state (deflated or not): its format, tree JSON and digest.
    Malformed: ``SealError``, ``orjson.JSONDecodeError``, ``KeyError`` or ``TypeError``."""
    data = orjson.loads(stored_json(state, MAX_SNAPSHOT_BYTES))
    seal = data.get("seal")
    return StoredSnapshot(snapshot_format(data), data["tree"], str(data["digest"]), seal if isinstance(seal, str) else None)


# The tables every store has (created together by ``EventStore(url)``).
STORE_TABLES = (EVENTS_TABLE, TREES_TABLE, PROCESSES_TABLE, SNAPSHOTS_TABLE)
# Seconds the first PostgreSQL connection may take (PGCONNECT_TIMEOUT, when set, wins).
PG_CONNECT_TIMEOUT = 10
#: Seconds a PostgreSQL statement may go unanswered before this process ends its sessions to the
#: server (``AGENTFOLD_PG_STATEMENT_WAIT``; 0: no bound). See ``EventStore._watch_statements``.
PG_STATEMENT_WAIT = 60.0
#: Seconds either end of a PostgreSQL connection waits for the other at the TCP level before it
#: drops the connection (``AGENTFOLD_PG_TCP_TIMEOUT``; 0: the operating system's defaults). See
#: ``pg_tcp_params``.
PG_TCP_TIMEOUT = 30
NOT_FOUND_HINT = "check the store URL; a store is created by opening it with create=True"
PG_URL_HINT = "write it as postgresql://user:password@host:port/dbname, percent-encoding @ : / ? # in the user or password"
PG_ENVIRONMENT_HINT = (
    "set libpq's environment variables instead, e.g. PGSSLMODE, PGSSLROOTCERT, PGCONNECT_TIMEOUT: "
    "see the store URLs in docs/cli.md"
)


class VersionConflict(Rejected):
    """Another writer appended at this version first: reload, re-validate, never retry blindly."""

    def __init__(self, tree_id: TreeID, expected: int) -> None:
        super().__init__(
            "engine.tree.version_conflict",
            f"tree {tree_id} changed after version {expected}",
            hint="reload the tree and validate the request again",
        )
        self.tree_id = tree_id
        self.expected = expected


def row_state(tree: TreeState) -> tuple[str, str, tuple[str, ...]]:
    """The ``status``, ``classification`` and ``unknown_effect_ids`` an ``agentfold_trees`` row
    holds for a folded tree (every writer stores these; loads check them)."""
    return tree.root.status, tree.classification(), tuple(sorted(tree.unknown_ids))


def row_disagreement(row: TreeHead, tree: TreeState) -> str | None:
    """How an ``agentfold_trees`` row at the tree's version disagrees with the fold there, if
    it does. A row an earlier release stored ``parked`` where the fold now says ``progress``
    (a waiting run with an end recorded and not yet carried out: docs/audit.md) is no
    disagreement here: ``recover`` drives such a run, which rewrites the row."""
    root = tree.root
    status, classification, unknown = row_state(tree)
    if (row.classification, classification) == ("parked", "progress"):
        classification = "parked"
    expected = (("start_id", str(tree.start_id)), ("root_process_id", str(root.process_id)), ("program", root.program.name),
                ("status", status), ("classification", classification), ("unknown_effect_ids", unknown))
    for column, value in expected:
        stored = getattr(row, column)
        if stored != value:
            return f"the tree index's {column} is {stored!r}; the fold at position {tree.version} gives {value!r}"
    return None


class CorruptStream(StoreFailure):
    """The stored history breaks a rule (digest chain or fold)."""

    def __init__(self, tree_id: str, position: int, rule: str, detail: str) -> None:
        super().__init__(
            "store.corrupt", f"tree {tree_id} is corrupt at position {position}: {rule}: {detail}",
            f"see what is wrong with `agentfold audit verify {tree_id}`",
            tree_id=str(tree_id), position=position, rule=rule,
        )
        self.tree_id = tree_id
        self.position = position
        self.rule = rule
        self.detail = detail  # the broken rule's text (also in the message)


@dataclass(frozen=True, slots=True)
class AppendResult:
    digest: str
    notification_ids: tuple[int, ...]
    #: The snapshot JSON an append did not write because it is larger than
    #: ``INLINE_SNAPSHOT_BYTES``: the caller writes it afterwards (``write_snapshot``).
    snapshot_body: bytes | None = None


#: Snapshots whose JSON is at most this long are written in the append's own transaction.
#: A larger one (a long conversation: every message, every finished Tool child) takes
#: milliseconds to deflate (~3 ms per 200 KB), so it is handed back to be written after
#: the append, off the owner's critical path (zlib runs without the GIL, on another core).
INLINE_SNAPSHOT_BYTES = 64 * 1024


@dataclass(slots=True)
class LoadedTree:
    state: TreeState
    digest: str | None
    snapshot_version: int = 0


def lower_scheme(url: str) -> str:
    """``url`` with a ``postgresql``, ``postgres`` or ``sqlite`` scheme in lower case (a URL's
    scheme is case-insensitive, RFC 3986)."""
    scheme, sep, rest = url.partition("://")
    return scheme.lower() + sep + rest if sep and scheme.lower() in ("postgresql", "postgres", "sqlite") else url


def parse_store_url(url: str) -> tuple[str, dict[str, str]]:
    """Split a store URL into a backend name and eventsourcing environment settings."""
    url = lower_scheme(url)
    if url in ("memory:", "memory://"):
        return "memory", {"PERSISTENCE_MODULE": "eventsourcing.popo"}
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :]
        if not path:
            raise InvalidInput("store.url_invalid", f"sqlite URL {url!r} names no file", hint="sqlite:///path/to/file.db")
        if "?" in path or "#" in path:
            # It used to become part of the file name: `sqlite:///runs.db?mode=ro` opened (and
            # created) a file called "runs.db?mode=ro", and nothing was read-only.
            raise InvalidInput(
                "store.url_invalid",
                f"sqlite URL {url!r} has parameters after '?' or '#': agentfold takes none, and a file name cannot contain them",
                hint="give the file's path alone, sqlite:///path/to/file.db: commands that only read never write to "
                "the file, so no mode=ro is needed",
            )
        return "sqlite", {
            "PERSISTENCE_MODULE": "eventsourcing.sqlite",
            "SQLITE_DBNAME": path,
            "SQLITE_LOCK_TIMEOUT": "30",
        }
    if url.startswith(("postgresql://", "postgres://")):
        if "?" in url or "#" in url:
            # Parameters were silently dropped before (a `?sslmode=require` connected in
            # plain text): refuse them rather than ignore a security setting.
            base = redact(url.split("?", 1)[0].split("#", 1)[0])
            raise InvalidInput(
                "store.url_invalid",
                f"PostgreSQL URL {base} has parameters after '?' or '#', which agentfold does not pass on",
                hint=f"remove them; {PG_ENVIRONMENT_HINT}",
            )
        # urllib's own messages may quote parts of the password (an unencoded '/' in it
        # makes the rest look like a port): say what is wrong in our words.
        try:
            parts = urlsplit(url)
            hostname = parts.hostname
        except ValueError:
            raise InvalidInput(
                "store.url_invalid",
                f"PostgreSQL URL {redact(url)} is malformed: its host is not a name, an IPv4 address "
                "or an IPv6 address in [brackets]",
                hint=PG_URL_HINT,
            ) from None
        try:
            port = parts.port
        except ValueError:
            raise InvalidInput(
                "store.url_invalid",
                f"PostgreSQL URL {redact(url)} has no valid port: a port is a number from 1 to 65535",
                hint=PG_URL_HINT,
            ) from None
        dbname = unquote(parts.path.lstrip("/"))
        if "\x00" in url or any("\x00" in unquote(part or "") for part in (parts.username, parts.password, dbname)):
            # libpq ends a value at a NUL: "db%00x" connected to "db" over the default socket.
            raise InvalidInput(
                "store.url_invalid", f"PostgreSQL URL {redact(url)} has a NUL character (%00)",
                hint=PG_URL_HINT,
            )
        if not hostname or not dbname:
            raise InvalidInput(
                "store.url_invalid", f"PostgreSQL URL {redact(url)} needs a host and a database", hint=PG_URL_HINT,
            )
        if port == 0:
            raise InvalidInput(
                "store.url_invalid",
                f"PostgreSQL URL {redact(url)} has no valid port: a port is a number from 1 to 65535",
                hint=PG_URL_HINT,
            )
        return "postgresql", {
            "PERSISTENCE_MODULE": "eventsourcing.postgres",
            "POSTGRES_DBNAME": dbname,
            "POSTGRES_HOST": hostname,
            "POSTGRES_PORT": str(port or 5432),
            "POSTGRES_USER": unquote(parts.username or "postgres"),
            "POSTGRES_PASSWORD": unquote(parts.password or ""),
            "POSTGRES_POOL_SIZE": "4",
            "POSTGRES_MAX_OVERFLOW": "8",
            "POSTGRES_IDLE_IN_TRANSACTION_SESSION_TIMEOUT": "30",
        }
    raise InvalidInput(
        "store.url_invalid",
        f"unsupported store URL {redact(url)!r}",
        hint="use memory:, sqlite:///path.db or postgresql://user:pass@host:port/db",
    )


def seconds_setting(name: str, default: float, low: float, high: float, *, zero: str = "",
                    code: str = "store.setting_invalid") -> float:
    """A number of seconds from the environment variable ``name`` (from ``low`` to ``high``, or 0
    when ``zero`` says what 0 means), else ``default``; anything else is refused before connecting."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if (zero and value == 0) or low <= value <= high:  # NaN fails both
        return value
    allowed = f"from {low:g} to {high:g}" + (f", or 0 ({zero})" if zero else "")
    raise InvalidInput(
        code,
        f"{name}={text!r} is not a number of seconds {allowed}",
        hint=f"unset it for the default ({default:g} s), or set e.g. {name}=10",
    )


def pg_statement_wait() -> float:
    """``AGENTFOLD_PG_STATEMENT_WAIT`` (0: no bound), else ``PG_STATEMENT_WAIT``."""
    return seconds_setting("AGENTFOLD_PG_STATEMENT_WAIT", PG_STATEMENT_WAIT, 1, 86400, zero="no bound")


def pg_pool_wait() -> float:
    """Seconds a PostgreSQL store call waits for a pooled connection: ``AGENTFOLD_PG_POOL_WAIT``
    (a number from 1 to 3600), else ``PG_POOL_WAIT``."""
    return seconds_setting("AGENTFOLD_PG_POOL_WAIT", PG_POOL_WAIT, 1, 3600)


def pg_tcp_timeout() -> int:
    """``AGENTFOLD_PG_TCP_TIMEOUT`` (a whole number of seconds from 1 to 3600, or 0 for the operating
    system's defaults), else ``PG_TCP_TIMEOUT``."""
    value = seconds_setting("AGENTFOLD_PG_TCP_TIMEOUT", PG_TCP_TIMEOUT, 1, 3600, zero="the system's defaults")
    if value != int(value):
        raise InvalidInput(
            "store.setting_invalid", f"AGENTFOLD_PG_TCP_TIMEOUT={value:g} is not a whole number of seconds",
            hint=f"unset it for the default ({PG_TCP_TIMEOUT} s), or set e.g. AGENTFOLD_PG_TCP_TIMEOUT=10",
        )
    return int(value)


def _tcp_settings(timeout: int) -> dict[str, int]:
    """Keepalives idle ``timeout`` s, then every third of it (at least 1 s), 3 unanswered probes;
    data unacknowledged for ``timeout`` s ends the connection (milliseconds)."""
    return {"idle": timeout, "interval": max(1, timeout // 3), "count": 3, "user_timeout": timeout * 1000}


def pg_tcp_params(timeout: int | None = None) -> dict[str, Any]:
    """libpq parameters that make this end of a connection notice, within about ``timeout``
    seconds (default: ``pg_tcp_timeout()``), that the server is gone without a word (its host
    lost power or its network, a firewall or NAT dropped the connection): TCP keepalives and
    ``tcp_user_timeout`` (``_tcp_settings``). By default Linux sends the first keepalive after
    2 hours and resends unacknowledged data for ~15 minutes, while a call waits on the dead
    connection. The server's end gets the same through ``set_server_tcp``. Connections over a
    Unix socket ignore both."""
    timeout = pg_tcp_timeout() if timeout is None else timeout
    if not timeout:
        return {}
    tcp = _tcp_settings(timeout)
    return {"keepalives": 1, "keepalives_idle": tcp["idle"], "keepalives_interval": tcp["interval"],
            "keepalives_count": tcp["count"], "tcp_user_timeout": tcp["user_timeout"]}


_server_tcp_refused = threading.Event()  # warned once per process


#: Run on every PostgreSQL session that writes (autocommit): a session whose
#: ``synchronous_commit`` is ``off`` (set for the server, the database or the role) commits at
#: ``local`` instead. ``off`` acknowledges a commit before its WAL is on disk: a server crash
#: would drop appends already acknowledged, and a tool whose dispatch permission was dropped
#: could be called again once the run is recovered. ``local``, ``on``, ``remote_write`` and
#: ``remote_apply`` are kept (each waits for the local flush at least). One round trip.
PG_DURABLE_COMMITS = (
    "SELECT set_config('synchronous_commit', 'local', false) WHERE current_setting('synchronous_commit') = 'off'"
)


def ensure_durable_commits(conn: Any) -> None:
    """Make this session's commits durable on the server's disk (``PG_DURABLE_COMMITS``)."""
    conn.execute(PG_DURABLE_COMMITS)


#: PostgreSQL's SQLSTATE for a write in a read-only transaction (read_only_sql_transaction).
READ_ONLY_SQLSTATE = "25006"


def causes(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and the errors it was raised from (``__cause__``, else ``__context__``), each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def read_only_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` itself is PostgreSQL refusing a write because the session is read-only."""
    return getattr(exc, "sqlstate", None) == READ_ONLY_SQLSTATE


def refuses_writes(exc: BaseException | None) -> bool:
    """Whether ``exc`` or one of its causes is PostgreSQL refusing a write because the session is
    read-only: a hot standby (e.g. a host name that leads to the standby after a failover) or
    ``default_transaction_read_only``. Another attempt on the same server meets it again."""
    return any(read_only_refusal(cause) for cause in causes(exc))


def read_only_server(what: str) -> StoreFailure:
    """``store.read_only`` for a write the PostgreSQL server refused (``refuses_writes``)."""
    return StoreFailure(
        "store.read_only",
        f"{what}: the PostgreSQL server accepts no writes in this database (a standby, or "
        "default_transaction_read_only is on for the server, the database or the role)",
        hint="point the URL at the primary (PGTARGETSESSIONATTRS=read-write makes libpq skip a standby); "
        "read commands (trees, show, unknown, results, audit verify, export) work on a standby as they are",
    )


def set_server_tcp(conn: Any, timeout: int, *, user_timeout: bool = True) -> None:
    """Ask the server to notice, within about ``timeout`` seconds, that this session's client
    is gone without a word (0: leave the server's settings). ``conn`` is in autocommit mode.

    The server otherwise keeps the session of a vanished process for hours (its
    ``tcp_keepalives_*`` default to the system's: 2 hours), and with the session its advisory
    locks: the owner leases of that process's runs, which no other runtime could adopt. Set
    with ``SET`` on the open session (any role may, for its own session), not as startup
    ``options``, which PgBouncer refuses. ``user_timeout=False`` leaves the server's
    ``tcp_user_timeout`` alone: it would also end a session whose client does not read for
    ``timeout`` seconds (a LISTEN session while its follower is busy). A server that knows no
    ``tcp_user_timeout`` (before PostgreSQL 12) gets the keepalives; one that refuses the
    settings (a proxy) gets nothing, with one warning per process. Through a proxy, the
    settings apply to the proxy's connection, not this process's."""
    if not timeout:
        return
    import psycopg

    tcp = _tcp_settings(timeout)
    keepalives = (f"SET tcp_keepalives_idle = {tcp['idle']}; SET tcp_keepalives_interval = {tcp['interval']}; "
                  f"SET tcp_keepalives_count = {tcp['count']}")
    try:
        try:
            conn.execute(f"{keepalives}; SET tcp_user_timeout = {tcp['user_timeout']}" if user_timeout else keepalives)
        except psycopg.errors.UndefinedObject:
            if not user_timeout:
                raise
            conn.execute(keepalives)  # PostgreSQL 11: no tcp_user_timeout
    except psycopg.OperationalError:
        raise
    except psycopg.DatabaseError as exc:
        if not _server_tcp_refused.is_set():
            _server_tcp_refused.set()
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.warning("the PostgreSQL server refused its TCP keepalive settings (%s): it may keep the session "
                        "of a vanished process, and its leases, for hours (AGENTFOLD_PG_TCP_TIMEOUT)", reason)


def _on_read_only_fs(path: Path) -> bool:
    """Whether ``path`` (or, when it does not exist, its folder) is on a read-only file system."""
    try:
        target = path if path.exists() else path.absolute().parent
        return bool(os.statvfs(target).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def sqlite_read_only_uri(path: Path) -> str | None:
    """The ``file:`` URI to read the SQLite store at ``path`` with, its file system being
    mounted read-only (None when ``path`` cannot be examined).

    There SQLite cannot create the ``-shm`` file a WAL-mode store needs: with no write-ahead
    log beside it (a store closed cleanly, or a copy of its main file), every commit is in
    the file, so it is opened ``immutable`` (docs/cli.md: a read-only view of a folder that
    something else still writes to is not supported); with a log, even an empty one,
    ``mode=ro`` reads the log too (SQLite then needs the ``-shm`` file beside it).
    """
    try:
        real = path.resolve()  # SQLite names the -wal after the file a link points to
        logged = Path(f"{real}-wal").exists()
    except OSError:
        return None
    return f"{real.as_uri()}?{'mode=ro' if logged else 'immutable=1'}"


#: SQLite's primary result codes for a file whose pages are damaged or that is no database.
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26
DAMAGED_HINT = (
    "the SQLite file itself is damaged (its pages, not a history that fails verification): stop the processes "
    "that use it and restore it from a backup, or salvage its rows with `sqlite3 FILE .recover | sqlite3 NEW.db` "
    "and check the copy with `agentfold audit verify --all`"
)


def sqlite_damage(exc: BaseException, url: str = "") -> StoreFailure | None:
    """``store.damaged`` when ``exc`` (or an error it was raised from) is SQLite finding its
    file damaged (``database disk image is malformed``) or not a database; else None."""
    name = f"the store {redact(url)}" if url else "the store's file"
    for seen in causes(exc):
        code = getattr(seen, "sqlite_errorcode", None)
        text = str(seen)
        if (isinstance(code, int) and code & 0xFF == _SQLITE_NOTADB) or "file is not a database" in text:
            return StoreFailure(
                "store.damaged", f"{name} is not an SQLite database, or its first page is damaged ({text})",
                hint="check that the URL names the store's file; if it does, " + DAMAGED_HINT,
            )
        if (isinstance(code, int) and code & 0xFF == _SQLITE_CORRUPT) or "database disk image is malformed" in text:
            return StoreFailure("store.damaged", f"{name} is damaged: {text}", hint=DAMAGED_HINT)
    return None


def sqlite_unwritable(exc: BaseException, what: str, files: str = "") -> StoreFailure | None:
    """``store.read_only`` when ``exc`` is SQLite refusing to write a database file this process
    may not write (``attempt to write a readonly database``: the file's or its ``-wal``/``-shm``
    files' owner or mode); else None. Every attempt meets it again, as on a read-only file system."""
    if not any("readonly database" in str(seen) for seen in causes(exc)):
        return None
    return StoreFailure(
        "store.read_only",
        f"{what}: {exc}: this process may not write the store's files ({files or 'the database file, its -wal and -shm files'})",
        hint="give this user write access to the database file, its -wal and -shm files and their folder (a command "
        "run as another user may have created -wal/-shm files this one cannot write); nothing was written",
    )


#: Below this much free space on its file system, an SQLite store that fails to open with an
#: I/O or "disk is full" error is reported as on a full disk.
FULL_DISK_BYTES = 1 << 20


def sqlite_full(exc: BaseException, path: Path, url: str = "") -> StoreFailure | None:
    """``store.unavailable`` naming a full file system when ``exc`` is SQLite failing to open or
    write ``path`` (``disk I/O error``, ``database or disk is full``) on a file system with
    less than ``FULL_DISK_BYTES`` free; else None. SQLite creates the ``-shm`` file (32 KiB)
    to open a WAL database, so on a full disk even reading the store fails."""
    texts = ("disk I/O error", "disk is full", "unable to open database file")
    if not any(text in str(seen) for seen in causes(exc) for text in texts):
        return None
    try:
        free = shutil.disk_usage(path.absolute().parent).free
        stats = os.statvfs(path.absolute().parent)
    except OSError:
        return None
    # A file system that counts no inodes (btrfs, vfat, many network ones) says 0 of 0 free.
    no_inode = stats.f_files > 0 and stats.f_favail == 0
    if free >= FULL_DISK_BYTES and not no_inode:
        return None
    room = f"{free} bytes free" if free < FULL_DISK_BYTES else "no file left to create (no free inode)"
    return StoreFailure(
        "store.unavailable",
        f"cannot open store {redact(url) if url else path}: {exc}: the file system holding it has {room}",
        hint="free space on that file system (bytes, or inodes: room for new files): SQLite needs room for the "
        "store's -wal and -shm files even to read it; nothing was changed (a store that cannot be opened is not written)",
    )


@dataclass(frozen=True, slots=True)
class Changed:
    """A tree with events in a range of the notification log (``EventStore.changes``)."""

    tree_id: TreeID
    first: int  # the notification id of its first event in the range
    low: int  # its lowest position in the range (1: the range holds its creation)
    high: int  # its highest position in the range
    last: int  # the notification id of its last event in the range


class UnsealedSnapshot(ValueError):
    """A stored snapshot whose tree does not match its seal (``snapshot_seal``)."""


class OutdatedSnapshot(ValueError):
    """A stored snapshot in a format this release does not read back (``SNAPSHOT_FORMAT``)."""


def read_failure(exc: BaseException, what: str) -> StoreFailure:
    """A failed read of ``what``: ``store.damaged`` with what to do when SQLite found its file
    damaged, else ``store.read_failed``."""
    return sqlite_damage(exc) or StoreFailure("store.read_failed", f"{what} failed: {exc}")


#: What to do when the store refused the first append of a tree: there is no run to continue.
START_FAILED_HINT = (
    "nothing was stored: the run was not started; fix the store (free disk space, write access), then start "
    "it again (with the same start id, if one was given)"
)
#: What to do when the store refused an append (nothing of it was written).
APPEND_FAILED_HINT = (
    "nothing of this append was stored (an answer, a resolution or a control it carried was not recorded: send it "
    "again); fix the store (free disk space, write access), then the run continues where it stopped: a live "
    "server or runtime adopts it again, else run `agentfold recover`"
)


OPEN_FAILED_HINT = (
    "check that this user may read and write the store's file and its folder (SQLite), or that the server "
    "answers (PostgreSQL); then retry"
)


def sqlite_path_note(path: Path) -> str:
    """Where a relative SQLite path leads (``sqlite:///`` + a path without a leading slash is
    relative to the working directory), for messages; empty for an absolute path."""
    return "" if path.is_absolute() else f" (a relative path: {path.absolute()})"


def sqlite_folder_problem(url: str, path: Path) -> InvalidInput | None:
    """Why a new SQLite store cannot be created at ``path``: its folder does not exist, or is not
    a folder (None when it is one, or cannot be examined: SQLite reports that). Three slashes
    name a relative path, so ``sqlite:///tmp/x.db`` is ``./tmp/x.db``, not ``/tmp/x.db``."""
    folder = path.absolute().parent
    try:
        if folder.is_dir():
            return None
        exists = folder.exists()
    except OSError:
        return None
    if exists:
        hint = f"{folder} is a file: name the store's file inside a folder that exists"
    elif str(path).startswith("~"):
        hint = "SQLite does not expand ~: write the whole path, e.g. sqlite:////home/me/agentfold.db (four slashes)"
    elif path.is_absolute():
        hint = (f"create the folder {folder} first, or name a file in a folder that exists; "
                "sqlite:///relative.db is relative to the working directory, sqlite:////absolute/path.db absolute")
    else:
        hint = (f"three slashes name a path relative to the working directory ({Path.cwd()}): for /{path} write "
                f"sqlite:////{path} (four slashes); or create the folder {folder} first")
    return InvalidInput(
        "store.url_invalid",
        f"cannot create the store {redact(url)} at {path.absolute()}: its folder {folder} "
        + ("is not a folder" if exists else "does not exist") + "; nothing was created",
        hint=hint,
    )


def create_private(path: Path) -> bool:
    """Create a new SQLite database file (a store, a transcript database) readable by its owner
    only (0600): it holds conversations. SQLite gives the ``-wal`` and ``-shm`` files the
    database file's mode. An existing file keeps its mode; a file that cannot be created is
    left to SQLite to report. Whether this call created it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    os.close(fd)
    return True


def remove_if_empty(path: Path) -> None:
    """Remove a store file this process created and could not set up (a full disk): left
    empty, it would later read as a store without tables (``store.not_found``)."""
    try:
        if os.path.getsize(path) != 0:
            return  # something was written: left for the operator
    except OSError:
        return
    for name in (f"{path}-wal", f"{path}-shm", str(path)):  # the database file last
        try:
            os.unlink(name)
        except OSError:
            pass


def _tree_of_row(originator: object) -> TreeID | None:
    """The tree an event row's originator_id names; None when it names none (NULL, not a uuid)."""
    if isinstance(originator, uuid.UUID):
        return TreeID.from_uuid(originator)
    try:
        return TreeID.from_uuid(uuid.UUID(hex=str(originator))) if isinstance(originator, str) else None
    except ValueError:
        return None


class NamelessRow(StoreFailure, ValueError):
    """A stored event row that names no tree (``store.corrupt``): listings and the read-model
    followers stop there. Still the ValueError eventsourcing's read raised, for a reader that
    reads such rows as stored instead (the feed's publisher)."""


def nameless_row(what: str, originator: object) -> NamelessRow:
    """``store.corrupt`` for ``what`` (an event row) whose originator_id ``originator`` names no
    tree: the listings, the read-model followers and the feed's publisher stop there."""
    return NamelessRow(
        "store.corrupt", f"{what} names no tree: its originator_id {originator!r} is not a tree id",
        hint="the row was written by hand: `agentfold audit verify --all` names it; delete it or restore the "
        "store from a backup or an export (docs/audit.md)",
    )


class EventStore:
    """Tree streams, snapshots and the tree index over one eventsourcing database.

    ``create``: make the tables (and the SQLite file) when they are missing; when False,
    nothing is created and a store without agentfold's tables is refused
    (``store.not_found``). A memory store is always new.
    """

    def __init__(self, url: str = DEFAULT_STORE, *, create: bool = True) -> None:
        if not isinstance(url, str):
            raise InvalidInput("store.url_invalid", f"a store URL is text, not {type(url).__name__}",
                               hint="pass sqlite:///path.db, postgresql://user:password@host:port/dbname or memory:")
        self.url = url
        self.backend, settings = parse_store_url(url)
        self._settings = settings
        if self.backend == "sqlite" and Path(settings["SQLITE_DBNAME"]).is_dir():
            raise InvalidInput("store.url_invalid", f"{redact(url)} names a directory, not an SQLite file",
                               hint="name the store's file, e.g. sqlite:///path/agentfold.db")
        if (self.backend == "sqlite" and create and not self._sqlite_in_memory
                and not settings["SQLITE_DBNAME"].startswith("file:")):
            # SQLite would only say "unable to open database file" (store.unavailable, "retry").
            missing = sqlite_folder_problem(url, Path(settings["SQLITE_DBNAME"]))
            if missing is not None:
                raise missing
        # A store on a read-only file system (a backup or an evidence copy mounted read-only) is
        # read through a read-only URI: SQLite cannot open a WAL-mode file there otherwise. A
        # command that would create runs there is refused before anything is opened (sqlite3
        # would only say "unable to open database file").
        self.read_only_uri: str | None = None
        created_file = False
        if self.backend == "sqlite" and _on_read_only_fs(Path(settings["SQLITE_DBNAME"])):
            if create:
                raise self._read_only_failure()
            self.read_only_uri = sqlite_read_only_uri(Path(settings["SQLITE_DBNAME"]))
        if self.backend == "sqlite" and not create:
            self._require_sqlite_store(Path(settings["SQLITE_DBNAME"]))
        if (self.backend == "sqlite" and create and self.read_only_uri is None and not self._sqlite_in_memory
                and not settings["SQLITE_DBNAME"].startswith("file:")):  # a file: URI names its file otherwise
            created_file = create_private(Path(settings["SQLITE_DBNAME"]))
        pool_wait = pg_pool_wait() if self.backend == "postgresql" else 0.0
        statement_wait = pg_statement_wait() if self.backend == "postgresql" else 0.0
        self._tcp_timeout = pg_tcp_timeout() if self.backend == "postgresql" else 0
        if self.backend == "postgresql":  # read once per store: pg_conninfo takes it from settings
            settings["AGENTFOLD_PG_TCP_TIMEOUT"] = str(self._tcp_timeout)
        self._watchdog_stop = threading.Event()
        if self.backend == "postgresql":
            check_postgres(url, settings)
        self.mapper = PydanticMapper(transcoder=OrjsonTranscoder())
        self._memory_leases: dict[TreeID, object] = {}
        self._memory_lock = threading.Lock()
        # Every PostgreSQL session this store opened (pooled, LISTEN): ``interrupt`` ends them.
        self._sessions: weakref.WeakSet[Any] = weakref.WeakSet()
        self._sessions_lock = threading.Lock()
        self._interrupted = False
        try:
            if self.backend == "memory":
                self.factory: Any = None
                self.recorder: Any = MemoryTreeRecorder()
                self.snapshots: Any = MemorySnapshotRecorder()
            else:
                env = Environment("AGENTFOLD", settings)
                self.factory = InfrastructureFactory.construct(env)
                if self.backend == "sqlite":
                    cache_statements(self.factory.datastore)
                    self.factory.datastore.pool.connect_uri = self.read_only_uri
                    self.recorder = SQLiteTreeRecorder(self.factory.datastore)
                    self.snapshots = SQLiteSnapshotRecorder(self.factory.datastore)
                else:
                    from agentfold.adapters.recorders_postgres import (  # psycopg: PostgreSQL stores only
                        PostgresSnapshotRecorder,
                        PostgresTreeRecorder,
                        fail_fast_without_connection,
                        prefer_recent_connections,
                        reconnect_steadily,
                    )

                    prefer_recent_connections(self.factory.datastore)
                    fail_fast_without_connection(self.factory.datastore, pool_wait)
                    reconnect_steadily(self.factory.datastore)
                    self._track_sessions(self.factory.datastore.pool)
                    if not os.environ.get("PGCONNECT_TIMEOUT"):  # the pool's own connections: bounded too
                        self.factory.datastore.pool.kwargs["connect_timeout"] = PG_CONNECT_TIMEOUT
                    self.factory.datastore.pool.kwargs.update(pg_tcp_params(self._tcp_timeout))
                    if statement_wait > 0:  # stopped by close(), also when opening fails below
                        threading.Thread(target=self._watch_statements, args=(statement_wait,), daemon=True,
                                         name="agentfold-pg-watchdog").start()
                    self.recorder = PostgresTreeRecorder(self.factory.datastore)
                    self.snapshots = PostgresSnapshotRecorder(self.factory.datastore)
                if create:
                    with self.schema_lock():
                        self.recorder.create_table()
                        self.snapshots.create_table()
                elif self.backend == "postgresql":
                    self._require_tables()
        except (InvalidInput, NotFound):
            self.close()
            raise
        except (PersistenceError, OSError) as exc:
            self.close()
            if refuses_writes(exc):
                raise read_only_server(f"cannot open store {redact(url)} to write") from exc
            full = sqlite_full(exc, Path(settings["SQLITE_DBNAME"]), url) if self.backend == "sqlite" else None
            if created_file:
                remove_if_empty(Path(settings["SQLITE_DBNAME"]))
            unwritable = (sqlite_unwritable(exc, f"cannot open store {redact(url)}")
                          if self.backend == "sqlite" else None)
            raise sqlite_damage(exc, url) or full or unwritable or StoreFailure(
                "store.unavailable", f"cannot open store {redact(url)}: {exc}", hint=OPEN_FAILED_HINT) from exc
        # The SQLite file this store opened: appends check that its path still names it.
        self._file: tuple[Path, int, int] | None = None
        if self.backend == "sqlite":
            path = Path(settings["SQLITE_DBNAME"])
            try:
                info = path.stat()
            except OSError:
                info = None
            if info is not None:
                self._file = (path, info.st_dev, info.st_ino)

    def _sqlite_files(self) -> str:
        """The SQLite store's files, for a message."""
        if self._file is None:
            return "the database file, its -wal and -shm files"
        path = self._file[0]
        return f"{path}, {path}-wal, {path}-shm"

    def check_file(self) -> None:
        """Refuse to go on with an SQLite file that was removed or replaced since it was opened.

        SQLite keeps writing to the file it opened, even once its path names another file or
        none: every step appended after an operator deleted (or restored over) the store would
        be lost with the old file, while the commands reported success.
        """
        if self._file is None:
            return
        path, device, inode = self._file
        try:
            info = os.stat(path)
        except OSError:
            info = None
        if info is None or (info.st_dev, info.st_ino) != (device, inode):
            raise StoreFailure(
                "store.unavailable",
                f"the store's file {path} was {'removed' if info is None else 'replaced'} while this process had "
                "it open: nothing more is written to it",
                hint="restart the process to use the file now at that path (what was written after the change is "
                "in the old file only if a process still holds it open)",
            )

    def check_writable(self) -> None:
        """Refuse a write to a store opened on a read-only file system, before anything else."""
        if self.read_only_uri is not None:
            raise self._read_only_failure()

    def _read_only_failure(self) -> StoreFailure:
        return StoreFailure(
            "store.read_only",
            f"the store {redact(self.url)} is on a read-only file system: nothing can be written to it",
            hint="read commands (trees, show, unknown, results, audit verify, replay, export) work as they "
            "are; to run, settle or recover its trees, copy the store's files to a writable directory",
        )

    def schema_lock(self) -> contextlib.AbstractContextManager[None]:
        """Serializes table creation with other processes opening the same database
        (PostgreSQL; SQLite's DDL runs under its own write lock)."""
        if self.backend == "postgresql":
            from agentfold.adapters.recorders_postgres import postgres_schema_lock

            return postgres_schema_lock(self.factory.datastore)
        return contextlib.nullcontext()

    def _require_sqlite_store(self, path: Path) -> None:
        """Refuse a missing file, or one without agentfold's tables, before eventsourcing opens
        it: its connections would create the file and switch it to WAL journaling."""
        if not path.exists():
            raise NotFound("store.not_found",
                           f"no store at {redact(self.url)}{sqlite_path_note(path)}: the file does not exist",
                           hint=NOT_FOUND_HINT)
        try:
            uri = self.read_only_uri or f"{path.absolute().as_uri()}?mode=ro"
            with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
                present = {str(row[0]) for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.Error as exc:
            damaged = (sqlite_damage(exc, self.url) or sqlite_full(exc, path, self.url)
                       or sqlite_unwritable(exc, f"cannot open store {redact(self.url)}"))
            if damaged is not None:
                raise damaged from exc
            without_shm = not Path(f"{path.resolve()}-shm").exists()
            if self.read_only_uri is not None and self.read_only_uri.endswith("mode=ro") and without_shm:
                raise StoreFailure(
                    "store.unavailable",
                    f"cannot open store {redact(self.url)} on a read-only file system: {exc}",
                    hint=f"its write-ahead log {path.name}-wal may hold recent commits, which SQLite reads only with "
                    f"the {path.name}-shm file beside it; copy the store's files to a writable directory",
                ) from exc
            raise StoreFailure("store.unavailable", f"cannot open store {redact(self.url)}: {exc}",
                               hint=OPEN_FAILED_HINT) from exc
        self._check_tables(present)

    def _require_tables(self) -> None:
        """Refuse a PostgreSQL database without agentfold's tables (``create=False`` creates nothing)."""
        with self.factory.datastore.transaction(commit=False) as c:
            c.execute(
                "SELECT c.relname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
                "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = ANY(%s)",
                (self.factory.datastore.schema, list(STORE_TABLES)),
            )
            present = {str(row["relname"]) for row in c.fetchall()}
        self._check_tables(present)

    def _check_tables(self, present: set[str]) -> None:
        missing = [t for t in STORE_TABLES if t not in present]
        if len(missing) == len(STORE_TABLES):
            raise NotFound("store.not_found", f"no agentfold store in {redact(self.url)}: it has none of its tables",
                           hint=NOT_FOUND_HINT)
        if missing:
            raise NotFound(
                "store.not_found",
                f"{redact(self.url)} is not a complete agentfold store: tables {', '.join(missing)} are missing",
                hint="open it once with a command that creates a store, as a role that may create tables",
            )

    @property
    def _sqlite_in_memory(self) -> bool:
        """``sqlite:///:memory:``: a database of this process alone, with no file."""
        return self._settings.get("SQLITE_DBNAME") == ":memory:"

    @property
    def index(self) -> IndexQueries:
        return self.recorder  # type: ignore[no-any-return]

    def close(self) -> None:
        """Close the connections; every later use of this store is refused (``store.closed``)."""
        if getattr(self, "_closed", False):
            return
        stop = getattr(self, "_watchdog_stop", None)
        if stop is not None:
            stop.set()
        if getattr(self, "factory", None) is not None:
            self.factory.close()
        # eventsourcing raised its own unclassified ConnectionPoolClosedError (with no message)
        # from a closed SQLite or PostgreSQL store, and a closed memory store went on working.
        # Everything reaches the database through these three (read models and audit through
        # ``factory.datastore``).
        closed = _Closed(self.url)
        self.recorder = self.snapshots = closed
        if getattr(self, "factory", None) is not None:
            self.factory = closed
        self._closed = True

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            _Closed(self.url).refuse()

    def _watch_statements(self, wait: float) -> None:
        """End every session of this store once a statement has waited ``wait`` seconds for a
        server that does not answer a new session either (the watchdog thread of a PostgreSQL
        store).

        A server that stops answering without ending its sessions (its processes frozen, a
        network path that drops packets without a reset) held every call in progress for as
        long as that lasted: HTTP requests and CLI commands never answered, and each kept its
        pooled connection. Ending the sessions is what a server restart does: the calls in
        progress fail (an append's outcome is decided from what is stored, as after any lost
        reply), the idle pooled connections fail at their next use instead of waiting in
        turn, new ones are opened (bounded by the connect timeout and the pool wait) once the
        server answers, and the owner-lease session reports its leases lost (the runs are
        adopted again).

        A statement can also wait on a server that answers: for a lock (VACUUM, ANALYZE or an
        index build on the events table, an operator's transaction), or run long. Cutting it
        would cost every lease and make every call in flight unknown, for nothing: the server
        then answers on a new session, and the statement is left to finish (one warning,
        looked at again after another ``wait``), unless the server lists the waiting session as
        idle: then it is not running the statement, the connection was lost on the way (a
        firewall or NAT that forgot it), and that session alone is ended (the call is retried
        on a new session or fails). ``AGENTFOLD_PG_TCP_TIMEOUT`` (``pg_tcp_params``) usually
        ends such a connection sooner, at the TCP level.
        """
        period = min(1.0, wait / 4)
        where = f"{self._settings['POSTGRES_HOST']}:{self._settings['POSTGRES_PORT']}"
        next_look = 0.0
        while not self._watchdog_stop.wait(period):
            now = time.monotonic()
            if now < next_look:
                continue
            with self._sessions_lock:
                sessions = [c for c in self._sessions if not c.closed and not c.broken]
            hung: dict[Any, float] = {}
            pids: dict[Any, int] = {}
            for conn in sessions:
                since = getattr(conn, "_agentfold_busy_since", None)
                if since is not None and now - since > wait:
                    hung[conn] = since
                    pids[conn] = getattr(conn, "_agentfold_pid", 0)
            if not hung:
                continue
            waited = now - min(hung.values())
            states = self._ask(
                "SELECT pid, state, extract(epoch FROM clock_timestamp() - state_change)::float8 "
                "FROM pg_stat_activity WHERE pid = ANY(%s)", [list(pids.values())], 2.0)
            if states is not None:
                # The server answers. A session it has listed as idle since before this process
                # began to wait on it never got the statement: the connection was lost on the way
                # (a firewall or NAT that forgot it, a path that drops its packets), and the call
                # would wait until TCP gives up (~15 minutes without AGENTFOLD_PG_TCP_TIMEOUT).
                # Only that session ends (the call fails and is retried on a new one). A session
                # the server runs, went idle after the wait began (its answer may still be on
                # the way), or does not list (a pooler in between; a server that does not let
                # this role read pg_stat_activity) is left.
                asked = time.monotonic()
                idle_for = {int(pid): float(seconds) for pid, state, seconds in states
                            if state is not None and str(state).startswith("idle") and seconds is not None}
                lost = [c for c, since in hung.items()
                        if pids[c] in idle_for and idle_for[pids[c]] >= asked - since - 1.0
                        and getattr(c, "_agentfold_busy_since", None) == since]
                for conn in lost:
                    log.warning(
                        "a statement has waited %.0f s for PostgreSQL at %s, which answers a new session but reports "
                        "this one (pid %d) idle: the connection was lost on the way (a firewall, NAT or network "
                        "dropping it without a reset); ending it (the call fails with store.unavailable or is retried "
                        "on a new session)", now - hung[conn], where, pids[conn])
                    try:
                        end_session(conn)
                    except Exception:  # noqa: BLE001 - a session closed meanwhile needs nothing
                        pass
                if len(lost) < len(hung):
                    log.warning(
                        "a statement has waited %.0f s for PostgreSQL at %s, which answers a new session: a lock wait "
                        "or a slow statement, left to finish", now - min(t for c, t in hung.items() if c not in lost),
                        where)
                    next_look = time.monotonic() + wait
                continue
            if self._watchdog_stop.is_set():
                return
            log.warning(
                "PostgreSQL at %s has not answered a statement for %.0f s, nor a new session for 2 s: ending this "
                "process's %d session(s) to it, as a server restart would (calls in progress fail with "
                "store.unavailable; sessions are opened again once it answers; AGENTFOLD_PG_STATEMENT_WAIT sets the "
                "wait)", where, waited, len(sessions))
            for conn in sessions:
                try:
                    end_session(conn)
                except Exception:  # noqa: BLE001 - a session closed meanwhile needs nothing
                    pass

    # -- stopping ----------------------------------------------------------

    def _track_sessions(self, pool: Any) -> None:
        """Remember every connection the pool opens (its configure callback sees each one), so
        that ``interrupt`` can end the ones in use: psycopg_pool keeps no list of them. The
        pool opens them as ``InterruptibleConnection``, which ``end_session`` can end. Must
        run before the pool is opened."""
        pool.connection_class = interruptible_connection()
        configure = pool._configure

        def track(conn: Any) -> None:
            with self._sessions_lock:
                self._sessions.add(conn)
            if configure is not None:
                configure(conn)
            set_server_tcp(conn, self._tcp_timeout)
            ensure_durable_commits(conn)

        pool._configure = track

    def refuses_writes_now(self) -> bool:
        """Whether the PostgreSQL database accepts no writes on this store's sessions (a standby,
        ``default_transaction_read_only``); False for other stores. When it does not, the pooled
        sessions are renewed (``forget_sessions``), so the next look sees a change back."""
        if self.backend != "postgresql":
            return False
        with self.factory.datastore.transaction(commit=False) as c:
            c.execute("SELECT current_setting('transaction_read_only') AS ro")
            row = c.fetchone()
        refused = row is not None and str(row["ro"]) == "on"
        if refused:
            self.forget_sessions()
        return refused

    def undurable_server(self) -> str | None:
        """What, in the server's own settings, no session setting can make durable (PostgreSQL
        run with ``fsync=off``: an operating-system crash or power cut can drop acknowledged
        appends); None when nothing is known to be wrong, and for other stores."""
        if self.backend != "postgresql":
            return None
        with self.factory.datastore.transaction(commit=False) as c:
            c.execute("SELECT current_setting('fsync') AS fsync")
            row = c.fetchone()
        if row is None or str(row["fsync"]) != "off":
            return None
        return ("the PostgreSQL server runs with fsync=off: an operating-system crash or power cut can drop "
                "appends it acknowledged, and a tool whose dispatch permission was dropped would be called again "
                "when its run is recovered (docs/guarantees.md); run production stores with fsync=on")

    def forget_sessions(self) -> None:
        """Replace every pooled PostgreSQL session (those in use once they are handed back): after
        a write refused as read-only (``refuses_writes``). A session keeps the
        ``default_transaction_read_only`` it started with for its whole life (an hour in the
        pool), so the store would stay read-only after the database takes writes again.
        psycopg_pool's ``drain`` replaces each one by one: the pool keeps its size."""
        self._renew_pool("renew", lambda pool: pool.drain() if hasattr(pool, "drain") else None)  # psycopg_pool 3.2+

    def check_sessions(self) -> None:
        """Test the idle pooled PostgreSQL sessions and let go of the broken ones: after a session
        the server ended (a restart, ``pg_ctl stop -m fast``) the others idle in the pool are
        dead too, and each next use would fail again with the same old disconnect text. The
        pool opens sessions again as they are asked for (``drop_broken_sessions``), so it
        holds no more of them after an outage than before. The sessions in use are left
        alone (a broken one is replaced once it is handed back); ``forget_sessions`` replaces
        the live ones too."""
        self._renew_pool("check", drop_broken_sessions)

    def _renew_pool(self, what: str, renew: Callable[[Any], object]) -> None:
        """``renew`` the PostgreSQL store's connection pool (``what`` names it in the warning
        that says it failed); nothing for other stores."""
        if self.backend != "postgresql" or self.factory is None:
            return
        try:
            renew(self.factory.datastore.pool)
        except Exception as exc:  # noqa: BLE001 - only a speed-up of the pool's own renewal
            log.warning("could not %s the store's PostgreSQL sessions: %s", what, exc)

    def session(self, *, listen: bool = False) -> Any:
        """A connection of its own (autocommit) to this PostgreSQL store's database, outside the
        pool: the owner-lease session, a follower's LISTEN session (``listen``: the server's
        ``tcp_user_timeout`` is left alone, see ``set_server_tcp``). ``interrupt`` ends it as it
        ends the pooled ones, and refuses new ones (``store.unavailable``)."""
        self._check_open()
        if self._interrupted:
            raise StoreFailure("store.unavailable", f"store {redact(self.url)} was interrupted: the command is stopping")
        conn = interruptible_connection().connect(**pg_conninfo(self._settings), autocommit=True)
        try:
            set_server_tcp(conn, self._tcp_timeout, user_timeout=not listen)
        except BaseException:
            conn.close()
            raise
        with self._sessions_lock:
            self._sessions.add(conn)
        if self._interrupted:  # interrupted while it connected: end it like the others
            end_session(conn)
        return conn

    def answers(self, timeout: float = 2.0) -> bool:
        """Whether the PostgreSQL server answers ``SELECT 1`` on a new session of its own within
        ``timeout`` seconds (always True for SQLite and memory stores): a stopped, unreachable
        or hung server does not. The attempt runs in a daemon thread, so a server that accepts
        the connection and then never answers cannot hold the caller."""
        if self.backend != "postgresql":
            return True
        return self._ask("SELECT 1", (), timeout) is not None

    def _ask(self, sql: str, args: Sequence[Any], timeout: float) -> list[tuple[Any, ...]] | None:
        """The rows of one query on a new session of this PostgreSQL store's database: None when
        the server does not answer within ``timeout`` seconds (see ``answers``), no rows when it
        answers the query with an error."""
        import psycopg

        rows: list[list[tuple[Any, ...]]] = []
        finished = threading.Event()
        params = {**pg_conninfo(self._settings), "connect_timeout": max(2, math.ceil(timeout))}

        def probe() -> None:
            try:
                with psycopg.connect(**params) as conn:
                    try:
                        rows.append(conn.execute(sql, args).fetchall())
                    except psycopg.DatabaseError as exc:
                        if isinstance(exc, psycopg.OperationalError):
                            raise
                        rows.append([])  # it answers, with an error (e.g. no right to read the view)
            except Exception:  # noqa: BLE001 - any other failure means it does not answer
                pass
            finally:
                finished.set()

        threading.Thread(target=probe, name="agentfold-store-probe", daemon=True).start()
        finished.wait(timeout)
        return rows[0] if rows else None

    def interrupt(self) -> None:
        """Make every call of this store that waits on PostgreSQL fail now, and every later one
        at once; for a command that stops while the server does not answer
        (``agentfold.adapters.follower.StopGuard``). Safe from any thread; idempotent.

        During an outage a store call waits the pool's 30 s for a connection
        (``AGENTFOLD_PG_POOL_WAIT``), or waits up to ``AGENTFOLD_PG_STATEMENT_WAIT`` (for ever
        with 0) for a server that no longer
        answers on a connection it has. This closes the connection pool (a call waiting for a
        connection fails with psycopg_pool's ``PoolClosed``, and so does every later one,
        after eventsourcing's retries: about 2 s) and shuts down the network connection of
        every session still open (pooled ones in use, LISTEN sessions from ``session``), so a
        query in progress fails too. A transaction ends as a whole either way: committed (its
        reply lost) or not at all. The store cannot be used afterwards; ``close`` it as usual.
        SQLite and memory stores have nothing to interrupt: their calls never wait on a server.
        """
        if self.backend != "postgresql" or self._interrupted or getattr(self, "_closed", False):
            return
        self._interrupted = True
        self._watchdog_stop.set()
        pool = self.factory.datastore.pool
        # A short join: an idle pool worker stops at once; one still connecting to a server
        # that does not answer is a daemon thread, left to its own connect timeout.
        pool.close(timeout=0.05)
        with self._sessions_lock:
            sessions = list(self._sessions)
        for conn in sessions:
            end_session(conn)

    # -- appends -----------------------------------------------------------

    def append(
        self,
        tree_id: TreeID,
        expected_version: int,
        events: Sequence[TreeEvent],
        *,
        previous_digest: str | None,
        timestamp: str,
        head: TreeHead | None = None,
        snapshot: TreeState | None = None,
    ) -> AppendResult:
        """Append ``events`` at positions ``expected_version + 1 ...`` in one transaction.

        ``snapshot``: the folded tree after these events (its version is the last one's
        position), saved in the same transaction as the tree's only snapshot when its JSON
        is at most ``INLINE_SNAPSHOT_BYTES`` long, else returned as ``snapshot_body``."""
        self.check_file()
        self.check_writable()
        tree_uuid = tree_id.uuid
        stored: list[StoredEvent] = []
        digest = previous_digest
        for offset, event in enumerate(events, start=1):
            record, digest = self.mapper.encode(tree_id, tree_uuid, expected_version + offset, event, timestamp, digest)
            stored.append(record)
        assert digest is not None
        if head is not None:
            # Memory stores keep no row anyone else could change: nothing to compare.
            expect = None if self.backend == "memory" else (expected_version, previous_digest or "")
            head = head.with_digest(digest, expect)
        saved: StoredEvent | None = None
        deferred: bytes | None = None
        if snapshot is not None:
            if snapshot.version != expected_version + len(events):
                raise ValueError(f"a snapshot at version {snapshot.version} does not follow this append")
            try:
                body = self.encode_snapshot(snapshot, digest)
            except Exception as exc:  # noqa: BLE001 - a Program's encode_state failing: a snapshot is a cache
                # Raised, it failed the append (the owner stopped, and the outcome of the call this
                # append settles was lost): the events go in without it, loads fold them.
                log.warning("tree %s: no snapshot at version %s: encoding it failed (%s: %s)", tree_id,
                            snapshot.version, type(exc).__name__, recorded_text(exc))
            else:
                if len(body) <= INLINE_SNAPSHOT_BYTES:
                    saved = StoredEvent(tree_uuid, snapshot.version, SNAPSHOT_TOPIC, STATE_COMPRESSOR.compress(body))
                else:
                    deferred = body
        try:
            if self.backend == "memory":
                ids = self.recorder.insert_events(stored, head=head)
                if saved is not None:  # one process, one lock per recorder: nothing reads in between
                    self.snapshots.insert_events([saved])
                    self.snapshots.prune(tree_uuid, saved.originator_version)
            else:
                ids = self._insert(stored, head, saved)
        except IntegrityError as exc:
            try:
                ours = self._already_stored(tree_id, stored)
                # A conflict is another writer's event at our first position. Any other
                # constraint failure (a trigger, a CHECK an operator added) is a refused write:
                # taken for a conflict, it was retried 64 times and reported as contention.
                taken = ours or bool(self.recorder.select_events(tree_id.uuid, gt=expected_version, limit=1))
            except PersistenceError as failure:
                raise StoreFailure("store.append_failed", f"append to tree {tree_id} failed: {failure}") from exc
            if ours:
                return AppendResult(digest, (), deferred)
            if not taken:
                raise self._process_taken(tree_id, expected_version, head) or StoreFailure(
                    "store.append_failed", f"append to tree {tree_id} failed: {exc}"
                ) from exc
            raise VersionConflict(tree_id, expected_version) from exc
        except IndexHeadMismatch as exc:
            raise self._head_mismatch(tree_id, exc.stored, expected_version, previous_digest) from exc
        except PersistenceError as exc:
            if refuses_writes(exc):  # nothing was stored; the runtime adopts the tree again later
                # Refused twice: on the sessions it had, then on sessions opened since (``_insert``).
                raise read_only_server(f"append to tree {tree_id} failed") from exc
            if isinstance(exc, StoreFailure):
                # The pool handed out no PostgreSQL connection (NoConnection): the server is down
                # or unreachable, nothing was sent. Not a refused write.
                raise StoreFailure(exc.code, f"append to tree {tree_id} failed: {exc.message}", hint=exc.hint) from exc
            unwritable = sqlite_unwritable(exc, f"append to tree {tree_id} failed", self._sqlite_files())
            if self.backend == "sqlite" and unwritable is not None:
                # The file (or its -wal/-shm companions) is not writable by this user: a refused
                # write that every attempt meets again, as on a read-only file system.
                raise unwritable from exc
            if self.backend == "sqlite" and "database is locked" in str(exc):
                # Not a refused write: another process held SQLite's write lock past the busy wait
                # (a writer stopped mid-transaction, a long import, an operator's open shell).
                raise StoreFailure(
                    "store.unavailable", f"append to tree {tree_id} failed: {exc} (another process held the "
                    "store's write lock for the whole lock wait)",
                    hint="nothing of this append was stored; send the request again once the process holding "
                    "the lock has finished (a stopped or hung agentfold process, an open sqlite3 shell)",
                ) from exc
            raise StoreFailure("store.append_failed", f"append to tree {tree_id} failed: {exc}",
                               hint=APPEND_FAILED_HINT if expected_version else START_FAILED_HINT) from exc
        return AppendResult(digest, tuple(ids or ()), deferred)

    def _insert(self, stored: list[StoredEvent], head: TreeHead | None, saved: StoredEvent | None) -> Any:
        """The recorder's insert, tried once more on fresh sessions when the database refused it
        as read-only (nothing was stored). A session keeps the ``default_transaction_read_only``
        it opened with for its life: the pool may hold sessions opened while the database was
        read-only (a maintenance switch, a failover and back) after it takes writes again, and
        the first write would be refused for what is no longer true. A standby refuses again."""
        try:
            return self.recorder.insert_events(stored, head=head, snapshot=saved)
        except PersistenceError as exc:
            if not refuses_writes(exc):
                raise
        self.forget_sessions()
        return self.recorder.insert_events(stored, head=head, snapshot=saved)

    def _process_taken(self, tree_id: TreeID, expected_version: int, head: TreeHead | None) -> CorruptStream | None:
        """A refused append whose new Process is indexed already: the process index holds a
        row this tree's stored history does not explain (its history was cut and its index
        row rewritten to match, or the row was written by hand). No retry would mend it."""
        for pid in head.new_processes if head is not None else ():
            try:
                owner = self.tree_of_process(pid)
            except PersistenceError:
                return None
            if owner is not None:
                return CorruptStream(
                    tree_id, expected_version + 1, "index.process_mismatch",
                    f"process {pid}, which this append creates, is indexed already (under {owner}): "
                    "the process index holds a row the stored history does not explain",
                )
        return None

    @staticmethod
    def _head_mismatch(
        tree_id: TreeID, stored: tuple[int, str] | None, version: int, digest: str | None
    ) -> CorruptStream:
        """The index row anchors another end than the stream read or appended to."""
        if stored is None:
            return CorruptStream(
                tree_id, max(version, 1), "index.head_mismatch",
                "the tree index has no row for this tree (it is written with every append): the row was deleted; "
                "agentfold neither drives nor shows the tree without it",
            )
        if stored[0] == MALFORMED_VERSION:
            return CorruptStream(
                tree_id, max(version, 1), "index.head_mismatch",
                "the tree index row's version is not a number (it was changed by hand): agentfold neither drives "
                "nor shows the tree without the end it anchors",
            )
        if stored[0] > version:
            return CorruptStream(
                tree_id, version + 1, "index.head_mismatch",
                f"the tree index says version {stored[0]} ({stored[1]}) but the stream ends at position {version}: "
                "events after it were deleted; agentfold neither drives nor shows the tree from a cut history",
            )
        if stored[0] < version:
            return CorruptStream(
                tree_id, stored[0] + 1, "index.head_mismatch",
                f"the stream goes on to position {version}, the tree index ends at version {stored[0]}: "
                "events were added past it",
            )
        return CorruptStream(
            tree_id, min(version, stored[0]) or 1, "index.head_mismatch",
            f"the tree index anchors version {stored[0]} with digest {stored[1]}, the stream has {digest} there: "
            "events or the index row were changed; agentfold neither drives nor shows the tree from it",
        )

    def _already_stored(self, tree_id: TreeID, stored: Sequence[StoredEvent]) -> bool:
        """Identical events already stored as the stream's head: an idempotent retry.

        Only at the head: the same events with others after them are a stale duplicate, a
        conflict (Scope's rule; a writer whose reply was lost and who meets a conflict finds
        its own committed events when it reloads)."""
        first, last = stored[0].originator_version, stored[-1].originator_version
        existing = self.recorder.select_events(tree_id.uuid, gt=first - 1)
        if not existing or existing[-1].originator_version != last:
            return False
        try:
            return [(s.originator_version, s.topic, stored_json(s.state)) for s in existing] == [
                (s.originator_version, s.topic, stored_json(s.state)) for s in stored
            ]
        except SealError:
            return False  # a damaged stored row is not our events: a conflict, found on load

    # -- reads -------------------------------------------------------------

    def read(
        self,
        tree_id: TreeID,
        *,
        after: int = 0,
        upto: int | None = None,
        previous_digest: str | None = None,
        verify: bool = True,
    ) -> list[RecordedEvent]:
        """Events after position ``after`` (verified against ``previous_digest``)."""
        try:
            stored = self.recorder.select_events(tree_id.uuid, gt=after or None, lte=upto)
        except PersistenceError as exc:
            raise read_failure(exc, f"reading tree {tree_id}") from exc
        out: list[RecordedEvent] = []
        digest = previous_digest
        expected = after + 1
        for record in stored:
            if record.originator_version != expected:
                raise CorruptStream(tree_id, expected, "integrity.missing_event", f"position {expected} is missing")
            try:
                decoded = self.mapper.decode(tree_id, record, digest, verify=verify)
            except DecodeError as exc:
                raise CorruptStream(tree_id, exc.position, exc.rule, exc.detail) from exc
            out.append(decoded)
            digest = decoded.digest
            expected += 1
        return out

    def first_event(self, tree_id: TreeID) -> RecordedEvent | None:
        """The tree's first event; None when the store has no such tree (no event, no index row).
        A tree whose first event is gone while later events or its index row remain is
        ``store.corrupt`` (``integrity.missing_event`` at position 1): it read as a tree that does
        not exist, and one such tree made the store-wide listings fail with engine.tree.not_found."""
        first = self.read(tree_id, upto=1)
        if not first:
            missing = self._first_missing(tree_id)
            if missing is None:
                return None
            if not isinstance(missing, _Appeared):
                raise missing
            first = self.read(tree_id, upto=1)  # committed since the first read: there now
        return first[0]

    def _first_missing(self, tree_id: TreeID) -> CorruptStream | _Appeared | None:
        """``integrity.missing_event`` at position 1 when the tree has later events or an index
        row but no first event; None when the store has nothing of it; ``_APPEARED`` when its
        first append committed while it was looked for (two hosts starting one start id at once:
        the loser read nothing, then the winner's events and row: that is no corrupt tree)."""
        try:
            lowest = self.recorder.select_events(tree_id.uuid, limit=1)
            head = None if lowest else self.head(tree_id)
            if head is not None:
                # The row first, then the events again: they commit together, so events
                # committed with the row are read now.
                lowest = self.recorder.select_events(tree_id.uuid, limit=1)
                if not lowest:
                    return CorruptStream(tree_id, 1, "integrity.missing_event",
                                         f"no event is stored, but the tree index holds its row (version {head.version})")
        except PersistenceError as exc:
            raise read_failure(exc, f"reading tree {tree_id}") from exc
        if not lowest:
            return None
        if lowest[0].originator_version == 1:
            return _APPEARED
        return CorruptStream(tree_id, 1, "integrity.missing_event",
                             f"position 1 is missing (the first event stored is at position {lowest[0].originator_version})")

    def read_raw(self, tree_id: TreeID) -> list[StoredEvent]:
        return list(self.recorder.select_events(tree_id.uuid))

    def load(
        self,
        tree_id: TreeID,
        programs: ProgramResolver | None = None,
        *,
        use_snapshot: bool = True,
        verify: bool = True,
        upto: int | None = None,
        _again: bool = False,
    ) -> LoadedTree:
        """Fold a tree from its latest snapshot (if any) and the events after it; the end
        reached must be the one the tree index anchors (``index.head_mismatch``: events cut
        or changed under it), read first, so that an append committed meanwhile only adds.

        ``upto``: fold only as far as this position (1 is the tree's first event)."""
        if upto is not None and (isinstance(upto, bool) or not isinstance(upto, int) or upto < 1):
            raise ValueError(f"upto must be a position, 1 or more (1 is the tree's first event), not {upto!r}")
        anchor = self.head(tree_id)
        state: TreeState | None = None
        digest: str | None = None
        snapshot_version = 0
        if use_snapshot:
            try:
                snapshot = self.latest_snapshot(tree_id, programs, upto=upto)
            except (PersistenceError, AgentfoldError):
                raise  # the store itself failed, or a refusal that folding would meet as well
            except OutdatedSnapshot as exc:  # another release's format (after an upgrade or a downgrade)
                log.info("snapshot of tree %s is not used (%s); folding from its first event", tree_id, exc)
                snapshot = None
            except UnsealedSnapshot as exc:  # edited under its digest: never drive or show from it
                log.warning("snapshot of tree %s is not used (%s); folding from its first event", tree_id, exc)
                snapshot = None
            except Exception as exc:  # noqa: BLE001 - a snapshot is a cache: the events are the truth
                # A damaged snapshot row (a disk fault, a hand edit) would otherwise make a
                # healthy history unreadable, and with it every store-wide listing.
                log.warning("snapshot of tree %s is unreadable (%s: %s); folding from its first event",
                            tree_id, type(exc).__name__, exc)
                snapshot = None
            if snapshot is not None and not self._snapshot_matches(tree_id, snapshot[0].version, snapshot[1]):
                # Readable but not of this history (a hand edit, a restored backup of another
                # store): trusting it would chain the next append to a wrong digest.
                log.warning("snapshot of tree %s at version %s does not match the event stored there; "
                            "folding from its first event", tree_id, snapshot[0].version)
                snapshot = None
            if snapshot is not None:
                state, digest = snapshot
                snapshot_version = state.version
        if state is None:
            state = TreeState(programs)
        records = self.read(tree_id, after=state.version, upto=upto, previous_digest=digest, verify=verify)
        if not records and state.version == 0:
            missing = self._first_missing(tree_id)
            if isinstance(missing, _Appeared) and not _again:
                return self.load(tree_id, programs, use_snapshot=use_snapshot, verify=verify, upto=upto, _again=True)
            if isinstance(missing, CorruptStream):
                raise missing
            raise NotFound("engine.tree.not_found", f"tree {tree_id} does not exist in {redact(self.url)}")
        for record in records:
            try:
                state.apply(record.event, record.position)
            except FoldError as exc:
                raise CorruptStream(tree_id, exc.position, exc.rule, exc.detail) from exc
            digest = record.digest
        unfinished = state.unfinished_step() if upto is None else None
        if unfinished is not None:
            # Driven on, the next append failed the fold's own rule (a bare FoldError: `recover`
            # gave up on every other tree); shown, it read as a sound history.
            raise CorruptStream(tree_id, *unfinished)
        if anchor is None:
            # Every append and every import writes the row with the events: none when the row
            # was read means the tree's first append committed since (read the row again), or
            # a row deleted by hand.
            again = self.head(tree_id)
            if again is None:
                raise self._head_mismatch(tree_id, None, state.version, digest)
            if again.version <= state.version:  # else later appends committed too: ours is a prefix
                self._check_anchor(tree_id, again, state, digest, upto)
        else:
            self._check_anchor(tree_id, anchor, state, digest, upto)
        return LoadedTree(state, digest, snapshot_version)

    def _check_anchor(
        self, tree_id: TreeID, anchor: TreeHead, state: TreeState, digest: str | None, upto: int | None
    ) -> None:
        """A load must reach the end the index row anchors (``upto``: as far as it asked), and
        at that end the row must say what the fold says (``index.row_mismatch``)."""
        version = state.version
        end = anchor.version if upto is None else min(upto, anchor.version)
        if version < end:
            raise self._head_mismatch(tree_id, (anchor.version, anchor.head_digest), version, digest)
        if version == anchor.version:
            if digest != anchor.head_digest:
                raise self._head_mismatch(tree_id, (anchor.version, anchor.head_digest), version, digest)
            disagreement = row_disagreement(anchor, state)
            if disagreement is not None:
                # A row changed by hand (every writer stores the fold's values): driven on, the
                # next append would rewrite it and the evidence would be gone.
                raise CorruptStream(tree_id, version, "index.row_mismatch", disagreement + ": the row was changed "
                                    "by hand; agentfold neither drives nor shows the tree from it")
        elif version > anchor.version:
            # Appended after the row was read (an append writes its events and the row in one
            # transaction), or events added past the row's end by hand: the row read again
            # must reach as far, and its earlier end must still be in the chain.
            again = self.head(tree_id)
            if again is None or again.version < version:
                row = again or anchor
                raise self._head_mismatch(tree_id, (row.version, row.head_digest), version, digest)
            try:
                stored = self.stored_digest(tree_id, anchor.version)
            except SealError:
                stored = None
            if stored != anchor.head_digest:
                raise self._head_mismatch(tree_id, (anchor.version, anchor.head_digest), anchor.version, stored)
            if again.version == version and again.head_digest != digest:
                raise self._head_mismatch(tree_id, (again.version, again.head_digest), version, digest)

    # -- snapshots ---------------------------------------------------------

    def stored_digest(self, tree_id: TreeID, position: int) -> str | None:
        """The digest recorded in the event stored at ``position`` (one row read, not
        verified); None when no event is stored there; ``SealError`` when it is damaged."""
        rows = self.recorder.select_events(tree_id.uuid, gt=position - 1, lte=position)
        return unseal(stored_json(rows[0].state)).digest if rows else None

    def _snapshot_matches(self, tree_id: TreeID, version: int, digest: str) -> bool:
        """Whether the event stored at ``version`` carries ``digest``."""
        try:
            return self.stored_digest(tree_id, version) == digest
        except SealError:
            return False  # the event itself is damaged: the full fold reports where

    @staticmethod
    def encode_snapshot(state: TreeState, digest: str) -> bytes:
        """The snapshot JSON of a folded tree at its version (serialize under the owner's lock)."""
        tree = state.to_json(compact=True)
        return orjson.dumps({"format": SNAPSHOT_FORMAT, "tree": tree, "digest": digest, "seal": snapshot_seal(tree, digest)})

    def save_snapshot(self, tree_id: TreeID, state: TreeState, digest: str) -> None:
        self.write_snapshot(tree_id, state.version, self.encode_snapshot(state, digest))

    def write_snapshot(self, tree_id: TreeID, version: int, body: bytes, *, replace: bool = False) -> bool:
        """Store a snapshot's JSON taken at ``version`` (deflated when that is smaller, as event
        states are: a long conversation's snapshot holds every message) and drop older ones;
        False when it is too large to be read back (``MAX_SNAPSHOT_BYTES``) and was not written.

        ``replace``: a snapshot already stored at ``version`` is replaced (``agentfold snapshot``:
        one that loads do not use, of another format or edited); else it is kept."""
        self.check_writable()
        if len(body) > MAX_SNAPSHOT_BYTES:
            # Readers refuse it: loads go on from the last snapshot under the bound.
            log.warning("tree %s: no snapshot at version %s: its %d bytes exceed %d", tree_id, version,
                        len(body), MAX_SNAPSHOT_BYTES)
            return False
        state_version = version
        body = STATE_COMPRESSOR.compress(body)
        row = StoredEvent(tree_id.uuid, state_version, SNAPSHOT_TOPIC, body)
        try:
            self.snapshots.insert_events([row])
        except IntegrityError:
            if not replace:
                return True  # the same version was already snapshotted
            # Meanwhile a load folds the events (the truth); a newer snapshot is not touched.
            self.snapshots.prune(tree_id.uuid, state_version + 1)
            try:
                self.snapshots.insert_events([row])
            except IntegrityError as exc:
                if not self.snapshots.select_events(tree_id.uuid, gt=state_version - 1, lte=state_version):
                    # Not another writer's row at this version: a constraint refused the write.
                    raise StoreFailure("store.append_failed", f"the snapshot of tree {tree_id} at version "
                                       f"{state_version} was refused: {exc}") from exc
                return True  # another writer stored this version meanwhile, from the same events
        # Only the newest snapshot is ever read; keeping the others would grow storage
        # with the square of a long conversation.
        self.snapshots.prune(tree_id.uuid, state_version)
        return True

    def reads_snapshot_format(self, tree_id: TreeID, format: int, version: int) -> bool:
        """Whether a load uses a snapshot of ``format`` taken at ``version`` of the tree: the current
        format, or 3 when no event up to it stored an input as changes (``PATCHED_START_TOPIC``):
        one query of the tree's topics up to ``version``, no state read."""
        if format == SNAPSHOT_FORMAT:
            return True
        if format != FORMAT_WITHOUT_INPUT_PATCHES:
            return False
        return not self.index.holds_topic(tree_id.uuid, PATCHED_START_TOPIC, version)

    def latest_snapshot(
        self, tree_id: TreeID, programs: ProgramResolver | None, *, upto: int | None = None
    ) -> tuple[TreeState, str] | None:
        """The newest snapshot (at or before ``upto``), folded back into a tree."""
        rows = self.snapshots.select_events(tree_id.uuid, desc=True, limit=1, lte=upto)
        if not rows:
            return None
        stored = decode_snapshot(rows[0].state)
        if not self.reads_snapshot_format(tree_id, stored.format, rows[0].originator_version):
            raise OutdatedSnapshot(f"it is in format {stored.format}, this release reads format {SNAPSHOT_FORMAT}"
                                   + (" (and 3 for a tree with no input stored as changes up to its version)"
                                      if stored.format == FORMAT_WITHOUT_INPUT_PATCHES else ""))
        if not stored.sealed:
            raise UnsealedSnapshot("its tree is not the one sealed with its digest (changed after it was written)")
        state = TreeState.from_json(stored.tree, programs)
        if state.version != rows[0].originator_version:
            # The seal covers the tree and its digest, not the row's version: a row moved to
            # another version (by hand) would make ``load(upto=)`` return a tree past ``upto``.
            raise UnsealedSnapshot(
                f"it is stored at version {rows[0].originator_version} but holds the tree at version "
                f"{state.version} (moved after it was written)"
            )
        return state, stored.digest

    # -- index and feed ----------------------------------------------------

    def heads(self, *, live_only: bool = False, only: HeadFilter | None = None) -> list[TreeHead]:
        """Index rows in creation order: every tree, the live ones, or those ``only`` keeps."""
        return self.index.select_heads(only or HeadFilter(live_only=live_only))

    def head(self, tree_id: TreeID) -> TreeHead | None:
        return self.index.select_head(tree_id)

    def count_live(self) -> tuple[dict[str, int], int]:
        """The live trees per classification (``progress``, ``parked``), and the trees holding
        unknown Effects: what the index says, counted in the database."""
        return self.index.count_live()

    def tree_ids(self) -> list[TreeID]:
        """Every tree id of the index, in creation order (``heads()`` without the rows: a
        store-wide job over a million runs needs only their ids)."""
        return [TreeID(t) for t in self.index.select_tree_ids()]

    def versions(self, tree_ids: Sequence[TreeID]) -> dict[TreeID, int]:
        """The stored version of each tree (from the tree index), in one query."""
        return {t: a[0] for t, a in self.anchors(tree_ids).items()}

    def anchors(self, tree_ids: Sequence[TreeID]) -> dict[TreeID, tuple[int, str]]:
        """The end (version, head digest) each tree's index row anchors, in one query; trees
        without a row are left out."""
        return {TreeID(k): a for k, a in self.index.select_anchors([str(t) for t in tree_ids]).items()}

    def past_anchor(
        self, tree_id: TreeID, position: int, digest: str, anchor: tuple[int, str] | None
    ) -> CorruptStream | None:
        """Whether an event read from the notification log lies beyond what the tree's index row
        (read AFTER the event) anchors: None when it is within, else the refusal a load gives.

        An append writes its events and the row in one transaction, so a row read after an
        event reaches at least that event's position: an event past it was added by hand
        (a forged event, correctly chained or not), and one at the row's version must carry
        the row's head digest."""
        if anchor is None or position > anchor[0] or (position == anchor[0] and digest != anchor[1]):
            return self._head_mismatch(tree_id, anchor, position, digest)
        return None

    def tree_of_process(self, process_id: str) -> TreeID | None:
        found = self.index.tree_of_process(process_id)
        return TreeID(found) if found else None

    def processes_of_tree(self, tree_id: TreeID) -> list[str]:
        """The Process ids ``agentfold_processes`` indexes under ``tree_id`` (in id order)."""
        return self.index.processes_of_tree(str(tree_id))

    def find_tree(self, ref: str) -> TreeID:
        """A tree id, a start id or a process id, to a tree this store indexes (else NotFound)."""
        if not isinstance(ref, str):
            raise InvalidInput("identity.invalid", f"a run is named by a tree id, a start id or a process id (text), "
                                                   f"not {type(ref).__name__} {str(ref)[:80]!r}",
                               hint="pass the run's tree id, start id or root process id as a str (e.g. run.tree_id)")
        if ref.startswith("tree:"):
            tree_id = TreeID(ref)
            if self.head(tree_id) is None and not self._indexed_since(tree_id):
                raise NotFound("engine.tree.not_found", f"tree {ref} does not exist",
                               hint="list trees with `agentfold trees`")
            return tree_id
        found = self.tree_of_process(ref)
        if found is not None:
            return found
        tree_id = TreeID.for_start(StartID(ref))
        if self.head(tree_id) is None and not self._indexed_since(tree_id):
            raise NotFound(
                "engine.tree.not_found", f"no tree, start id or process {str(ref)!r} in this store",
                hint="list trees with `agentfold trees`",
            )
        return tree_id

    def _indexed_since(self, tree_id: TreeID) -> bool:
        """Whether a tree whose index row was not there when read has one now.

        With events stored, the tree's first append committed after the row was read (it
        writes both in one transaction): the row read again is there. A tree with events
        and still no row had its row deleted: refused as a load refuses it
        (``store.corrupt``), not reported as a tree that does not exist."""
        last = self.recorder.select_events(tree_id.uuid, desc=True, limit=1)
        if not last:
            return False
        if self.head(tree_id) is not None:
            return True
        raise self._head_mismatch(tree_id, None, last[0].originator_version, None)

    def find_process_tree(self, process_id: str) -> TreeID:
        """The tree of a process (InvalidInput for a malformed id, else NotFound)."""
        found = self.tree_of_process(ProcessID(process_id))
        if found is None:
            head = self._head_named(process_id)
            if head is not None:  # a run's tree id or start id where a process id was wanted
                raise NotFound(
                    "engine.process.not_found",
                    f"{str(process_id)!r} names the run {head.tree_id} (started as {head.start_id!r}), not a process",
                    hint=f"pass a process id: the run's root process is {head.root_process_id} "
                    f"(`agentfold show {head.tree_id}` lists every process of the run)",
                )
            raise NotFound("engine.process.not_found", f"process {process_id} is not in this store")
        return found

    def _head_named(self, ref: str) -> TreeHead | None:
        """The index row of the tree ``ref`` names as a tree id or a start id, if any."""
        try:
            tree_id = TreeID(ref) if ref.startswith("tree:") else TreeID.for_start(StartID(ref))
        except (AgentfoldError, ValueError):
            return None  # not a tree id or start id either
        return self.head(tree_id)  # a store failure is reported as one, never as "not found"

    def tree_of_unknown_effect(self, effect_id: str) -> TreeID | None:
        found = self.index.tree_of_unknown_effect(effect_id)
        return TreeID(found) if found else None

    def notifications(self, after: int, limit: int = 500) -> Sequence[Notification]:
        try:
            found: Sequence[Notification] = self.recorder.select_notifications(after, limit, inclusive_of_start=False)
        except (TypeError, ValueError) as exc:
            nameless = self._nameless_row(after, limit)
            if nameless is None:
                raise
            raise nameless from exc
        return found

    def _nameless_row(self, after: int, limit: int) -> NamelessRow | None:
        """``store.corrupt`` naming the first event row after notification ``after`` whose
        originator_id is no tree id (written by hand: eventsourcing's read fails on it, and no
        tree can be held back for it); None when every row names a tree."""
        for row in self.raw_notifications(after, limit):
            if _tree_of_row(row.originator_id) is None:
                return nameless_row(f"the event at notification {row.id}", row.originator_id)
        return None

    def max_notification_id(self) -> int:
        return int(self.recorder.max_notification_id() or 0)

    def tree_notifications(self, tree_id: TreeID, from_position: int, limit: int = 500) -> list[Notification]:
        """One tree's stored events from ``from_position`` on, in position order (at most
        ``limit``), as notifications (with their ids in the store's log)."""
        found: list[Notification] = self.index.select_tree_notifications(tree_id.uuid.hex, from_position, limit)
        return found

    def raw_notifications(self, after: int, limit: int = 500) -> list[Notification]:
        """``notifications`` with each row's columns as stored, a row changed by hand (a NULL or
        malformed column) included, for a reader that names such a row instead of failing on it."""
        found: list[Notification] = self.index.select_raw_notifications(after, limit)
        return found

    def tree_position_before(self, tree_id: TreeID, notification_id: int) -> int:
        """The highest position of ``tree_id`` among the notifications before ``notification_id`` (0: none)."""
        return self.index.select_position_before(tree_id.uuid.hex, notification_id)

    def changes(self, after: int, upto: int, limit: int = 10_000) -> list[Changed]:
        """The trees the first ``limit`` events after notification ``after`` (up to ``upto``)
        belong to, each with its positions there, without reading the events' states."""
        out: list[Changed] = []
        for tree, first, low, high, last in self.index.select_changes(after, upto, limit):
            tree_id = _tree_of_row(tree)
            if tree_id is None:
                where = f"the event at notification {first}" if first == last else \
                    f"an event between notifications {first} and {last}"
                raise nameless_row(where, tree)
            out.append(Changed(tree_id, first, low, high, last))
        return out

    # -- leases ------------------------------------------------------------

    def leases(self) -> LeaseManager:
        """A new lease manager (one per runtime)."""
        self._check_open()
        if self.backend == "memory" or self._sqlite_in_memory:
            # sqlite:///:memory: lives in this process only: no other process to lease against
            # (a file lease left ":memory:.leases" in the working folder).
            return MemoryLeases(self._memory_leases, self._memory_lock)
        if self.backend == "sqlite":
            if self.read_only_uri is not None:  # a runtime may read it (find a tree); taking one is refused
                return RefusedLeases(self._read_only_failure)
            # Next to the file itself: a store opened through a symlink (or another spelling of
            # its path) must lock the same lease file as one opened by its real path.
            return FileLeases(os.path.realpath(self._settings["SQLITE_DBNAME"]) + ".leases")
        # Its session is one of the store's, so ``interrupt`` ends it with the others.
        return PostgresLeases(pg_conninfo(self._settings), session=self.session)


class _Appeared:
    """A tree's first append committed while the store looked for it (``EventStore._first_missing``)."""


_APPEARED = _Appeared()


class _Closed:
    """What a closed EventStore reads and writes through: every use is refused."""

    def __init__(self, url: str) -> None:
        self._url = url

    def refuse(self) -> NoReturn:
        raise StoreFailure(
            "store.closed", f"the store {redact(self._url)} was closed by this process",
            hint="open a new EventStore; close a Runtime before the store it uses",
        )

    def __getattr__(self, name: str) -> Any:
        self.refuse()


class _SessionSocket:
    """A duplicate of a PostgreSQL session's socket descriptor, held for the session's life.

    Shutting the socket down through the connection's own descriptor number would race with
    its owner: the owner may close the connection between our reading the number and using
    it, and the number be reused at once by an unrelated socket, which we would then shut
    down. A duplicate refers to the same open socket (shutting it down ends the connection),
    and its number cannot be reused while we hold it; it is closed, under the same lock as
    the shutdown, when the connection is closed (or collected)."""

    def __init__(self, fd: int) -> None:
        self._lock = threading.Lock()
        self._fd = os.dup(fd)

    def shutdown(self) -> None:
        with self._lock:
            if self._fd < 0:
                return  # the session was closed: its socket is not ours to touch any more
            sock = socket.socket(fileno=self._fd)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected any more
            finally:
                sock.detach()  # the descriptor stays ours until release()

    def release(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def drop_broken_sessions(pool: Any) -> int:
    """Test the idle connections of a psycopg_pool ``pool``, put the working ones back and close
    the broken ones, without opening others in their place; how many it closed.

    Why not psycopg_pool's ``check()``: it opens a new connection for each broken one AND
    grows the pool by one more each time it is called (it calls its ``_maybe_grow_pool``,
    meant for a client waiting while every connection is busy), and the client that waits
    for a connection during the outage grows it by one again; those extra connections are
    closed only one per ``max_idle`` (10 minutes). A follower so held 6 sessions, then 7, 9,
    10, 11 after each of four server restarts, and on up to the pool's maximum. Here the pool
    counts the broken ones as gone (as when it gives up reconnecting one), so the next
    client that waits makes it open connections again, one after another up to its
    ``min_size`` (more only while several clients wait at once, as usual): after an
    outage the pool holds at most as many as before. A connection that works goes first to
    a client waiting for one, as when it is handed back. Connections in use are not
    touched: a broken one is replaced when it is handed back, by the pool itself.

    Uses psycopg_pool's private state (3.2 to 3.3: ``_lock``, ``_pool``, ``_nconns``,
    ``_nconns_min``, ``_waiting``, ``_maybe_grow_pool``, ``_add_to_pool``,
    ``_close_connection``): a pool without them gets its own ``check()``."""
    if not all(hasattr(pool, name) for name in ("_lock", "_pool", "_nconns", "_waiting", "_add_to_pool",
                                                 "_close_connection")):
        pool.check()
        return 0
    with pool._lock:
        idle = list(pool._pool)
        pool._pool.clear()
    broken = 0
    for conn in idle:
        try:
            pool.check_connection(conn)
        except Exception:  # noqa: BLE001 - any failure: the connection does not work
            broken += 1
            try:
                pool._close_connection(conn)
            except Exception:  # noqa: BLE001 - closing a broken connection: nothing more to do
                pass
        else:
            pool._add_to_pool(conn)  # to a waiting client first; closed if the pool was closed meanwhile
    if broken:
        with pool._lock:
            pool._nconns = max(0, pool._nconns - broken)
            if hasattr(pool, "_nconns_min"):  # idle connections seen lately: what the shrinking looks at
                pool._nconns_min = min(pool._nconns_min, len(pool._pool))
            if pool._waiting and hasattr(pool, "_maybe_grow_pool"):
                pool._maybe_grow_pool()  # a client waiting since before: the pool was full then
    return broken


@functools.cache
def interruptible_connection() -> Any:
    """The ``InterruptibleConnection`` class (made on first use: a process on an SQLite store
    never imports psycopg)."""
    import psycopg

    class InterruptibleConnection(psycopg.Connection[Any]):
        """A psycopg connection that ``end_session`` can end from any thread without a race:
        it holds a duplicate of its socket's descriptor from its opening to its closing
        (``_SessionSocket``). Open it with ``InterruptibleConnection.connect(...)`` as with
        ``psycopg.connect``; a connection pool opens it when it is its ``connection_class``."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # Opened by the thread that connects it, before anyone else can see it.
            self._agentfold_socket: _SessionSocket | None = _SessionSocket(self.pgconn.socket)
            self._agentfold_busy_since: float | None = None  # see wait()
            self._agentfold_pid: int = self.pgconn.backend_pid  # read by the watchdog's thread
            weakref.finalize(self, self._agentfold_socket.release)  # never closed: at collection

        def wait(self, *args: Any, **kwargs: Any) -> Any:
            """psycopg's wait for the server (every statement, fetch and commit), marked with its
            start for ``EventStore._watch_statements``; a wait with its own timeout (a LISTEN
            session's ``notifies``) is not marked."""
            if kwargs.get("timeout") is not None:
                return super().wait(*args, **kwargs)
            self._agentfold_busy_since = time.monotonic()
            try:
                return super().wait(*args, **kwargs)
            finally:
                self._agentfold_busy_since = None

        def close(self) -> None:
            try:
                super().close()
            finally:
                # Also when psycopg closes nothing (a broken connection counts as closed).
                held = getattr(self, "_agentfold_socket", None)
                if held is not None:
                    held.release()

    return InterruptibleConnection



def end_session(conn: Any) -> None:
    """Shut down the network connection of an ``InterruptibleConnection``, from any thread:
    whatever waits on it (a query, a notification) fails at once with
    ``psycopg.OperationalError``, even when the server does not answer. The socket is shut
    down, not closed: its owner still closes the connection, and sees a lost connection.

    Race-free: the shutdown goes through the duplicate descriptor the connection holds from
    its opening to its closing, so a connection its owner closes meanwhile is left alone
    (closed already, or ended just before), and never a socket that took its number. A
    connection opened otherwise cannot be ended safely: ``TypeError``."""
    held = getattr(conn, "_agentfold_socket", None)
    if held is None:
        raise TypeError(f"{type(conn).__name__} cannot be ended from another thread: open it as an "
                        "agentfold.adapters.eventstore.interruptible_connection()")
    held.shutdown()


#: A ``password`` parameter in a URL's query (libpq reads ``?password=``): masked in messages.
_PASSWORD_PARAMETER = re.compile(r"((?:^|[?&;\s])password\s*=\s*)[^&;#\s]*", re.IGNORECASE)


#: A quoted ``password`` parameter of a libpq connection string (``password='a b'``, with
#: backslash escapes inside): the whole quoted value is masked.
_QUOTED_PASSWORD_PARAMETER = re.compile(r"((?:^|[?&;\s])password\s*=\s*)'(?:[^'\\]|\\.)*'?", re.IGNORECASE)
#: Something that looks like a URL with a user part (``scheme://user:password@host``).
_URL_WITH_USER = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S*@\S*")


def mask_passwords(text: str) -> str:
    """``text`` (a server's or a driver's message) with the passwords it may quote masked:
    ``password=...`` parameters (quoted or not) and the ``:password@`` of a URL. Only where a
    password can stand: masking every occurrence of the password's text would garble the
    message and, for a short password, show it (``e`` -> ``conn***ction``)."""
    text = _QUOTED_PASSWORD_PARAMETER.sub(r"\1***", text)
    text = _PASSWORD_PARAMETER.sub(r"\1***", text)
    return _URL_WITH_USER.sub(lambda found: redact(found.group()), text)


def redact(url: str) -> str:
    """The URL without its password, for messages (also when the URL is malformed: a scheme in
    capitals, one slash, no slashes, a ``password`` query parameter)."""
    scheme, colon, rest = url.partition(":")
    if scheme.strip().lower() in ("sqlite", "memory"):  # sqlite:///path has no user
        return url
    if not colon:  # not a URL: a libpq "host=... password=..." string, say
        return _PASSWORD_PARAMETER.sub(r"\1***", url)
    rest = _PASSWORD_PARAMETER.sub(r"\1***", rest)
    after = len(rest) - len(rest.lstrip("/"))
    if not after and "@" in rest:  # no slash after the first ':': "user:password@host/db" or "postgres:u:p@h"
        return f"{scheme}:***@{rest.rpartition('@')[2]}"
    userinfo, at, host_and_path = rest[after:].rpartition("@")
    # The last '@' ends the user and password, even when an unencoded '/', '?' or '#' in
    # the password would make a URL parser cut the host part earlier: never show a secret.
    if at and ":" in userinfo:
        rest = f"{rest[:after]}{userinfo.split(':', 1)[0]}:***@{host_and_path}"
    return f"{scheme}:{rest}"


def pg_conninfo(settings: dict[str, str]) -> dict[str, Any]:
    """psycopg parameters of a direct connection to a PostgreSQL store (the first connection,
    the owner-lease session, the follower's LISTEN session): at most ``PG_CONNECT_TIMEOUT``
    seconds to connect, unless PGCONNECT_TIMEOUT says otherwise, and ``pg_tcp_params``."""
    params: dict[str, Any] = {
        "dbname": settings["POSTGRES_DBNAME"], "host": settings["POSTGRES_HOST"],
        "port": settings["POSTGRES_PORT"], "user": settings["POSTGRES_USER"],
        "password": settings["POSTGRES_PASSWORD"],
    }
    if not os.environ.get("PGCONNECT_TIMEOUT"):
        params["connect_timeout"] = PG_CONNECT_TIMEOUT
    kept = settings.get("AGENTFOLD_PG_TCP_TIMEOUT")
    params.update(pg_tcp_params(int(kept) if kept is not None else None))
    return params


def check_postgres(url: str, settings: dict[str, str]) -> None:
    """Connect once, directly, with a short timeout, and explain a failure.

    The connection pool would retry a failing connection for 30 s and then say only that
    it got none; this says why at once. psycopg gives no SQLSTATE for a failed connection
    (libpq keeps only the message), so a missing database (3D000) is recognized by the
    server's message, which is English unless the server's ``lc_messages`` says otherwise
    (a translated message is still reported, as ``store.unavailable``).
    """
    import psycopg

    try:
        psycopg.connect(**pg_conninfo(settings)).close()
    except psycopg.Error as exc:
        raise connect_failure(url, settings, exc) from exc


def connect_reason(exc: BaseException) -> str:
    """A failed PostgreSQL connection's reason on one line, without a password."""
    lines: list[str] = []
    for line in mask_passwords(str(exc).removeprefix("connection failed: ")).splitlines():
        line = " ".join(line.split())
        if line and line not in lines:  # libpq repeats the reason for each SSL/non-SSL attempt
            lines.append(line)
    return "; ".join(lines) or type(exc).__name__


def connect_failure(url: str, settings: dict[str, str], exc: Exception) -> NotFound | StoreFailure:
    """A classified error for a failed PostgreSQL connection, with the server's reason on one line."""
    reason = connect_reason(exc)
    shown = redact(url)
    dbname = settings["POSTGRES_DBNAME"]
    if f'database "{dbname}" does not exist' in reason:
        return NotFound(
            "store.not_found", f"no database {dbname!r} on the PostgreSQL server of {shown}: {reason}",
            hint="check the database name in the URL, or create the database first with CREATE DATABASE",
        )
    crowded = too_many_connections(reason, shown)
    if crowded is not None:  # before the login markers: its message names the role too
        return crowded
    login = ("password authentication failed", "no password supplied", "authentication failed",
             "pg_hba.conf", "not permitted to log in", "role \"")
    if any(marker in reason for marker in login):
        return StoreFailure(
            "store.unavailable", f"PostgreSQL refused the login to {shown}: {reason}",
            hint="check the user and password in the URL; without a password libpq reads ~/.pgpass or PGPASSFILE",
        )
    if "SSL" in reason or "certificate" in reason:
        return StoreFailure(
            "store.unavailable", f"cannot connect to the PostgreSQL server of {shown}: {reason}",
            hint="check PGSSLMODE, PGSSLROOTCERT, which names the CA that signed the server's certificate, and the "
            "host name in the URL: verify-full compares it with the certificate",
        )
    timeout = os.environ.get("PGCONNECT_TIMEOUT") or str(PG_CONNECT_TIMEOUT)
    return StoreFailure(
        "store.unavailable", f"cannot connect to the PostgreSQL server of {shown}: {reason}",
        hint=f"check that the server runs and is reachable at the URL's host and port; "
        f"the first connection waits at most {timeout} s, PGCONNECT_TIMEOUT sets it",
    )


#: The server's messages for SQLSTATE 53300 (too_many_connections): libpq gives a failed
#: connection's message only, in the server's ``lc_messages`` language (English recognized).
_TOO_MANY_FOR = re.compile(r'too many connections for (role|database) "([^"]*)"')
_TOO_MANY_CLIENTS = ("sorry, too many clients already", "remaining connection slots are reserved")


def too_many_connections(reason: str, shown: str) -> StoreFailure | None:
    """``store.unavailable`` naming the limit a refused connection met (SQLSTATE 53300: a role's
    or a database's CONNECTION LIMIT, the server's ``max_connections``), or None when
    ``reason`` (a failed connection's message) is not that refusal."""
    found = _TOO_MANY_FOR.search(reason)
    if found is not None:
        kind, name = found.groups()
        command = "ALTER ROLE" if kind == "role" else "ALTER DATABASE"
        return StoreFailure(
            "store.unavailable",
            f"PostgreSQL refused a connection to {shown}: the {kind} {name!r} has too many connections, as many as "
            f"its CONNECTION LIMIT allows (SQLSTATE 53300 too_many_connections): {reason}",
            hint=f"raise the {kind}'s limit ({command} \"{name}\" CONNECTION LIMIT n; -1: none) or open fewer "
            f"connections as this {kind}: each agentfold process keeps up to 12 pooled connections, and a server "
            "or follower a session or two of its own; stop idle processes, or give them another role",
        )
    if any(marker in reason for marker in _TOO_MANY_CLIENTS):
        return StoreFailure(
            "store.unavailable",
            f"PostgreSQL refused a connection to {shown}: the server has too many connections, as many as its "
            f"max_connections allows (SQLSTATE 53300 too_many_connections): {reason}",
            hint="raise the server's max_connections (a restart), or open fewer connections: each agentfold "
            "process keeps up to 12 pooled connections, and a server or follower a session or two of its own",
        )
    return None


def store_url_from_env(explicit: str | None = None) -> str:
    if explicit is not None and not explicit.strip():
        # An empty --store (an unset shell variable) must not silently mean the default store.
        raise InvalidInput("store.url_invalid", "--store is empty",
                           hint="give sqlite:///path.db, postgresql://... or memory:, or leave --store out")
    if explicit:
        return explicit
    env = os.environ.get("AGENTFOLD_STORE")
    if env is not None and not env.strip():
        # Set but empty (``AGENTFOLD_STORE=$UNSET_VAR``): the same mistake, in the environment.
        raise InvalidInput("store.url_invalid", f"AGENTFOLD_STORE is set but {'empty' if not env else 'blank'}",
                           hint="set it to sqlite:///path.db, postgresql://... or memory:, or unset it "
                           "for the default store")
    return env or DEFAULT_STORE


def tree_uuid(tree_id: TreeID) -> uuid.UUID:
    return tree_id.uuid

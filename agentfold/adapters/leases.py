"""Owner leases: at most one runtime drives a tree at a time.

* PostgreSQL: a session-level advisory lock held on the lease manager's own
  connection (``pg_try_advisory_lock``); the server releases it when the session ends,
  including when the owner's process dies.
* SQLite: an open-file-description byte-range lock (``F_OFD_SETLK``) on
  ``<database>.leases``, one byte per tree; the kernel releases it when the owner's
  process dies. One file descriptor serves every tree a runtime owns.
* Memory: a table inside the store object (one process).

A lease is an optimisation of ownership, not its proof: every append is also fenced
by the stream version, so a writer that lost its lease is stopped by the next
conflicting append (see ``agentfold.adapters.runtime``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from agentfold.domain.errors import StoreFailure
from agentfold.domain.ids import TreeID

log = logging.getLogger("agentfold.runtime")


class LeaseManager(Protocol):
    #: Whether holding a lease excludes every other live holder of the same tree (the real
    #: managers below; a test double that grants everything is not exclusive).
    exclusive: bool

    def acquire(self, tree_id: TreeID) -> bool: ...

    def release(self, tree_id: TreeID) -> None: ...

    def holds(self, tree_id: TreeID) -> bool:
        """Whether this manager holds the lease of ``tree_id`` now (as far as it knows)."""
        ...

    def check(self) -> set[TreeID]:
        """Trees whose lease this manager lost since the last check (each reported once)."""
        ...

    def healthy(self) -> bool:
        """Whether new leases can be taken now."""
        ...

    def close(self) -> None: ...


class _Durable:
    """Leases that last as long as this process: none is ever lost while it runs."""

    exclusive = True

    def check(self) -> set[TreeID]:
        return set()

    def healthy(self) -> bool:
        return True


class RefusedLeases(_Durable):
    """The leases of a store nothing can be written to (an SQLite file on a read-only file
    system): a runtime over it reads, but taking a tree raises ``refusal()``."""

    def __init__(self, refusal: Callable[[], Exception]) -> None:
        self._refusal = refusal

    def acquire(self, tree_id: TreeID) -> bool:
        raise self._refusal()

    def release(self, tree_id: TreeID) -> None:
        pass

    def holds(self, tree_id: TreeID) -> bool:
        return False

    def close(self) -> None:
        pass


class MemoryLeases(_Durable):
    """Leases inside one process, shared through the store object."""

    def __init__(self, table: dict[TreeID, object], lock: threading.Lock) -> None:
        self._table = table
        self._lock = lock
        self._token = object()
        self._held: set[TreeID] = set()

    def acquire(self, tree_id: TreeID) -> bool:
        with self._lock:
            owner = self._table.get(tree_id)
            if owner is not None and owner is not self._token:
                return False
            self._table[tree_id] = self._token
            self._held.add(tree_id)
            return True

    def release(self, tree_id: TreeID) -> None:
        with self._lock:
            if self._table.get(tree_id) is self._token:
                del self._table[tree_id]
            self._held.discard(tree_id)

    def holds(self, tree_id: TreeID) -> bool:
        return tree_id in self._held

    def close(self) -> None:
        for tree_id in list(self._held):
            self.release(tree_id)


_FLOCK = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux: type, whence, start, len, pid


def _lock_offset(tree_id: TreeID) -> int:
    # 62 bits of the tree uuid: collisions are negligible and offsets stay positive.
    return int.from_bytes(uuid.UUID(hex=tree_id.hex).bytes[:8], "big") >> 2


class FileLeases(_Durable):
    """OFD byte-range locks on one lease file (SQLite stores).

    The locks live on the file this manager opened. If that file is removed or replaced
    (an operator cleaning up), a process that opens the path later creates a new file and
    finds no lock in it: it could take a tree a live owner drives. ``check`` (every watcher
    poll) notices, opens the file now at the path and takes every held lease again there;
    a lease another process took meanwhile is reported lost (its owner line stops)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._held: set[TreeID] = set()
        self._fd = -1
        self._reopen_failed = False
        self._open()

    def _open(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:  # another user's 0600 file, a directory of that name, an immutable file
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            raise StoreFailure(
                "store.unavailable", f"cannot open the lease file {self.path}: {exc.strerror or exc}",
                hint="the store's processes need to read and write <database>.leases next to the database file: "
                + ("free space on that file system (bytes, or inodes: room for a new file)" if full else
                   "fix its owner or permissions (or remove what stands at that path)"),
            ) from exc
        info = os.fstat(fd)
        self._fd, self._file = fd, (info.st_dev, info.st_ino)

    def check(self) -> set[TreeID]:
        with self._lock:
            if self._fd < 0:
                return set()
            try:
                info = os.stat(self.path)
                if (info.st_dev, info.st_ino) == self._file:
                    return set()
            except FileNotFoundError:
                pass
            except OSError:
                return set()  # cannot tell now: the next poll looks again
            old = self._fd
            try:
                self._open()
            except StoreFailure as exc:
                if not self._reopen_failed:  # once per outage, not at every poll
                    log.warning("the lease file %s was removed or replaced, and cannot be opened again: %s",
                                self.path, exc)
                self._reopen_failed = True
                return set()
            self._reopen_failed = False
            lost = {tree_id for tree_id in self._held if not self._fcntl(fcntl.F_WRLCK, tree_id)}
            self._held -= lost
            os.close(old)  # its locks excluded nobody any more
            log.warning(
                "the lease file %s was removed or replaced while this process held %d lease(s) in it: opened it "
                "again and took %d of them there%s", self.path, len(self._held) + len(lost), len(self._held),
                f"; {len(lost)} taken by another process meanwhile" if lost else "",
            )
            return lost

    def healthy(self) -> bool:
        """False while the lease file was removed or replaced and cannot be opened again: the
        leases this process holds are on a file no other process opens, so they exclude nobody
        (a process that opens the path later may take the same trees; appends still fence)."""
        return not self._reopen_failed

    def _fcntl(self, kind: int, tree_id: TreeID) -> bool:
        data = _FLOCK.pack(kind, os.SEEK_SET, _lock_offset(tree_id), 1, 0)
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, data)
        except OSError:
            return False
        return True

    def acquire(self, tree_id: TreeID) -> bool:
        with self._lock:
            if tree_id in self._held:
                return True
            if self._reopen_failed:
                # A lock on the file this process still has open would exclude nobody: a process
                # that opens the path once it can finds no lock there.
                raise StoreFailure(
                    "store.unavailable", f"the lease file {self.path} was removed or replaced and cannot be opened "
                    "again: no run can be taken over or started here until it can",
                    hint="make room for it (free space or inodes, write access to its folder): this process opens "
                    "it again by itself; then send the request again",
                )
            if self._fcntl(fcntl.F_WRLCK, tree_id):
                self._held.add(tree_id)
                return True
            return False

    def release(self, tree_id: TreeID) -> None:
        with self._lock:
            if tree_id in self._held:
                self._fcntl(fcntl.F_UNLCK, tree_id)
                self._held.discard(tree_id)

    def holds(self, tree_id: TreeID) -> bool:
        return tree_id in self._held

    def close(self) -> None:
        with self._lock:
            self._held.clear()
            if self._fd >= 0:
                os.close(self._fd)  # closing the description releases every lock
                self._fd = -1


def _advisory_key(tree_id: TreeID) -> int:
    return int.from_bytes(uuid.UUID(hex=tree_id.hex).bytes[:8], "big", signed=True)


#: A statement on the lease session (its probe ``SELECT 1``, a lock, an unlock) still waiting
#: after this many seconds makes the leases unhealthy (``healthy``): a server that accepts
#: connections and no longer answers.
PROBE_STALL_SECONDS = 5.0


class PostgresLeases:
    """Session advisory locks on a dedicated connection.

    The server holds the locks only as long as that session lives. When it ends while
    this process goes on (a PostgreSQL restart or failover, a dropped network, an
    administrator's ``pg_terminate_backend``), every lock is gone at once and another
    runtime may take the trees over. ``check`` notices (the runtime's watcher calls it
    a few times per second), reports the trees whose leases were lost, so their owner
    lines stop, and connects again for later acquisitions; an acquisition that meets a
    dead session reports the loss the same way and fails with ``store.unavailable``.

    ``session``: opens the lease session (autocommit); the store passes its own
    ``EventStore.session``, so that ``EventStore.interrupt`` (a command that stops while the
    server does not answer) ends the lease session too: a lock statement or probe waiting
    on the server fails at once (the leases are reported lost), and no new session is
    opened (``store.unavailable`` at once, not after a connection timeout).
    """

    exclusive = True

    def __init__(self, conninfo: dict[str, Any], *, session: Callable[[], Any] | None = None) -> None:
        self._conninfo = conninfo
        self._session = session
        self._lock = threading.Lock()
        self._held: set[TreeID] = set()
        self._lost: set[TreeID] = set()
        self._conn: Any = None
        self._statement_began: float | None = None  # monotonic start of the statement in progress
        self._conn = self._connect()

    def _connect(self) -> Any:
        import psycopg

        try:
            if self._session is not None:
                return self._session()  # StoreFailure as it is: e.g. an interrupted store
            return psycopg.connect(**self._conninfo, autocommit=True)
        except psycopg.Error as exc:
            raise StoreFailure(
                "store.unavailable", f"cannot open the lease connection to PostgreSQL: {_first_line(exc)}",
                hint="check that the server is reachable; a command exits (run it again then), a server or worker "
                "takes its runs up again once it is",
            ) from exc

    def _session_lost(self, exc: BaseException) -> StoreFailure:
        """The lease session ended: every lock it held is gone (called with ``_lock`` held)."""
        self._lost |= self._held
        self._held.clear()
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - it is already broken
                pass
        return StoreFailure(
            "store.unavailable", f"the owner-lease session to PostgreSQL ended: {_first_line(exc)}",
            hint="retry: the runtime connects again and adopts the run anew",
        )

    def _alive(self) -> bool:
        return self._conn is not None and not self._conn.closed and not self._conn.broken

    def _execute(self, sql: str, key: int) -> Any:
        """Run one lock statement; a dead session is reported lost and replaced once."""
        import psycopg

        for attempt in (1, 2):
            if not self._alive():
                if self._conn is not None:
                    self._session_lost(psycopg.OperationalError("the connection is closed"))
                self._conn = self._connect()
            self._statement_began = time.monotonic()
            try:
                return self._conn.execute(sql, (key,)).fetchone()
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                failure = self._session_lost(exc)
                if attempt == 2:
                    raise failure from exc
            finally:
                self._statement_began = None
        raise AssertionError("unreachable")  # pragma: no cover

    def acquire(self, tree_id: TreeID) -> bool:
        with self._lock:
            if tree_id in self._held:
                return True
            row = self._execute("SELECT pg_try_advisory_lock(%s)", _advisory_key(tree_id))
            if row and row[0]:
                self._held.add(tree_id)
                self._lost.discard(tree_id)
                return True
            return False

    def release(self, tree_id: TreeID) -> None:
        with self._lock:
            if tree_id not in self._held:
                return
            self._held.discard(tree_id)
            if not self._alive():
                return  # the session, and the lock with it, is gone
            self._statement_began = time.monotonic()
            try:
                self._conn.execute("SELECT pg_advisory_unlock(%s)", (_advisory_key(tree_id),))
            except Exception:  # noqa: BLE001 - a session that fails now has released the lock
                pass
            finally:
                self._statement_began = None

    def holds(self, tree_id: TreeID) -> bool:
        # Without ``_lock``: it is held across lock statements on the server, which may hang;
        # one set lookup sees the set before or after a concurrent change, never a torn one.
        return tree_id in self._held

    def check(self) -> set[TreeID]:
        """Trees whose lease was lost since the last check (each reported once); probes the
        session when it holds any lock, and connects again when it is gone."""
        import psycopg

        with self._lock:
            if self._held and self._conn is not None:
                self._statement_began = time.monotonic()
                try:
                    self._conn.execute("SELECT 1").fetchone()
                except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                    self._session_lost(exc)
                finally:
                    self._statement_began = None
            elif self._conn is not None and not self._alive():
                self._session_lost(psycopg.OperationalError("the connection is closed"))
            if self._conn is None:
                try:
                    self._conn = self._connect()
                except StoreFailure:
                    pass  # still down: the next check tries again
            lost, self._lost = self._lost, set()
            return lost

    def healthy(self) -> bool:
        """False while the session is gone, and while a statement on it (the probe, a lock or an
        unlock) has waited more than ``PROBE_STALL_SECONDS`` for the server. Without ``_lock``:
        a statement holds it for as long as it waits, for ever on a server that stopped
        answering (a health check waited with it)."""
        began = self._statement_began
        if began is not None and time.monotonic() - began > PROBE_STALL_SECONDS:
            return False
        conn = self._conn
        return conn is not None and not conn.closed and not conn.broken

    def close(self) -> None:
        with self._lock:
            self._held.clear()
            self._lost.clear()
            if self._conn is not None:
                try:
                    self._conn.close()
                except Exception:  # noqa: BLE001
                    pass
                self._conn = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]

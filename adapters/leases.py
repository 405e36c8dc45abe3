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
conflicting append (see ``adapters.runtime``).
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import uuid
from typing import Any, Protocol

from domain.ids import TreeID


class LeaseManager(Protocol):
    def acquire(self, tree_id: TreeID) -> bool: ...

    def release(self, tree_id: TreeID) -> None: ...

    def held(self) -> set[TreeID]: ...

    def close(self) -> None: ...


class MemoryLeases:
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

    def held(self) -> set[TreeID]:
        return set(self._held)

    def close(self) -> None:
        for tree_id in list(self._held):
            self.release(tree_id)


_FLOCK = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux: type, whence, start, len, pid


def _lock_offset(tree_id: TreeID) -> int:
    # 62 bits of the tree uuid: collisions are negligible and offsets stay positive.
    return int.from_bytes(uuid.UUID(hex=tree_id.hex).bytes[:8], "big") >> 2


class FileLeases:
    """OFD byte-range locks on one lease file (SQLite stores)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._lock = threading.Lock()
        self._held: set[TreeID] = set()

    def _fcntl(self, kind: int, tree_id: TreeID) -> bool:
        data = _FLOCK.pack(kind, os.SEEK_SET, _lock_offset(tree_id), 1, 0)
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, data)  # type: ignore[attr-defined]
        except OSError:
            return False
        return True

    def acquire(self, tree_id: TreeID) -> bool:
        with self._lock:
            if tree_id in self._held:
                return True
            if self._fcntl(fcntl.F_WRLCK, tree_id):
                self._held.add(tree_id)
                return True
            return False

    def release(self, tree_id: TreeID) -> None:
        with self._lock:
            if tree_id in self._held:
                self._fcntl(fcntl.F_UNLCK, tree_id)
                self._held.discard(tree_id)

    def held(self) -> set[TreeID]:
        return set(self._held)

    def close(self) -> None:
        with self._lock:
            self._held.clear()
            if self._fd >= 0:
                os.close(self._fd)  # closing the description releases every lock
                self._fd = -1


def _advisory_key(tree_id: TreeID) -> int:
    return int.from_bytes(uuid.UUID(hex=tree_id.hex).bytes[:8], "big", signed=True)


class PostgresLeases:
    """Session advisory locks on a dedicated connection."""

    def __init__(self, conninfo: dict[str, Any]) -> None:
        import psycopg

        self._conn = psycopg.connect(**conninfo, autocommit=True)
        self._lock = threading.Lock()
        self._held: set[TreeID] = set()

    def acquire(self, tree_id: TreeID) -> bool:
        with self._lock:
            if tree_id in self._held:
                return True
            row = self._conn.execute("SELECT pg_try_advisory_lock(%s)", (_advisory_key(tree_id),)).fetchone()
            if row and row[0]:
                self._held.add(tree_id)
                return True
            return False

    def release(self, tree_id: TreeID) -> None:
        with self._lock:
            if tree_id in self._held:
                self._conn.execute("SELECT pg_advisory_unlock(%s)", (_advisory_key(tree_id),))
                self._held.discard(tree_id)

    def held(self) -> set[TreeID]:
        return set(self._held)

    def close(self) -> None:
        with self._lock:
            self._held.clear()
            self._conn.close()

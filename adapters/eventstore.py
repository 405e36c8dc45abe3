"""The event store: one eventsourcing stream per root tree, on memory, SQLite or PostgreSQL.

Store URLs:

* ``memory:`` - a volatile store inside this process (tests);
* ``sqlite:///path/to/file.db`` (``sqlite:////abs/path.db``) - the embedded default;
* ``postgresql://user:password@host:port/dbname`` - production.

An append writes a list of events atomically at an expected version (optimistic
concurrency). A duplicate version raises :class:`VersionConflict`, unless the very
same events (same digests) are already the head of the stream, which makes a retry
after a lost response idempotent. Loading a tree reads its latest snapshot and folds
only the events after it, verifying the digest chain of every event read.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
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

from adapters.codec import (
    STATE_COMPRESSOR,
    DecodeError,
    OrjsonTranscoder,
    PydanticMapper,
    RecordedEvent,
    stored_json,
)
from adapters.leases import FileLeases, LeaseManager, MemoryLeases, PostgresLeases
from adapters.recorders import (
    IndexQueries,
    MemorySnapshotRecorder,
    MemoryTreeRecorder,
    PostgresSnapshotRecorder,
    PostgresTreeRecorder,
    SQLiteSnapshotRecorder,
    SQLiteTreeRecorder,
    TreeHead,
    cache_statements,
)
from domain.errors import InvalidInput, NotFound, Rejected, StoreFailure
from domain.events import TreeEvent
from domain.ids import ProcessID, StartID, TreeID
from domain.integrity import SealError
from domain.program import ProgramResolver
from domain.tree import FoldError, TreeState

DEFAULT_STORE = "sqlite:///./agentfold.db"
SNAPSHOT_TOPIC = "agentfold:TreeSnapshot"


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


class CorruptStream(StoreFailure):
    """The stored history breaks a rule (digest chain or fold)."""

    def __init__(self, tree_id: str, position: int, rule: str, detail: str) -> None:
        super().__init__("store.corrupt", f"tree {tree_id} is corrupt at position {position}: {rule}: {detail}")
        self.tree_id = tree_id
        self.position = position
        self.rule = rule
        self.detail = detail


@dataclass(frozen=True, slots=True)
class AppendResult:
    digest: str
    notification_ids: tuple[int, ...]


@dataclass(slots=True)
class LoadedTree:
    state: TreeState
    digest: str | None
    snapshot_version: int = 0


def parse_store_url(url: str) -> tuple[str, dict[str, str]]:
    """Split a store URL into a backend name and eventsourcing environment settings."""
    if url in ("memory:", "memory://"):
        return "memory", {"PERSISTENCE_MODULE": "eventsourcing.popo"}
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :]
        if not path:
            raise InvalidInput("store.url_invalid", f"sqlite URL {url!r} names no file", hint="sqlite:///path/to/file.db")
        return "sqlite", {
            "PERSISTENCE_MODULE": "eventsourcing.sqlite",
            "SQLITE_DBNAME": path,
            "SQLITE_LOCK_TIMEOUT": "30",
        }
    if url.startswith(("postgresql://", "postgres://")):
        parts = urlsplit(url)
        dbname = parts.path.lstrip("/")
        if not parts.hostname or not dbname:
            raise InvalidInput(
                "store.url_invalid", f"PostgreSQL URL {url!r} needs a host and a database",
                hint="postgresql://user:password@host:port/dbname",
            )
        return "postgresql", {
            "PERSISTENCE_MODULE": "eventsourcing.postgres",
            "POSTGRES_DBNAME": dbname,
            "POSTGRES_HOST": parts.hostname,
            "POSTGRES_PORT": str(parts.port or 5432),
            "POSTGRES_USER": unquote(parts.username or "postgres"),
            "POSTGRES_PASSWORD": unquote(parts.password or ""),
            "POSTGRES_POOL_SIZE": "4",
            "POSTGRES_MAX_OVERFLOW": "8",
            "POSTGRES_IDLE_IN_TRANSACTION_SESSION_TIMEOUT": "30",
        }
    raise InvalidInput(
        "store.url_invalid",
        f"unsupported store URL {url!r}",
        hint="use memory:, sqlite:///path.db or postgresql://user:pass@host:port/db",
    )


class EventStore:
    """Tree streams, snapshots and the tree index over one eventsourcing database."""

    def __init__(self, url: str = DEFAULT_STORE) -> None:
        self.url = url
        self.backend, settings = parse_store_url(url)
        self._settings = settings
        self.mapper = PydanticMapper(transcoder=OrjsonTranscoder())
        self._memory_leases: dict[TreeID, object] = {}
        self._memory_lock = threading.Lock()
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
                    self.recorder = SQLiteTreeRecorder(self.factory.datastore)
                    self.snapshots = SQLiteSnapshotRecorder(self.factory.datastore)
                else:
                    self.recorder = PostgresTreeRecorder(self.factory.datastore)
                    self.snapshots = PostgresSnapshotRecorder(self.factory.datastore)
                self.recorder.create_table()
                self.snapshots.create_table()
        except InvalidInput:
            raise
        except (PersistenceError, OSError) as exc:
            raise StoreFailure("store.unavailable", f"cannot open store {redact(url)}: {exc}") from exc

    @property
    def index(self) -> IndexQueries:
        return self.recorder  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.factory is not None:
            self.factory.close()

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
    ) -> AppendResult:
        """Append ``events`` at positions ``expected_version + 1 ...`` in one transaction."""
        tree_uuid = tree_id.uuid
        stored: list[StoredEvent] = []
        digest = previous_digest
        for offset, event in enumerate(events, start=1):
            record, digest = self.mapper.encode(tree_id, tree_uuid, expected_version + offset, event, timestamp, digest)
            stored.append(record)
        assert digest is not None
        if head is not None:
            head = head.with_digest(digest)
        try:
            ids = self.recorder.insert_events(stored, head=head)
        except IntegrityError as exc:
            if self._already_head(tree_id, stored):
                return AppendResult(digest, ())
            raise VersionConflict(tree_id, expected_version) from exc
        except PersistenceError as exc:
            raise StoreFailure("store.append_failed", f"append to tree {tree_id} failed: {exc}") from exc
        return AppendResult(digest, tuple(ids or ()))

    def _already_head(self, tree_id: TreeID, stored: Sequence[StoredEvent]) -> bool:
        """Identical events already stored as the stream's head: an idempotent retry."""
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
            raise StoreFailure("store.read_failed", f"reading tree {tree_id} failed: {exc}") from exc
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
    ) -> LoadedTree:
        """Fold a tree from its latest snapshot (if any) and the events after it."""
        state: TreeState | None = None
        digest: str | None = None
        snapshot_version = 0
        if use_snapshot:
            snapshot = self.latest_snapshot(tree_id, programs, upto=upto)
            if snapshot is not None:
                state, digest = snapshot
                snapshot_version = state.version
        if state is None:
            state = TreeState(programs)
        records = self.read(tree_id, after=state.version, upto=upto, previous_digest=digest, verify=verify)
        if not records and state.version == 0:
            raise NotFound("engine.tree.not_found", f"tree {tree_id} does not exist in {redact(self.url)}")
        for record in records:
            try:
                state.apply(record.event, record.position)
            except FoldError as exc:
                raise CorruptStream(tree_id, exc.position, exc.rule, exc.detail) from exc
            digest = record.digest
        return LoadedTree(state, digest, snapshot_version)

    # -- snapshots ---------------------------------------------------------

    @staticmethod
    def encode_snapshot(state: TreeState, digest: str) -> bytes:
        """The snapshot JSON of a folded tree at its version (serialize under the owner's lock)."""
        return orjson.dumps({"tree": state.to_json(compact=True), "digest": digest})

    def save_snapshot(self, tree_id: TreeID, state: TreeState, digest: str) -> None:
        self.write_snapshot(tree_id, state.version, self.encode_snapshot(state, digest))


    def write_snapshot(self, tree_id: TreeID, version: int, body: bytes) -> None:
        """Store a snapshot's JSON taken at ``version`` (deflated when that is smaller, as event
        states are: a long conversation's snapshot holds every message) and drop older ones."""
        state_version = version
        body = STATE_COMPRESSOR.compress(body)
        try:
            self.snapshots.insert_events([StoredEvent(tree_id.uuid, state_version, SNAPSHOT_TOPIC, body)])
        except IntegrityError:
            return  # the same version was already snapshotted
        # Only the newest snapshot is ever read; keeping the others would grow storage
        # with the square of a long conversation.
        self.snapshots.prune(tree_id.uuid, state_version)

    def latest_snapshot(
        self, tree_id: TreeID, programs: ProgramResolver | None, *, upto: int | None = None
    ) -> tuple[TreeState, str] | None:
        """The newest snapshot (at or before ``upto``), folded back into a tree."""
        rows = self.snapshots.select_events(tree_id.uuid, desc=True, limit=1, lte=upto)
        if not rows:
            return None
        data = orjson.loads(stored_json(rows[0].state))
        return TreeState.from_json(data["tree"], programs), str(data["digest"])

    # -- index and feed ----------------------------------------------------

    def heads(self, *, live_only: bool = False) -> list[TreeHead]:
        return self.index.select_heads(live_only=live_only)

    def head(self, tree_id: TreeID) -> TreeHead | None:
        return self.index.select_head(tree_id)

    def versions(self, tree_ids: Sequence[TreeID]) -> dict[TreeID, int]:
        """The stored version of each tree (from the tree index), in one query."""
        return {TreeID(k): v for k, v in self.index.select_versions([str(t) for t in tree_ids]).items()}

    def tree_of_process(self, process_id: str) -> TreeID | None:
        found = self.index.tree_of_process(process_id)
        return TreeID(found) if found else None

    def find_tree(self, ref: str) -> TreeID:
        """A tree id, a start id or a process id, to a tree this store indexes (else NotFound)."""
        if ref.startswith("tree:"):
            tree_id = TreeID(ref)
            if self.head(tree_id) is None:
                raise NotFound("engine.tree.not_found", f"tree {ref} does not exist")
            return tree_id
        found = self.tree_of_process(ref)
        if found is not None:
            return found
        tree_id = TreeID.for_start(StartID(ref))
        if self.head(tree_id) is None:
            raise NotFound(
                "engine.tree.not_found", f"no tree, start id or process {ref!r} in this store",
                hint="list trees with `agentfold trees`",
            )
        return tree_id

    def find_process_tree(self, process_id: str) -> TreeID:
        """The tree of a process (InvalidInput for a malformed id, else NotFound)."""
        found = self.tree_of_process(ProcessID(process_id))
        if found is None:
            raise NotFound("engine.process.not_found", f"process {process_id} is not in this store")
        return found

    def tree_of_unknown_effect(self, effect_id: str) -> TreeID | None:
        found = self.index.tree_of_unknown_effect(effect_id)
        return TreeID(found) if found else None

    def notifications(self, after: int, limit: int = 500) -> Sequence[Notification]:
        return self.recorder.select_notifications(after, limit, inclusive_of_start=False)

    def max_notification_id(self) -> int:
        return int(self.recorder.max_notification_id() or 0)

    # -- leases ------------------------------------------------------------

    def leases(self) -> LeaseManager:
        """A new lease manager (one per runtime)."""
        if self.backend == "memory":
            return MemoryLeases(self._memory_leases, self._memory_lock)
        if self.backend == "sqlite":
            return FileLeases(self._settings["SQLITE_DBNAME"] + ".leases")
        return PostgresLeases(
            {
                "dbname": self._settings["POSTGRES_DBNAME"],
                "host": self._settings["POSTGRES_HOST"],
                "port": self._settings["POSTGRES_PORT"],
                "user": self._settings["POSTGRES_USER"],
                "password": self._settings["POSTGRES_PASSWORD"],
            }
        )


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@")
    return url


def store_url_from_env(explicit: str | None = None) -> str:
    return explicit or os.environ.get("AGENTFOLD_STORE") or DEFAULT_STORE


def tree_uuid(tree_id: TreeID) -> uuid.UUID:
    return tree_id.uuid

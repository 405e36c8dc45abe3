"""The Kafka feed publisher: every stored event, in order, as a documented JSON envelope.

The publisher follows the store's notification log (every event of every tree, in
commit order) from its tracked position and produces each event to one topic with
kafka-python (``acks="all"``, idempotent producer):

* key: the root tree id (``tree:<32 hex>``), so one tree's events share a partition
  and keep their order;
* value: the envelope (docs/kafka.md), canonical JSON;
* headers: ``type``, ``notification_id``, ``schema_version``.

Delivery: a batch is produced, flushed, and every send is confirmed by the broker
before the batch's last notification id is stored as the publisher's position (the
eventsourcing tracking table ``agentfold_tracking``, application name
``agentfold.publisher:<topic>``). A crash between the broker's acknowledgement and the
position write re-sends that batch on restart: duplicates are possible inside the
unacknowledged window, a gap never is. Consumers dedupe by ``notification_id`` (or by
``(tree_id, position)``).

Following: PostgreSQL stores wake the publisher with LISTEN/NOTIFY on the channel every
append notifies (``agentfold_events``), with polling as a safety net; SQLite stores are
polled. One publisher per (store, topic): each holds the topic's publisher lease
(``PublisherLease``) while it runs, and a second one is refused (``feed.position_conflict``).

Failures while following (``Publisher.follow_until_stopped``): a failure of the store (a
restarted or failed-over server, a terminated session) or a retriable failure of the
broker (unreachable, no acknowledgement in time) is reported as one line and retried with
the read models' backoff policy (``agentfold.adapters.follower.retry_until_stopped``); each attempt
starts again from the *stored* position, so at most the batch whose position was not
stored is produced again. A second publisher on the topic (``feed.position_conflict``) and
a record the broker refuses for good (too large, not authorized) stop the publisher.

A tree with a stored event that cannot be read or fails verification (``CorruptStream``)
does not stop the others: that event and every later one of the tree are held back
(``HeldTrees``: ``agentfold_feed_held``, recorded before the batch's position), the other
trees are published. Each start of the publisher publishes the held records of a tree that
verifies again (repaired) and stops holding it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from eventsourcing.persistence import IntegrityError, Notification, Tracking

from agentfold.adapters.codec import TOPIC_PREFIX, stored_json
from agentfold.adapters.eventstore import CorruptStream, EventStore, nameless_row
from agentfold.adapters.queries import corrupt_tree_error
from agentfold.adapters.read_models import TRACKING_TABLE, table_exists, tracking_recorder
from agentfold.domain.errors import AgentfoldError, InvalidInput, StoreFailure
from agentfold.domain.events import EVENT_TYPES
from agentfold.domain.ids import TreeID
from agentfold.domain.integrity import SealError, chain_digest, unseal

APPLICATION_PREFIX = "agentfold.publisher:"
DEFAULT_PARTITIONS = 3
DEFAULT_BATCH = 500
DEFAULT_POLL_INTERVAL = 0.05  # seconds; a PostgreSQL follower's safety net is 10 x this
#: Seconds a Kafka client waits for its first broker connection (kafka-python's
#: ``bootstrap_timeout_ms``) before the command fails with ``feed.unavailable``; ``--connect-timeout``.
DEFAULT_CONNECT_TIMEOUT = 30.0
CRASH_EXIT = 75
# Seconds of one wait for acknowledgements, so that ``Publisher.interrupt`` ends the wait soon.
ACK_SLICE = 0.25
# One event may hold several payloads of up to 4 MiB each (TreeStarted: input and configuration).
MAX_RECORD_BYTES = 16 * 1024 * 1024

log = logging.getLogger("agentfold.feed")

Envelope = dict[str, Any]


class FeedError(AgentfoldError):
    """The broker did not acknowledge (or could not be reached); nothing was recorded as published.

    ``retriable``: the broker may take the same records later (it was unreachable, or did not
    answer in time), as opposed to refusing them for good (too large, not authorized).
    """

    def __init__(self, message: str, *, retriable: bool = True) -> None:
        super().__init__("feed.unavailable", message, "check --bootstrap and the broker; run again: the publisher and the transcripts consumer resume where they stopped")
        self.retriable = retriable


def bootstrap_config(bootstrap: str, connect_timeout: float) -> dict[str, Any]:
    """The servers and the wait for the first connection, as every Kafka client of the feed takes them."""
    return {"bootstrap_servers": bootstrap, "bootstrap_timeout_ms": max(1, round(connect_timeout * 1000))}


def unreachable(bootstrap: str, connect_timeout: float, exc: BaseException) -> FeedError:
    """A Kafka client that could not be set up: when no broker answered, after how long."""
    from kafka.errors import KafkaTimeoutError

    waited = f" within {connect_timeout:g} s (--connect-timeout)" if isinstance(exc, KafkaTimeoutError) else ""
    return FeedError(f"cannot reach the broker at {bootstrap}{waited}: {exc}")


def _retriable(exc: BaseException) -> bool:
    """kafka-python marks the errors a later attempt may not meet (``KafkaError.retriable``)."""
    return bool(getattr(exc, "retriable", False))


def publish_failed(exc: BaseException) -> bool:
    """The failures a following publisher retries: the store's, and the broker's retriable ones."""
    from agentfold.adapters.follower import store_failed

    if isinstance(exc, FeedError):
        return exc.retriable
    if isinstance(exc, AgentfoldError) and exc.code == "feed.position_conflict":
        return False  # another publisher on this topic: retrying only races it again
    return store_failed(exc)


# ---------------------------------------------------------------------------
# Envelopes


def _tree_of(notification: Notification) -> TreeID:
    originator = notification.originator_id
    return TreeID.from_uuid(originator if isinstance(originator, uuid.UUID) else uuid.UUID(str(originator)))


def envelope_of(notification: Notification, chain: ChainCheck | None = None, tree_id: TreeID | None = None) -> Envelope:
    """The feed envelope of one stored event (the body exactly as stored, defaults omitted);
    with ``chain``, only once its digest chains to the previous event of its tree. ``tree_id``:
    its tree, when the caller has parsed it already."""
    if tree_id is None:
        tree_id = _tree_of(notification)
    position = int(notification.originator_version)
    topic: object = notification.topic
    if not isinstance(topic, str):  # NULL: a row edited by hand
        raise CorruptStream(tree_id, position, "stream.event_type", f"the topic is {topic!r}, not text")
    tag = topic[len(TOPIC_PREFIX) :] if topic.startswith(TOPIC_PREFIX) else ""
    name, _, version_text = tag.partition("@")
    if name not in EVENT_TYPES or (version_text and not (version_text.isascii() and version_text.isdigit())):
        raise CorruptStream(tree_id, position, "stream.event_type", f"unknown topic {notification.topic!r}")
    try:
        sealed = unseal(stored_json(notification.state))
    except SealError as exc:
        raise CorruptStream(tree_id, position, "integrity.format", str(exc)) from exc
    if chain is not None:
        chain.check(tree_id, position, tag, sealed.content, sealed.digest)
    body = sealed.body
    return {
        "notification_id": int(notification.id),
        "tree_id": str(tree_id),
        "position": position,
        "process_id": str(body.get("process_id", "")),
        "type": name,
        "schema_version": int(version_text) if version_text else 1,
        "timestamp": sealed.timestamp,
        "payload": body,
        "digest": sealed.digest,
    }


def _verified_envelope(notification: Notification, chain: ChainCheck, tree_id: TreeID) -> Envelope:
    """``envelope_of`` with the chain check, a stored row that does not even decode (a NULL or
    malformed column) included: ``CorruptStream`` (``integrity.format``) naming its tree."""
    try:
        return envelope_of(notification, chain, tree_id)
    except (TypeError, ValueError, AttributeError) as exc:
        try:
            position = int(notification.originator_version)
        except (TypeError, ValueError):
            position = 0
        raise CorruptStream(tree_id, position, "integrity.format",
                            f"the stored event does not decode: {type(exc).__name__}: {exc}") from exc


class ChainCheck:
    """The digest chain of what a publisher produces (``agentfold.domain.integrity``): each event's
    recorded digest must be the one its tree's previous event and its own content give, so a
    stored event changed by hand, or a history with a hole, never reaches the topic
    (``store.corrupt``, as loading the tree says it).

    The previous digest comes from the event before in the same batch or an earlier one (the
    last ``capacity`` trees are remembered), else from the store (one read per tree).

    With ``anchor`` called for a batch (after reading it), each event must also lie within
    the end its tree's index row anchors (``EventStore.past_anchor``): an event added past
    it by hand, even one chained correctly, is refused as loading the tree refuses it."""

    def __init__(self, store: EventStore | None, capacity: int = 10_000) -> None:
        """``store`` None: a chain over the digests given with ``seed`` alone (the transcript
        consumer's tables hold them); a previous digest neither seeded nor checked is missing."""
        self.store = store
        self.capacity = capacity
        self._last: collections.OrderedDict[TreeID, tuple[int, str]] = collections.OrderedDict()
        self._anchors: dict[TreeID, tuple[int, str]] | None = None

    def anchor(self, notifications: Sequence[Notification]) -> None:
        """Read the index rows of the batch's trees (one query): call it after reading the batch."""
        trees: list[TreeID] = []
        for notification in {n.originator_id: n for n in notifications}.values():  # one per tree, not per event
            try:
                trees.append(_tree_of(notification))
            except (TypeError, ValueError):
                continue  # a row that names no tree: its reader says so
        trees.sort()
        if self.store is None:
            raise ValueError("a chain without a store has no index rows to anchor to")
        self._anchors = self.store.anchors(trees)

    def check(self, tree_id: TreeID, position: int, tag: str, content: bytes, recorded: str) -> None:
        previous = self._previous(tree_id, position)
        expected = chain_digest(previous, tree_id, position, tag, content)
        if expected != recorded:
            raise CorruptStream(tree_id, position, "integrity.digest_chain",
                                f"recorded digest {recorded} but the chain gives {expected}")
        if self._anchors is not None and self.store is not None:
            problem = self.store.past_anchor(tree_id, position, recorded, self._anchors.get(tree_id))
            if problem is not None:
                raise problem
        self.seed(tree_id, position, recorded)

    def last_position(self, tree_id: TreeID) -> int | None:
        """The position of the last event of ``tree_id`` this chain checked or was seeded with
        (None: not remembered)."""
        known = self._last.get(tree_id)
        return known[0] if known is not None else None

    def seed(self, tree_id: TreeID, position: int, digest: str) -> None:
        """Take ``digest`` as the one of ``tree_id`` at ``position`` (the next event chains onto it)."""
        self._last[tree_id] = (position, digest)
        self._last.move_to_end(tree_id)
        if len(self._last) > self.capacity:
            self._last.popitem(last=False)

    def _previous(self, tree_id: TreeID, position: int) -> str | None:
        if position == 1:
            return None
        known = self._last.get(tree_id)
        if known is not None and known[0] == position - 1:
            return known[1]
        if self.store is None:
            raise CorruptStream(tree_id, position - 1, "integrity.missing_event", f"position {position - 1} is not held")
        try:
            digest = self.store.stored_digest(tree_id, position - 1)
        except SealError as exc:
            raise CorruptStream(tree_id, position - 1, "integrity.format", str(exc)) from exc
        if digest is None:
            raise CorruptStream(tree_id, position - 1, "integrity.missing_event", f"position {position - 1} is missing")
        return digest


def envelope_bytes(envelope: Envelope) -> bytes:
    """The record value: canonical JSON (sorted keys, no whitespace)."""
    return orjson.dumps(envelope, option=orjson.OPT_SORT_KEYS)


def envelope_headers(envelope: Envelope) -> list[tuple[str, bytes]]:
    return [
        ("type", str(envelope["type"]).encode()),
        ("notification_id", str(envelope["notification_id"]).encode()),
        ("schema_version", str(envelope["schema_version"]).encode()),
    ]


def store_envelopes(store: EventStore, after: int = 0, batch: int = 1000) -> Iterator[Envelope]:
    """Every envelope the publisher would produce, read straight from the notification log,
    verified as the publisher verifies them (digest chain, index-row anchor: ``CorruptStream``
    at the first event that fails)."""
    position = after
    chain = ChainCheck(store)
    while True:
        notifications = store.notifications(position, batch)
        if not notifications:
            return
        chain.anchor(notifications)
        for n in notifications:
            yield envelope_of(n, chain)
        position = notifications[-1].id


# ---------------------------------------------------------------------------
# Position


class PublisherPosition:
    """The publisher's tracked position in the store's own database (eventsourcing tracking)."""

    def __init__(self, store: EventStore, topic: str) -> None:
        if store.backend not in ("sqlite", "postgresql"):
            raise InvalidInput(
                "feed.store_unsupported", f"a {store.backend} store has no database to track the publisher's position in",
                hint="publish from a sqlite:/// or postgresql:// store",
            )
        self.application = APPLICATION_PREFIX + topic
        self.tracking = tracking_recorder(store)

    def get(self) -> int:
        return int(self.tracking.max_tracking_id(self.application) or 0)

    def save(self, notification_id: int) -> None:
        self.tracking.insert_tracking(Tracking(self.application, notification_id))


#: How often a following publisher makes sure it still holds its topic's lease (a PostgreSQL
#: lease lives as long as its session: a server restart ends it).
LEASE_CHECK_SECONDS = 1.0


#: Kafka's rule for a topic name: 1 to 249 of ASCII letters, digits, ".", "_" and "-", not "." or "..".
TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")


def check_topic(topic: object) -> str:
    """``topic`` when Kafka takes it as a topic name, else ``feed.topic_invalid`` (before the
    store or the broker is touched: a publisher stored a position for a topic no consumer
    could read)."""
    if not isinstance(topic, str) or not TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
        shown = repr(topic) if not isinstance(topic, str) else repr(topic[:80])
        raise InvalidInput(
            "feed.topic_invalid",
            f"{shown} is not a Kafka topic name: 1 to 249 ASCII letters, digits, '.', '_' or '-' (not '.' or '..')",
            hint="name the topic with those characters only, e.g. agentfold.events",
        )
    return topic


def publisher_lease_id(topic: str) -> TreeID:
    """The key of the lease the publisher of ``topic`` holds among the store's owner leases: an
    id no tree has (derived in a namespace of its own), so a second publisher is excluded
    the way a second owner of a run is."""
    digest = hashlib.sha256(b"agentfold.publisher-lease\x00" + topic.encode("utf-8", "surrogatepass")).digest()
    return TreeID.from_uuid(uuid.UUID(bytes=digest[:16]))


class PublisherLease:
    """One publisher per (store, topic): a lease held for the publisher's lifetime (an OFD lock
    on the SQLite store's ``.leases`` file, a PostgreSQL session advisory lock), released when
    it closes or its process dies. A second publisher is refused at start with
    ``feed.position_conflict`` instead of producing every event again beside the first."""

    def __init__(self, store: EventStore, topic: str) -> None:
        self.topic = topic
        self._key = publisher_lease_id(topic)
        self._leases = store.leases()
        self._checked = 0.0
        try:
            self.keep()
        except BaseException:
            self._leases.close()
            raise

    def keep(self, *, every: float = 0.0) -> None:
        """Make sure the lease is held (taken again after a lost session), at most once per
        ``every`` seconds; ``feed.position_conflict`` when another publisher holds it."""
        now = time.monotonic()
        if every and now - self._checked < every:
            return
        self._checked = now
        self._leases.check()
        if self._leases.holds(self._key):
            return
        if not self._leases.acquire(self._key):
            raise StoreFailure(
                "feed.position_conflict",
                f"another publisher is running on topic {self.topic!r} of this store (it holds the topic's publisher "
                "lease): two would produce every event twice",
                hint="run one publisher per store and topic: stop the other one, or publish to another topic",
            )

    def close(self) -> None:
        self._leases.close()


def publisher_positions(store: EventStore) -> dict[str, int]:
    """The stored position of every publisher of this store, by topic (none before the first
    ``publish``; a memory store has none). Reads only: nothing is created."""
    if store.backend not in ("sqlite", "postgresql"):
        return {}
    mark = "?" if store.backend == "sqlite" else "%s"
    sql = (f"SELECT application_name AS a, max(notification_id) AS n FROM {TRACKING_TABLE} "
           f"WHERE application_name LIKE {mark} GROUP BY application_name")
    with store.factory.datastore.transaction(commit=False) as c:
        if not table_exists(c, store.backend, TRACKING_TABLE):
            return {}
        c.execute(sql, (APPLICATION_PREFIX + "%",))
        return {str(r["a"])[len(APPLICATION_PREFIX):]: int(r["n"]) for r in c.fetchall()}


# ---------------------------------------------------------------------------
# Held trees

#: One row per (publisher, tree) whose records the publisher holds back (``HeldTree``).
HELD_TABLE = "agentfold_feed_held"
_HELD_COLUMNS = "tree_id, start_id, held_from, found_at, position, rule, detail"


@dataclass(frozen=True, slots=True)
class HeldTree:
    """A tree whose records a publisher holds back: one of its stored events cannot be read or
    fails verification (``CorruptStream``), so that event and every later one of the tree
    (positions ``held_from`` on, the first at notification ``found_at``) stay off the topic,
    while the other trees are published. ``position``, ``rule`` and ``detail`` name the damage
    (``position`` is below ``held_from`` when the event the chain check read back is the damaged
    one); ``start_id`` is the tree index's (None without an index row)."""

    tree_id: str
    start_id: str | None
    held_from: int
    found_at: int
    position: int
    rule: str
    detail: str

    def entry(self) -> dict[str, Any]:
        """Its ``--json`` form (the shape of a listing's corrupt tree, plus where the hold starts)."""
        return {"tree_id": self.tree_id, "start_id": self.start_id, "code": "store.corrupt",
                "position": self.position, "rule": self.rule, "detail": self.detail,
                "held_from": self.held_from, "found_at": self.found_at}

    def consequence(self) -> str:
        """What the hold means, for the lines that report it."""
        return (f"its records from position {self.held_from} (notification {self.found_at}) on are held back from the "
                "topic while the other trees are published; once it verifies again (repaired), the next start of "
                "the publisher publishes them")

    def line(self) -> str:
        """The one line that reports it (logs, ``publish`` stderr): the error ``--once`` reports,
        its detail on one line."""
        entry = {**self.entry(), "detail": " ".join(self.detail.split())}
        return f"{corrupt_tree_error(entry, self.consequence()).message} (see `agentfold audit verify {self.tree_id}`)"


def _held_sql(backend: str, statement: str) -> str:
    return statement if backend == "sqlite" else statement.replace("?", "%s")


class HeldTrees:
    """The trees one publisher holds back, in the store's own database (``agentfold_feed_held``),
    so that a restarted publisher goes on holding them: their later events are never produced
    after a hole."""

    def __init__(self, store: EventStore, application: str) -> None:
        self.store = store
        self.application = application
        self._datastore = store.factory.datastore
        with store.schema_lock(), self._datastore.transaction(commit=True) as c:
            c.execute(
                f"CREATE TABLE IF NOT EXISTS {HELD_TABLE} (application_name TEXT NOT NULL, tree_id TEXT NOT NULL, "
                "start_id TEXT, held_from INTEGER NOT NULL, found_at BIGINT NOT NULL, position INTEGER NOT NULL, "
                "rule TEXT NOT NULL, detail TEXT NOT NULL, PRIMARY KEY (application_name, tree_id))"
            )

    def all(self) -> dict[str, HeldTree]:
        """Every tree held, by tree id, in the order they were found."""
        with self._datastore.transaction(commit=False) as c:
            c.execute(_held_sql(self.store.backend, f"SELECT {_HELD_COLUMNS} FROM {HELD_TABLE} "
                                                    "WHERE application_name = ? ORDER BY found_at, tree_id"),
                      (self.application,))
            rows = c.fetchall()
        return {str(r["tree_id"]): HeldTree(str(r["tree_id"]), None if r["start_id"] is None else str(r["start_id"]),
                                            int(r["held_from"]), int(r["found_at"]), int(r["position"]),
                                            str(r["rule"]), str(r["detail"]))
                for r in rows}

    def hold(self, held: HeldTree) -> None:
        """Record it (once: a batch produced again after a crash finds it again)."""
        self._write(f"INSERT INTO {HELD_TABLE} (application_name, {_HELD_COLUMNS}) VALUES (?,?,?,?,?,?,?,?) "
                    "ON CONFLICT (application_name, tree_id) DO NOTHING",
                    (self.application, held.tree_id, held.start_id, held.held_from, held.found_at, held.position,
                     held.rule, held.detail))

    def move(self, held: HeldTree) -> None:
        """Record where the hold of its tree now starts and why (part of it was published)."""
        self._write(f"UPDATE {HELD_TABLE} SET held_from = ?, found_at = ?, position = ?, rule = ?, detail = ? "
                    "WHERE application_name = ? AND tree_id = ?",
                    (held.held_from, held.found_at, held.position, held.rule, held.detail, self.application,
                     held.tree_id))

    def release(self, tree_id: str) -> None:
        self._write(f"DELETE FROM {HELD_TABLE} WHERE application_name = ? AND tree_id = ?", (self.application, tree_id))

    def _write(self, statement: str, params: tuple[Any, ...]) -> None:
        with self._datastore.transaction(commit=True) as c:
            c.execute(_held_sql(self.store.backend, statement), params)


def held_trees_by_topic(store: EventStore) -> dict[str, int]:
    """How many trees each publisher of this store holds back, by topic (topics holding none are
    left out; reads only: nothing is created)."""
    if store.backend not in ("sqlite", "postgresql"):
        return {}
    sql = _held_sql(store.backend, f"SELECT application_name AS a, count(*) AS n FROM {HELD_TABLE} "
                                   "WHERE application_name LIKE ? GROUP BY application_name")
    with store.factory.datastore.transaction(commit=False) as c:
        if not table_exists(c, store.backend, HELD_TABLE):
            return {}
        c.execute(sql, (APPLICATION_PREFIX + "%",))
        return {str(r["a"])[len(APPLICATION_PREFIX):]: int(r["n"]) for r in c.fetchall()}


def _log_held(held: HeldTree) -> None:
    log.warning("publisher: %s", held.line())


def _log_released(held: HeldTree, published: int) -> None:
    log.warning("publisher: %s", released_line(held, published))


def released_line(held: HeldTree, published: int) -> str:
    return (f"tree {held.tree_id} verifies again: published its {published} held record(s) from position "
            f"{held.held_from} on; its records go on with the others")


# ---------------------------------------------------------------------------
# Kafka


def ensure_topic(
    bootstrap: str, topic: str, partitions: int = DEFAULT_PARTITIONS, replication_factor: int = 1,
    *, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
) -> bool:
    """Create the topic if it is missing; True when this call created it."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError, TopicAlreadyExistsError

    try:
        admin = KafkaAdminClient(**bootstrap_config(bootstrap, connect_timeout), client_id="agentfold-publisher-admin")
    except KafkaError as exc:
        raise unreachable(bootstrap, connect_timeout, exc) from exc
    try:
        admin.create_topics(
            {topic: {"num_partitions": partitions, "replication_factor": replication_factor,
                     "configs": {"max.message.bytes": str(MAX_RECORD_BYTES)}}},
            wait_for_metadata=True,
        )
        return True
    except TopicAlreadyExistsError:
        return False
    except KafkaError as exc:
        raise FeedError(f"cannot create topic {topic}: {exc}", retriable=_retriable(exc)) from exc
    finally:
        admin.close()


def producer_config(bootstrap: str, **extra: Any) -> dict[str, Any]:
    """The producer settings the feed relies on (acks=all, idempotence) plus ``extra``."""
    config: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "client_id": "agentfold-publisher",
        "acks": "all",
        "enable_idempotence": True,
        "linger_ms": 2,
        "batch_size": 256 * 1024,
        "max_request_size": MAX_RECORD_BYTES,
        # Shorter than the publisher's wait for acknowledgements (ack_timeout, 60 s), so that a
        # batch the broker does not take normally ends as failed (expired) records, not as a timeout.
        "delivery_timeout_ms": 50_000,
    }
    config.update(extra)
    return config


def new_producer(bootstrap: str, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT) -> Any:
    """A kafka-python producer with ``producer_config`` (FeedError when the broker cannot be reached)."""
    from kafka import KafkaProducer
    from kafka.errors import KafkaError

    try:
        return KafkaProducer(**producer_config(bootstrap, **bootstrap_config(bootstrap, connect_timeout)))
    except KafkaError as exc:
        raise unreachable(bootstrap, connect_timeout, exc) from exc


def discard_producer(producer: Any) -> None:
    """Close a producer at once, dropping the records it still holds (a batch that failed: never
    recorded as published, so produced again from the stored position)."""
    try:
        producer.close(timeout=0)
    except Exception:  # noqa: BLE001 - close() flushes first and refuses while records are pending
        # kafka-python's close() would force-close its sender after that flush; do it directly,
        # or the old sender thread would go on sending the dropped batch next to its re-send.
        sender = getattr(producer, "_sender", None)
        if sender is not None:
            sender.force_close()


def crash_hook_from_env() -> Callable[[int], None]:
    """``AGENTFOLD_PUBLISHER_CRASH=after-produce:N``: die (os._exit) after the broker acknowledged
    batch N and before its position is stored (real process death, for the crash tests)."""
    spec = os.environ.get("AGENTFOLD_PUBLISHER_CRASH", "")
    if not spec:
        return lambda batch: None
    kind, _, n = spec.partition(":")
    if kind != "after-produce" or not (n.isascii() and n.isdigit()):
        raise InvalidInput("feed.crash_spec", f"AGENTFOLD_PUBLISHER_CRASH={spec!r} is not after-produce:N")
    target = int(n)

    def hook(batch: int) -> None:
        if batch == target:
            os._exit(CRASH_EXIT)

    return hook


@dataclass(frozen=True, slots=True)
class PublishReport:
    events: int
    position: int
    failures: int = 0  # store or broker failures retried while following


class Publisher:
    """Produces a store's events to a topic, storing its position after each acknowledged batch."""

    def __init__(
        self,
        store: EventStore,
        bootstrap: str,
        topic: str,
        *,
        partitions: int = DEFAULT_PARTITIONS,
        replication_factor: int = 1,
        batch_size: int = DEFAULT_BATCH,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        ack_timeout: float = 60.0,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        producer: Any = None,
        on_held: Callable[[HeldTree], None] | None = None,
        on_released: Callable[[HeldTree, int], None] | None = None,
        on_still_held: Callable[[HeldTree], None] | None = None,
    ) -> None:
        """``on_held`` is called once for each tree this publisher starts holding back (after the
        batch that found it is acknowledged and its position stored), ``on_released`` for each
        held tree that verifies again, with the number of its held records then published; by
        default both are warnings on the ``agentfold.feed`` logger. ``on_still_held`` is called
        for each held tree that does not verify yet, each time the publisher starts."""
        check_topic(topic)
        if batch_size < 1:
            raise InvalidInput("feed.batch_size", "the batch size must be at least 1")
        from agentfold.adapters.follower import check_poll_interval

        check_poll_interval(poll_interval, "feed.poll_interval_invalid")
        self.store = store
        self.topic = topic
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.ack_timeout = ack_timeout
        self.connect_timeout = connect_timeout
        self._position = PublisherPosition(store, topic)
        # Before the position is read: the position is this publisher's while it holds the lease.
        self._lease = PublisherLease(store, topic)
        try:
            self._open(store, bootstrap, topic, partitions, replication_factor, producer, on_held, on_released,
                       on_still_held)
        except BaseException:
            self._lease.close()
            raise

    def _open(
        self, store: EventStore, bootstrap: str, topic: str, partitions: int, replication_factor: int, producer: Any,
        on_held: Callable[[HeldTree], None] | None, on_released: Callable[[HeldTree, int], None] | None,
        on_still_held: Callable[[HeldTree], None] | None,
    ) -> None:
        self.position = self._position.get()
        self._chain = ChainCheck(store)
        self._held = HeldTrees(store, self._position.application)
        self.held: dict[str, HeldTree] = self._held.all()  # trees whose records are held back, by tree id
        self.on_held = on_held or _log_held
        self.on_released = on_released or _log_released
        self.on_still_held = on_still_held
        self.held_events = 0  # events of held trees this publisher passed over (not produced)
        self.released_events = 0  # records of held trees it produced once they verified again (in ``events``)
        # Per tree, the last position produced ahead of its notification (a release, or a row
        # restored by hand under a later notification id): the main loop passes those over.
        self._ahead: dict[str, int] = {}
        ensure_topic(bootstrap, topic, partitions, replication_factor, connect_timeout=self.connect_timeout)
        # A producer of its own is replaced after a broker failure (see follow_until_stopped).
        self._bootstrap = bootstrap if producer is None else None
        self.producer: Any = producer if producer is not None else self._new_producer()
        self._crash = crash_hook_from_env()
        self._interrupted = threading.Event()
        self.batches = 0
        self.steps = 0  # steps that ended without an error (store and broker answered): progress, for the backoff
        self.events = 0
        self.bytes = 0
        self.failures = 0  # failures retried while following, counted as they happen

    def _new_producer(self) -> Any:
        """A producer of this publisher's own: at the start, and after a broker failure."""
        assert self._bootstrap is not None
        return new_producer(self._bootstrap, self.connect_timeout)

    # -- one batch ---------------------------------------------------------------

    def step(self) -> int:
        """Produce the next batch (at most ``batch_size`` events); returns how many it consumed
        (produced, or passed over as events of a held tree)."""
        self._lease.keep(every=LEASE_CHECK_SECONDS)
        try:
            notifications: Sequence[Notification] = self.store.notifications(self.position, self.batch_size)
        except (TypeError, ValueError):
            # A row eventsourcing cannot even read (a NULL or malformed column): the rows as
            # stored, so that the tree of the bad one is held back (or, naming no tree, named).
            notifications = self.store.raw_notifications(self.position, self.batch_size)
        if not notifications:
            self.steps += 1
            return 0
        # A tree with an event that cannot be read or does not verify is held back from there
        # on (that event and every later one of the tree); the other trees are published.
        envelopes: list[Envelope] = []
        found: dict[str, HeldTree] = {}
        passed = 0
        nameless: StoreFailure | None = None
        # This batch's records produced ahead of their notifications (rows restored under a later
        # notification id, produced in their place): taken into ``_ahead`` only once the broker
        # acknowledged the batch. Taken before, a batch that failed would leave them marked as
        # produced, and the next attempt would pass them over for ever (a hole in the tree).
        ahead_here: dict[str, int] = {}
        try:
            self._chain.anchor(notifications)
            for index, notification in enumerate(notifications):
                try:
                    tree_id = _tree_of(notification)
                except (TypeError, ValueError):
                    # No tree to hold back: what came before it is published, then the publisher stops.
                    nameless = nameless_row(f"the event at notification {notification.id}", notification.originator_id)
                    notifications = notifications[:index]
                    break
                tree = str(tree_id)
                if tree in self.held or tree in found:
                    passed += 1
                    continue
                ahead = max(self._ahead.get(tree, 0), ahead_here.get(tree, 0))
                if ahead and isinstance(notification.originator_version, int) and (
                    notification.originator_version <= ahead
                ):
                    continue  # produced already (or in this batch), ahead of its notification
                try:
                    behind = [_verified_envelope(n, self._chain, tree_id) for n in self._behind(tree_id, notification)]
                    envelopes += behind
                    envelopes.append(_verified_envelope(notification, self._chain, tree_id))
                except CorruptStream as exc:
                    found[tree] = self._found(tree_id, notification, exc)
                    passed += 1
                    continue
                if behind:
                    ahead_here[tree] = int(behind[-1]["position"])
            if envelopes:
                self.produce(envelopes)
        except BaseException:
            # The chain check remembers every event of this batch it checked as the last one of
            # its tree, and ``_behind`` takes that for "produced": after a batch that was not
            # acknowledged (or not even read to its end), a row restored behind one of them
            # would never be produced. A new chain reads each tree's previous digest again.
            self._chain = ChainCheck(self.store)
            raise
        for tree, position in ahead_here.items():
            self._ahead[tree] = max(self._ahead.get(tree, 0), position)
        self.batches += 1
        self._crash(self.batches)
        # Before the position: a crash in between finds it again, and a retry after a lost
        # reply to the position write goes on holding it.
        for held in found.values():
            self._held.hold(held)
            self.held[held.tree_id] = held
            self.on_held(held)
        if not notifications:
            assert nameless is not None
            raise nameless
        last = int(notifications[-1].id)
        # Only the lease holder stores a position: one that lost its lease (a PostgreSQL session
        # ended, the lease file replaced) stops here, before it writes over the new holder's.
        self._lease.keep()
        try:
            self._position.save(last)
        except IntegrityError:
            # A retried write whose first attempt committed (its reply was lost) finds exactly
            # its own position stored: that is success. Anything else means someone stored a
            # position at or past ours: another publisher.
            if self._position.get() != last:
                self._lease.keep()  # feed.position_conflict when this publisher lost the lease meanwhile
                # Still the holder: one that had lost the lease stored positions before it noticed
                # (it stops at its next write). Go on from the stored position, as after a restart.
                log.warning("publisher of %s: another publisher stored position %s past this one's %s (it had "
                            "lost the lease); going on from there", self.topic, self._position.get(), self.position)
                self.start_again()
                return 0
        self.position = last
        self.events += len(envelopes)
        self.held_events += passed
        if nameless is not None:
            raise nameless
        self.steps += 1
        return len(notifications)

    def _behind(self, tree_id: TreeID, notification: Notification) -> list[Notification]:
        """The events of ``tree_id`` before ``notification``'s position that the log holds only
        after it (a row restored by hand, under a new notification id, before the publisher got
        there): produced first, in position order, so that the tree's records never skip one.
        Empty in the usual case, at the cost of one row read for a tree the chain check has not
        seen (it reads that row anyway: its digest is taken from here)."""
        position = notification.originator_version
        if not isinstance(position, int) or position <= 1:
            return []
        last = self._chain.last_position(tree_id)
        if last is None:
            rows = self.store.tree_notifications(tree_id, position - 1, 1)
            if not rows or rows[0].originator_version != position - 1:
                return []  # missing: the chain check says so
            if rows[0].id < notification.id:
                try:
                    self._chain.seed(tree_id, position - 1, unseal(stored_json(rows[0].state)).digest)
                except (SealError, TypeError, ValueError):
                    pass  # the chain check reads it again and says what is wrong
                return []
            last = self.store.tree_position_before(tree_id, int(notification.id))
        if last >= position - 1:
            return []
        rows = self.store.tree_notifications(tree_id, last + 1, position - 1 - last)
        return [r for r in rows if isinstance(r.originator_version, int) and r.originator_version < position]

    def _found(self, tree_id: TreeID, notification: Notification, exc: CorruptStream) -> HeldTree:
        """The hold of a tree whose event at ``notification`` does not verify: from the position
        after the last one published (every event of the tree before this notification was), so
        a missing or moved event is published too once the tree is repaired; never past the
        damage (a version changed by hand must not move it on)."""
        try:
            head = self.store.head(tree_id)
        except (TypeError, ValueError):  # an index row changed by hand: only its start id is lost
            head = None
        held_from = self.store.tree_position_before(tree_id, int(notification.id)) + 1
        held_from = max(1, min(held_from, exc.position))
        if isinstance(notification.originator_version, int):
            held_from = min(held_from, notification.originator_version)
        return HeldTree(str(tree_id), head.start_id if head is not None else None, held_from, int(notification.id),
                        exc.position, exc.rule, str(exc.detail))

    def release_repaired(self, stop: threading.Event | None = None) -> None:
        """Publish the held records of each held tree, in position order, as far as they verify
        again (repaired by hand): a tree that verifies to its end is no longer held; one that
        does not stays held from its first event that does not (``on_still_held``), what came
        before it published. The hold row moves on with each acknowledged page. The records go
        out ahead of the stored position: the main loop passes their notifications over
        (``_ahead``), a restarted publisher produces them again (duplicates). Called as the
        publisher starts (``drain``, ``follow``); once ``stop`` is set it returns after the page
        in progress (the rest goes next time)."""
        for held in list(self.held.values()):
            if stop is not None and stop.is_set():
                return
            published, still = self._release(held, stop)
            if still is None:
                self._held.release(held.tree_id)
                del self.held[held.tree_id]
                self.on_released(held, published)
            elif self.on_still_held is not None and not (stop is not None and stop.is_set()):
                self.on_still_held(still)

    def _release(self, held: HeldTree, stop: threading.Event | None) -> tuple[int, HeldTree | None]:
        """Produce ``held``'s records from ``held_from`` on while they verify, a page at a time,
        moving its hold row on after each; returns how many it produced and the hold that is
        left (None: the tree verified to its end)."""
        tree_id = TreeID(held.tree_id)
        chain = ChainCheck(self.store)
        current = held
        published = 0
        while True:
            page = self.store.tree_notifications(tree_id, current.held_from, self.batch_size)
            if not page:
                missing = self._missing_end(tree_id, current.held_from)
                if missing is None:
                    return published, None
                current = dataclasses.replace(current, position=missing.position, rule=missing.rule,
                                              detail=str(missing.detail))
                if current != self.held[held.tree_id]:
                    self._held.move(current)
                    self.held[held.tree_id] = current
                return published, current
            chain.anchor(page)
            envelopes: list[Envelope] = []
            failure: tuple[Notification, CorruptStream] | None = None
            for notification in page:
                try:
                    envelopes.append(_verified_envelope(notification, chain, tree_id))
                except CorruptStream as exc:
                    failure = (notification, exc)
                    break
            if envelopes:
                self.produce(envelopes)
                published += len(envelopes)
                self.events += len(envelopes)
                self.released_events += len(envelopes)
                last = int(envelopes[-1]["position"])
                self._ahead[held.tree_id] = last
                self._chain.seed(tree_id, last, str(envelopes[-1]["digest"]))
                current = dataclasses.replace(current, held_from=last + 1)
            if failure is not None:
                failed_at, damage = failure
                current = dataclasses.replace(current, found_at=int(failed_at.id), position=damage.position,
                                              rule=damage.rule, detail=str(damage.detail))
            if current != self.held[held.tree_id]:
                self._held.move(current)  # a crash from here on re-sends from its held_from on
                self.held[held.tree_id] = current
            if failure is not None or (stop is not None and stop.is_set()):
                return published, current

    def _missing_end(self, tree_id: TreeID, position: int) -> CorruptStream | None:
        """Whether a held tree that has no event from ``position`` on should have some: its index
        row anchors a later end (its events there were deleted or moved by hand)."""
        anchor = self.store.anchors([tree_id]).get(tree_id)
        if anchor is None or anchor[0] < position:
            return None
        return CorruptStream(tree_id, position, "integrity.missing_event",
                             f"position {position} is missing (the tree index reaches version {anchor[0]})")

    def produce(self, envelopes: Sequence[Envelope]) -> None:
        """Send envelopes and wait until the broker acknowledged every one (else raise FeedError;
        also, retriable, once ``interrupt`` was called)."""
        from kafka.errors import KafkaError

        futures = []
        try:
            for envelope in envelopes:
                value = envelope_bytes(envelope)
                self.bytes += len(value)
                futures.append(
                    self.producer.send(
                        self.topic, value=value, key=str(envelope["tree_id"]).encode(), headers=envelope_headers(envelope)
                    )
                )
            self._flush()
        except KafkaError as exc:  # no metadata in time (broker unreachable), a record too large, no flush in time
            raise FeedError(
                f"the broker did not take the records of topic {self.topic}: {exc}",
                retriable=_retriable(exc),
            ) from exc
        for future in futures:
            try:
                future.get(timeout=self.ack_timeout)
            except Exception as exc:  # any failed send: the batch is not acknowledged
                raise FeedError(
                    f"the broker did not acknowledge a record of topic {self.topic}: {exc}",
                    retriable=_retriable(exc),
                ) from exc

    def _flush(self) -> None:
        """The producer's ``flush(ack_timeout)``, in slices: kafka-python's flush cannot be
        interrupted from another thread, and ``interrupt`` must end it (``FeedError``)."""
        from kafka.errors import KafkaTimeoutError

        deadline = time.monotonic() + self.ack_timeout
        while True:
            try:
                self.producer.flush(timeout=max(min(ACK_SLICE, deadline - time.monotonic()), 0.001))
                return
            except KafkaTimeoutError:
                if self._interrupted.is_set():
                    raise FeedError(f"stopped waiting for the broker to acknowledge records of topic {self.topic}: "
                                    "the publisher was interrupted") from None
                if time.monotonic() >= deadline:
                    raise

    # -- loops -----------------------------------------------------------------

    def drain(self, stop: threading.Event | None = None) -> PublishReport:
        """Publish everything committed so far, then return (``--once``). Once ``stop`` is set,
        return after the batch in progress (acknowledged, its position stored), drained or not."""
        before = self.events
        self.release_repaired(stop)
        while stop is None or not stop.is_set():
            count = self.step()
            if count < self.batch_size and self.position >= self.store.max_notification_id():
                break
        return PublishReport(self.events - before, self.position)

    def follow(self, stop: threading.Event, on_batch: Callable[[int], None] | None = None) -> PublishReport:
        """Publish new events as they are committed, until ``stop`` is set (then return cleanly)."""
        from agentfold.adapters.follower import NewEvents

        before = self.events
        if stop.is_set():
            return PublishReport(0, self.position)  # not even a LISTEN session: stopping must not wait
        waiter = NewEvents(self.store, self.poll_interval)
        try:
            self.release_repaired(stop)
            while not stop.is_set():
                count = self.step()
                if count:
                    if on_batch is not None:
                        on_batch(count)
                    continue
                waiter.wait(stop)
        finally:
            waiter.close()
        return PublishReport(self.events - before, self.position)

    def follow_until_stopped(
        self, stop: threading.Event, say: Callable[[str], None], *, backoff: float = 0.5, max_backoff: float = 30.0
    ) -> PublishReport:
        """``follow`` until ``stop`` is set, through the failures ``publish_failed`` accepts.

        Each failure is one line (``say``), then a wait (``retry_until_stopped``: doubling from
        ``backoff`` up to ``max_backoff`` while the attempts make no progress, back to ``backoff``
        after an attempt in which a step succeeded); the next attempt reads the stored position and
        holds again (the store may hold a later position than this object, if the reply to a
        position write was lost) and goes on from there as a new publisher would (``start_again``),
        so at most the batch whose position was not stored is produced again (and what a release
        or a restored row put ahead of its notification, as after a restart). After a broker failure it also starts a new producer: the old one's
        session (pending records, idempotence sequence numbers) may mean nothing to a restarted
        broker, and kafka-python does not always recover from that by itself. Anything else is
        raised.
        """
        from agentfold.adapters.follower import retry_until_stopped

        before, failed_before = self.events, self.failures
        again = False

        def attempt() -> None:
            nonlocal again
            if again:
                if self.producer is None and self._bootstrap is not None:
                    self.producer = self._new_producer()
                self.start_again()
                say(f"following again from position {self.position}")
            again = True
            try:
                self.follow(stop)
            except FeedError:
                if self._bootstrap is not None:
                    producer, self.producer = self.producer, None
                    discard_producer(producer)
                raise

        def failed() -> None:
            self.failures += 1  # as it happens: the report at the last resort shows it

        # Progress (the wait back to ``backoff``): a step that ended without an error, not
        # time: during an outage each attempt may wait long for the store or the broker.
        retry_until_stopped(
            attempt, stop, say, retryable=publish_failed, backoff=backoff, max_backoff=max_backoff, on_failure=failed,
            progress=lambda: self.steps, renew=self.store.forget_sessions, recheck=self.store.check_sessions,
        )
        return PublishReport(self.events - before, self.position, self.failures - failed_before)

    def start_again(self) -> None:
        """Go on from what the store holds, as a new publisher would (each attempt of
        ``follow_until_stopped``): the stored position and holds, and nothing this object
        remembers of what it produced. Not what it took as produced ahead of their notifications
        (``_ahead``: a release's records, rows restored under a later notification id), nor the
        chain check's last event per tree, which ``_behind`` takes as produced: the chain check's
        may come from a batch the broker did not acknowledge (``_ahead`` is only added to once
        the broker acknowledged, so forgetting it is a second line of defence: a mutation audit
        found keeping it changes nothing observable today). Forgetting them costs at most
        duplicates (those records produced again, as after a restart); keeping an unacknowledged
        one lost the events it named for good."""
        self._lease.keep()  # lost with a PostgreSQL session: taken again, unless another publisher has it
        self.position = self._position.get()
        self.held = self._held.all()  # as stored: the holds go with the position
        self._ahead = {}
        self._chain = ChainCheck(self.store)

    def interrupt(self) -> None:
        """End a wait for acknowledgements now (``FeedError``, retriable) and drop what is
        pending at ``close``, for a publisher that stops (``agentfold.adapters.follower.StopGuard``): the
        batch is not recorded as published, and is produced again by the next run. Safe from
        any thread."""
        self._interrupted.set()

    def close(self) -> None:
        """Flush and close the producer. Records the broker still has not taken after
        ``ack_timeout`` (a failed batch, never recorded as published) are dropped: stopping
        during a broker outage ends cleanly. Once interrupted, they are dropped at once."""
        try:
            self._close_producer()
        finally:
            self._lease.close()

    def _close_producer(self) -> None:
        from kafka.errors import KafkaError

        if self.producer is None:
            return
        if self._interrupted.is_set():
            discard_producer(self.producer)
            return
        try:
            self._flush()
            self.producer.close(timeout=5)
        except (KafkaError, FeedError):
            discard_producer(self.producer)


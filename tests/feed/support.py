"""Shared helpers for the feed tests: the documented envelope schema, an independent reader."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.feed import envelope_bytes, store_envelopes
from agentfold.adapters.transcripts import TranscriptConsumer, TranscriptStore
from agentfold.domain.canonical import canonical_bytes
from agentfold.domain.integrity import chain_digest

ROOT = Path(__file__).resolve().parents[2]
KAFKA_DOC = ROOT / "docs" / "kafka.md"


def documented_envelope_schema() -> dict[str, Any]:
    """The JSON Schema block of docs/kafka.md (between the envelope-schema markers)."""
    text = KAFKA_DOC.read_text()
    found = re.search(r"<!-- envelope-schema:begin -->\s*```json\n(.*?)```\s*<!-- envelope-schema:end -->", text, re.S)
    assert found, "docs/kafka.md has no envelope schema block"
    schema: dict[str, Any] = json.loads(found.group(1))
    return schema


@dataclass(slots=True)
class ReadRecord:
    partition: int
    offset: int
    key: bytes
    headers: dict[str, bytes]
    envelope: dict[str, Any]


@dataclass(slots=True)
class TopicRead:
    records: list[ReadRecord] = field(default_factory=list)

    def notification_ids(self) -> list[int]:
        return [r.envelope["notification_id"] for r in self.records]

    def by_partition(self) -> dict[int, list[ReadRecord]]:
        out: dict[int, list[ReadRecord]] = defaultdict(list)
        for r in self.records:
            out[r.partition].append(r)
        for records in out.values():
            records.sort(key=lambda r: r.offset)
        return out

    def envelopes_in_partition_order(self) -> list[dict[str, Any]]:
        """Every envelope, partition by partition, each in offset order (per-tree order kept)."""
        return [r.envelope for records in self.by_partition().values() for r in records]


def read_topic_confluent(bootstrap: str, topic: str, *, expected: int, timeout: float = 60.0) -> TopicRead:
    """Read a whole topic with confluent-kafka (librdkafka): a client independent of the publisher's.

    Partitions are assigned explicitly from the beginning (no group join, no end offsets:
    the test broker gets those wrong); reading stops once ``expected`` records arrived and
    one more second brought nothing (so extra duplicates would be seen too).
    """
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"independent-{uuid.uuid4()}",
        "enable.auto.commit": False, "auto.offset.reset": "earliest",
    })
    out = TopicRead()
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        partitions = sorted(metadata.topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        deadline = time.monotonic() + timeout
        quiet_since: float | None = None
        while time.monotonic() < deadline:
            messages = consumer.consume(num_messages=1000, timeout=0.5)
            for m in messages:
                assert m.error() is None, m.error()
                out.records.append(ReadRecord(
                    m.partition(), m.offset(), m.key(), {k: v for k, v in (m.headers() or [])}, json.loads(m.value()),
                ))
            if len(out.records) >= expected:
                if messages:
                    quiet_since = None
                elif quiet_since is None:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > 1.0:
                    break
        return out
    finally:
        consumer.close()


def envelope_digest(e: dict[str, Any], previous: str | None) -> str:
    """The digest an envelope's own members give after ``previous``, as kafka.md tells a consumer
    to compute it (independently of agentfold's code)."""
    content = canonical_bytes({"event": e["payload"], "timestamp": e["timestamp"]})
    tag = e["type"] if e["schema_version"] == 1 else f"{e['type']}@{e['schema_version']}"
    return chain_digest(previous, e["tree_id"], e["position"], tag, content)


def verify_chain(envelopes: Iterable[dict[str, Any]]) -> int:
    """Recompute every tree's digest chain from the envelopes alone; returns the trees verified."""
    previous: dict[str, str] = {}
    for e in envelopes:
        digest = envelope_digest(e, previous.get(e["tree_id"]))
        assert digest == e["digest"], f"{e['tree_id']} position {e['position']}: the payload is not the stored body"
        previous[e["tree_id"]] = e["digest"]
    return len(previous)


def stored_envelopes(url: str) -> list[dict[str, Any]]:
    """Every envelope the publisher would produce from the store at ``url``, in log order."""
    from agentfold.adapters.eventstore import EventStore
    from agentfold.adapters.feed import store_envelopes

    store = EventStore(url)
    try:
        return list(store_envelopes(store))
    finally:
        store.close()


def follow_until(publisher: Any, done: Callable[[], bool], timeout: float = 60.0) -> list[str]:
    """Run ``publisher.follow_until_stopped`` on a thread until ``done()`` (asserted within
    ``timeout`` seconds), then stop it and close the publisher and its store; the lines it said."""
    stop = threading.Event()
    lines: list[str] = []
    follower = threading.Thread(target=publisher.follow_until_stopped, args=(stop, lines.append), daemon=True)
    follower.start()
    try:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, lines
            time.sleep(0.05)
    finally:
        stop.set()
        follower.join(30)
        publisher.close()
        publisher.store.close()
    return lines


@dataclass(frozen=True, slots=True)
class FakeRecord:
    topic: str
    partition: int
    offset: int
    value: bytes


class FakeTopic:
    """A stand-in for kafka-python's consumer: one partition, polled in order, commits counted
    (the consumer's records then come through its own path, ``TranscriptConsumer.poll_once``)."""

    def __init__(self) -> None:
        self.records: list[FakeRecord] = []
        self.at = 0
        self.commits = 0

    def write(self, *envelopes: dict[str, Any]) -> None:
        for e in envelopes:
            self.records.append(FakeRecord("t", 0, len(self.records), envelope_bytes(e)))

    def poll(self, timeout_ms: int, max_records: int) -> dict[Any, list[FakeRecord]]:
        batch = self.records[self.at : self.at + max_records]
        self.at += len(batch)
        return {("t", 0): batch} if batch else {}

    def commit(self) -> None:
        self.commits += 1

    def assignment(self) -> set[Any]:
        return {("t", 0)}

    def close(self, autocommit: bool = False) -> None:
        pass


def fake_topic_consumer(tmp_path: Path, max_records: int = 1000) -> tuple[TranscriptStore, TranscriptConsumer, FakeTopic]:
    """A transcript consumer on a fresh SQLite transcript database, reading a ``FakeTopic``."""
    store = TranscriptStore(f"sqlite:///{tmp_path / 'transcripts.db'}")
    topic = FakeTopic()
    return store, TranscriptConsumer(store, "unused:1", "t", "g", consumer=topic, max_records=max_records), topic


def trip_envelopes(folder: Path) -> tuple[str, list[dict[str, Any]]]:
    """The root process id and the envelopes (in position order) of one trip run's tree, run
    on an SQLite store in ``folder``."""
    from tests.feed.workload import Workload

    store = EventStore(f"sqlite:///{folder / 'store.db'}")
    workload = Workload(store)
    try:
        run = workload.run(0, "trip")
        envelopes = [e for e in store_envelopes(store) if e["tree_id"] == str(run.tree_id)]
    finally:
        workload.close()
        store.close()
    return run.root_process_id, envelopes


def two_tree_envelopes(folder: Path) -> list[list[dict[str, Any]]]:
    """The envelopes of two runs' trees (run on an SQLite store in ``folder``), each tree's in
    position order."""
    from tests.test_feed_reconnects import _runs

    url = f"sqlite:///{folder / 'store.db'}"
    _runs(url, 2)
    by_tree: dict[str, list[dict[str, Any]]] = {}
    for e in stored_envelopes(url):
        by_tree.setdefault(e["tree_id"], []).append(e)
    return list(by_tree.values())[:2]

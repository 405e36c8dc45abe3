"""The Kafka feed against a real broker (issue 5 acceptance 1-4).

The broker is the one scripts/test starts (``kafka_bootstrap``; during development:
``eval "$(scripts/kafka-throwaway start)"``). Runs are real Interactions on a real SQLite
store; crashes are real process deaths (``os._exit`` through the crash hooks, in
subprocesses). Each test uses its own topic and consumer group (the test broker's group
bugs: docs/kafka.md "The test broker").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.feed import Publisher, PublisherPosition, store_envelopes
from agentfold.adapters.transcripts import TranscriptStore, consume_all, transcripts_from_store
from agentfold.domain.json_schema import schema_errors
from agentfold.projections.transcripts import build_transcripts
from tests import forked_cli
from tests.feed.support import ROOT, TopicRead, documented_envelope_schema, read_topic_confluent, verify_chain
from tests.feed.workload import Run, Workload

RUNS = 200
CRASH_EXIT = 75


@dataclass(frozen=True)
class Feed:
    store_url: str
    topic: str
    runs: list[Run]
    notification_ids: list[int]
    versions: dict[str, int]


def _agentfold(*args: str, env: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return forked_cli.run(list(args), cwd=ROOT, timeout=timeout, env={**os.environ, **(env or {})})


def _store_facts(url: str) -> tuple[list[int], dict[str, int]]:
    store = EventStore(url)
    try:
        ids = [e["notification_id"] for e in store_envelopes(store)]
        versions = {h.tree_id: h.version for h in store.heads()}
        return ids, versions
    finally:
        store.close()


def _store_transcripts(url: str) -> dict[str, dict[str, Any]]:
    store = EventStore(url)
    try:
        return transcripts_from_store(store)
    finally:
        store.close()


@pytest.fixture(scope="module")
def feed(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Feed:
    """200 runs (tool rounds, input waits, steering, Delegates, unknown outcomes) published once."""
    url = f"sqlite:///{tmp_path_factory.mktemp('feed') / 'store.db'}"
    store = EventStore(url)
    workload = Workload(store)
    try:
        runs = workload.runs(RUNS)
    finally:
        workload.close()
    topic = f"feed-{uuid.uuid4().hex[:12]}"
    publisher = Publisher(store, kafka_bootstrap, topic, partitions=3)
    try:
        report = publisher.drain()
    finally:
        publisher.close()
        store.close()
    ids, versions = _store_facts(url)
    assert report.events == len(ids) and report.position == ids[-1]
    return Feed(url, topic, runs, ids, versions)


@pytest.fixture(scope="module")
def topic_read(feed: Feed, kafka_bootstrap: str) -> TopicRead:
    return read_topic_confluent(kafka_bootstrap, feed.topic, expected=len(feed.notification_ids))


# ---------------------------------------------------------------------------
# Acceptance 1


MEMBER_TYPES = {
    "notification_id": int, "tree_id": str, "position": int, "process_id": str, "type": str,
    "schema_version": int, "timestamp": str, "payload": dict, "digest": str,
}


def test_every_event_of_200_runs_reaches_an_independent_consumer_valid_in_tree_order_without_gaps(
    feed: Feed, topic_read: TopicRead
) -> None:
    records = topic_read.records
    schema = documented_envelope_schema()
    for r in records:
        e = r.envelope
        assert set(e) == set(MEMBER_TYPES), sorted(e)
        for name, kind in MEMBER_TYPES.items():
            assert isinstance(e[name], kind) and not isinstance(e[name], bool), (name, e[name])
        assert schema_errors(e, schema) == [], e
        assert r.key == e["tree_id"].encode()
        assert r.headers == {
            "type": e["type"].encode(), "notification_id": str(e["notification_id"]).encode(),
            "schema_version": str(e["schema_version"]).encode(),
        }
        assert e["process_id"] == e["payload"]["process_id"]

    # Every stored event exactly once (a clean publication duplicates nothing).
    assert len(records) == len(feed.notification_ids)
    assert sorted(topic_read.notification_ids()) == feed.notification_ids
    assert feed.notification_ids == list(range(1, len(feed.notification_ids) + 1))  # contiguous in this store

    # Per tree: one partition, positions 1..version in order; per partition: ids increase.
    partitions = topic_read.by_partition()
    assert len(partitions) > 1
    tree_partition: dict[str, int] = {}
    positions: dict[str, list[int]] = {}
    for partition, items in partitions.items():
        ids = [r.envelope["notification_id"] for r in items]
        assert ids == sorted(ids)
        for r in items:
            tree = r.envelope["tree_id"]
            assert tree_partition.setdefault(tree, partition) == partition
            positions.setdefault(tree, []).append(r.envelope["position"])
    assert len(positions) == RUNS
    for tree, seen in positions.items():
        assert seen == list(range(1, feed.versions[tree] + 1)), tree

    # The payloads are the stored bodies: every tree's digest chain verifies from the topic alone.
    assert verify_chain(topic_read.envelopes_in_partition_order()) == RUNS

    # The runs really had tool rounds, input waits, steering and host resolutions.
    shapes = Counter(run.shape for run in feed.runs)
    envelopes = [r.envelope for r in records]
    steering = [e for e in envelopes if e["type"] == "SignalAdmitted" and "steer" in e["payload"].get("payload", {})]
    answers = [e for e in envelopes if e["type"] == "SignalAdmitted" and e["payload"].get("wait_id")]
    tool_settlements = [e for e in envelopes if e["type"] == "EffectSettled" and "tool_result" in json.dumps(e["payload"])]
    assert len(steering) == shapes["trip"] + shapes["unknown"]
    assert len(answers) == shapes["trip"]
    assert sum(1 for e in envelopes if e["type"] == "EffectResolved") == shapes["unknown"]
    assert len(tool_settlements) >= 3 * shapes["trip"] + shapes["delegate"]


# ---------------------------------------------------------------------------
# Acceptance 4


def test_transcripts_built_from_the_topic_equal_transcripts_built_from_the_store_for_every_run(
    feed: Feed, topic_read: TopicRead, kafka_bootstrap: str, tmp_path: Path
) -> None:
    expected = _store_transcripts(feed.store_url)
    assert all(run.root_process_id in expected for run in feed.runs)
    # The independent client's envelopes, through the pure builder.
    assert build_transcripts(topic_read.envelopes_in_partition_order()) == expected
    # The transcript consumer (consumer group, manual commits) into its own database.
    db = TranscriptStore(f"sqlite:///{tmp_path / 'transcripts.db'}")
    try:
        report = consume_all(db, kafka_bootstrap, feed.topic, f"g-{uuid.uuid4().hex}",
                             expected_events=len(feed.notification_ids))
        assert (report.totals.applied, report.totals.duplicates, report.totals.rejected) == (
            len(feed.notification_ids), 0, 0)
        built = db.transcripts()
        for run in feed.runs:
            assert db.transcript(run.root_process_id) == expected[run.root_process_id], run
        assert built == expected
    finally:
        db.close()


# ---------------------------------------------------------------------------
# Acceptance 3


def test_a_transcript_consumer_killed_between_its_db_commit_and_its_offset_commit_loses_and_duplicates_nothing(
    feed: Feed, kafka_bootstrap: str, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'transcripts.db'}"
    group, member = f"g-{uuid.uuid4().hex}", f"m-{uuid.uuid4().hex[:8]}"
    common = ["transcripts", "--bootstrap", kafka_bootstrap, "--topic", feed.topic, "--group", group, "--db", db,
              "--group-instance-id", member, "--max-records", "500", "--json"]
    crashed = _agentfold(*common, "--idle-exit", "5", env={"AGENTFOLD_TRANSCRIPTS_CRASH": "after-db-commit:3"})
    assert crashed.returncode == CRASH_EXIT, crashed.stderr
    store = TranscriptStore(db)
    try:
        held = store.events_applied()
        assert 0 < held <= 1500  # three batches were committed to the database, the third one's offsets were not
    finally:
        store.close()

    restarted = _agentfold(*common, "--once")
    assert restarted.returncode == 0, restarted.stderr
    report = json.loads(restarted.stdout)
    # The third batch came again and was skipped as duplicates; the rest was applied once.
    assert 1 <= report["duplicates"] <= 500
    assert report["applied"] == len(feed.notification_ids) - held

    store = TranscriptStore(db)
    try:
        assert store.events_applied() == len(feed.notification_ids)
        built = store.transcripts()
        assert built == _store_transcripts(feed.store_url)
        for t in built.values():
            assert [e["seq"] for e in t["entries"]] == list(range(1, t["entry_count"] + 1))
    finally:
        store.close()


# ---------------------------------------------------------------------------
# Acceptance 2


def test_a_publisher_killed_after_producing_before_storing_its_position_resends_only_that_window(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = EventStore(url)
    workload = Workload(store)
    try:
        workload.runs(30)
        topic = f"crash-{uuid.uuid4().hex[:12]}"
        publish = ["--store", url, "publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--batch-size", "200",
                   "--json"]

        crashed = _agentfold(*publish, "--once", env={"AGENTFOLD_PUBLISHER_CRASH": "after-produce:3"})
        assert crashed.returncode == CRASH_EXIT, crashed.stderr
        position = PublisherPosition(store, topic)
        assert position.get() == 400  # batches 1-2 stored; batch 3 (401-600) acknowledged but not stored

        # Restart following; more runs arrive meanwhile; SIGTERM ends it cleanly.
        follower = subprocess.Popen(
            [sys.executable, "-m", "agentfold.adapters.cli", *publish], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )
        try:
            for index in range(30, 36):
                workload.run(index)
            deadline = time.monotonic() + 30
            while position.get() < store.max_notification_id():
                assert follower.poll() is None, follower.stderr.read() if follower.stderr else ""
                assert time.monotonic() < deadline, "the restarted publisher did not catch up"
                time.sleep(0.05)
            follower.send_signal(signal.SIGTERM)
            out, err = follower.communicate(timeout=30)
        finally:
            if follower.poll() is None:
                follower.kill()
        assert follower.returncode == 0, err
        total = store.max_notification_id()
        assert json.loads(out)["events"] == total - 400
    finally:
        workload.close()
        store.close()

    read = read_topic_confluent(kafka_bootstrap, topic, expected=total + 200)
    counts = Counter(read.notification_ids())
    assert sorted(counts) == list(range(1, total + 1))  # no event missing
    assert {n for n, c in counts.items() if c > 1} == set(range(401, 601))  # duplicates: only the unacknowledged window
    assert max(counts.values()) == 2
    # Per tree, first occurrences are still in position order with no gap.
    first_seen: dict[str, list[int]] = {}
    seen: set[int] = set()
    for e in read.envelopes_in_partition_order():
        if e["notification_id"] in seen:
            continue
        seen.add(e["notification_id"])
        first_seen.setdefault(e["tree_id"], []).append(e["position"])
    assert all(p == list(range(1, len(p) + 1)) for p in first_seen.values())

    # A record that is not an envelope (another producer's mistake) is set aside, not applied.
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    producer.send(topic, key=b"tree:" + b"f" * 32, value=b'{"not": "an envelope"}').get(timeout=30)
    producer.close()

    # The transcript consumer's output is unchanged by the duplicates.
    db = TranscriptStore(f"sqlite:///{tmp_path / 'transcripts.db'}")
    try:
        report = consume_all(db, kafka_bootstrap, topic, f"g-{uuid.uuid4().hex}", expected_events=total, settle=1.0)
        assert (report.totals.applied, report.totals.duplicates, report.totals.rejected) == (total, 200, 1)
        assert db.transcripts() == _store_transcripts(url)
        (rejected,) = db.rejects()
        assert "envelope members" in rejected["error"]
    finally:
        db.close()
    assert build_transcripts(read.envelopes_in_partition_order()) == _store_transcripts(url)


def test_a_publisher_on_a_postgresql_store_keeps_its_position_there_and_follows_new_appends(
    kafka_bootstrap: str, pg_database: str
) -> None:
    store = EventStore(pg_database)
    workload = Workload(store)
    topic = f"pg-{uuid.uuid4().hex[:12]}"
    publisher = Publisher(store, kafka_bootstrap, topic, batch_size=100)
    stop = threading.Event()
    follower = threading.Thread(target=publisher.follow, args=(stop,))
    try:
        workload.runs(3)
        follower.start()
        for index in range(3, 6):  # appended while the publisher follows (LISTEN/NOTIFY)
            workload.run(index)
        deadline = time.monotonic() + 20
        while publisher.position < store.max_notification_id():
            assert follower.is_alive() and time.monotonic() < deadline
            time.sleep(0.02)
        stop.set()
        follower.join(10)
        assert not follower.is_alive()
        total = store.max_notification_id()
        assert PublisherPosition(store, topic).get() == total  # stored in the store's own database
        ids = [e["notification_id"] for e in store_envelopes(store)]
    finally:
        stop.set()
        publisher.close()
        workload.close()
        store.close()
    read = read_topic_confluent(kafka_bootstrap, topic, expected=len(ids))
    assert sorted(read.notification_ids()) == ids
    assert build_transcripts(read.envelopes_in_partition_order()) == _store_transcripts(pg_database)

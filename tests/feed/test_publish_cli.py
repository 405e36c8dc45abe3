"""`agentfold publish` as a real subprocess: following a PostgreSQL store through LISTEN/NOTIFY,
and `--partitions` for the topic it creates.

Real Interactions are appended by an in-process Runtime (tests/feed/workload.py) while the
publisher runs in its own process; the topic is read back with confluent-kafka (an
independent client, explicit assignment from the beginning, no end offsets: the test
broker gets those wrong). Each test uses its own topic.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.feed import Publisher, PublisherPosition, store_envelopes
from agentfold.adapters.follower import Follower
from agentfold.domain.errors import InvalidInput
from tests.feed.support import ROOT, read_topic_confluent
from tests.feed.workload import Workload
from tests.test_cli import agentfold, ok, refused


def _wait_until(condition: Callable[[], bool], seconds: float, process: subprocess.Popen[str], what: str) -> float:
    """Wait for ``condition`` while ``process`` stays alive; returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        assert process.poll() is None, f"the publisher exited early: {process.communicate()[1]}"
        assert time.monotonic() - started < seconds, f"{what} within {seconds} s"
        time.sleep(0.02)
    return time.monotonic() - started


def _listening(url: str) -> bool:
    """Some session of this database waits for notifications (the publisher's LISTEN)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query ILIKE 'LISTEN%'"
        ).fetchone()
    return row is not None and row[0] >= 1


def _partition_count(bootstrap: str, topic: str) -> int:
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="test-describe")
    try:
        (described,) = admin.describe_topics([topic])
        assert described["error_code"] == 0, described
        return len(described["partitions"])
    finally:
        admin.close()


def test_a_following_publisher_on_postgresql_is_woken_by_notify_and_exits_cleanly_on_sigterm(
    kafka_bootstrap: str, pg_database: str
) -> None:
    url = pg_database
    topic = f"notify-{uuid.uuid4().hex[:12]}"
    publish = ["--store", url, "publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--json"]
    store = EventStore(url)
    workload = Workload(store)
    try:
        workload.runs(2)
        drained = ok(agentfold(*publish[2:], "--once", store=url)).json()  # the topic and the position exist now
        before = store.max_notification_id()
        assert drained["position"] == before
        position = PublisherPosition(store, topic)

        # The safety-net re-check comes only every 10 x 100 s: anything published within
        # seconds of its append was woken by NOTIFY.
        follower = subprocess.Popen(
            [sys.executable, "-m", "agentfold.adapters.cli", *publish, "--poll-interval", "100"], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            # Let it start and LISTEN (its catch-up found nothing new): Python's start-up alone can
            # take seconds on a loaded machine, and that is not the wake-up this test measures.
            _wait_until(lambda: _listening(url), 60, follower, "the publisher's LISTEN session")
            assert follower.poll() is None, follower.communicate()[1]
            assert position.get() == before
            for index in range(2, 5):
                run = workload.run(index)
                appended = store.max_notification_id()
                _wait_until(lambda n=appended: position.get() >= n, 5.0, follower,  # type: ignore[misc]
                            f"run {index} ({run.tree_id}) was not published")
            total = store.max_notification_id()
            follower.send_signal(signal.SIGTERM)
            out, err = follower.communicate(timeout=20)  # not 1000 s: SIGTERM ends the wait
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.communicate()
        assert follower.returncode == 0, err
        report = json.loads(out)
        assert (report["from_position"], report["position"], report["events"]) == (before, total, total - before)
        assert position.get() == total
        ids = [e["notification_id"] for e in store_envelopes(store)]
        new_trees = {e["tree_id"] for e in store_envelopes(store, after=before)}
    finally:
        workload.close()
        store.close()
    assert len(new_trees) == 3
    read = read_topic_confluent(kafka_bootstrap, topic, expected=len(ids))
    assert sorted(read.notification_ids()) == ids  # every event exactly once, the followed ones included
    assert new_trees <= {e["tree_id"] for e in read.envelopes_in_partition_order()}


def test_publish_creates_a_missing_topic_with_the_requested_partitions_and_keeps_each_tree_in_one(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    topic = f"parts-{uuid.uuid4().hex[:12]}"
    store = EventStore(url)
    workload = Workload(store)
    try:
        workload.runs(12)
        first = ok(agentfold("publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--partitions", "5",
                             "--once", "--json", store=url)).json()
        assert _partition_count(kafka_bootstrap, topic) == 5
        # An existing topic is used as it is: a different --partitions does not change it.
        workload.run(12)
        second = ok(agentfold("publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--partitions", "2",
                              "--once", "--json", store=url)).json()
        assert _partition_count(kafka_bootstrap, topic) == 5
        total = store.max_notification_id()
        ids = [e["notification_id"] for e in store_envelopes(store)]
        versions = {h.tree_id: h.version for h in store.heads()}
    finally:
        workload.close()
        store.close()
    assert (first["from_position"], second["position"], first["events"] + second["events"]) == (0, total, total)

    read = read_topic_confluent(kafka_bootstrap, topic, expected=total)
    assert sorted(read.notification_ids()) == ids
    tree_partition: dict[str, int] = {}
    positions: dict[str, list[int]] = {}
    for partition, records in read.by_partition().items():
        assert 0 <= partition < 5
        for r in records:
            tree = r.envelope["tree_id"]
            assert tree_partition.setdefault(tree, partition) == partition, f"{tree} is split over partitions"
            positions.setdefault(tree, []).append(r.envelope["position"])
    assert len(tree_partition) == 13
    assert len(set(tree_partition.values())) > 1  # the trees are spread, each kept whole
    for tree, seen in positions.items():
        assert seen == list(range(1, versions[tree] + 1)), tree


# 1e-300 spun a core polling; 1e300 overflowed a wait once following (cli.internal).
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon", "1e-300", "0.0009", "1e300"])
def test_publish_refuses_a_poll_interval_that_is_not_a_positive_number_of_seconds(tmp_path: Path, value: str) -> None:
    # Refused while parsing: no store is opened (this one does not exist) and no broker is contacted.
    ran = refused(agentfold("publish", "--bootstrap", "127.0.0.1:9", "--topic", "t", "--poll-interval", value,
                            "--json", store=f"sqlite:///{tmp_path / 'missing.db'}"))
    error = ran.error()
    assert error["code"] == "cli.usage" and "--poll-interval" in error["message"], error


def test_the_publisher_api_refuses_a_poll_interval_that_is_not_positive(tmp_path: Path) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        for value in (0.0, -1.0, float("nan"), float("inf"), 1e300, True, "1"):
            with pytest.raises(InvalidInput) as refused_value:  # before any broker is contacted
                Publisher(store, "127.0.0.1:9", "t", poll_interval=value)  # type: ignore[arg-type]
            assert refused_value.value.code == "feed.poll_interval_invalid"
            # The read-model follower's, which took inf and 1e300 (they overflowed a wait once it followed).
            with pytest.raises(InvalidInput) as refused_value:
                Follower(store, poll_interval=value)  # type: ignore[arg-type]
            assert refused_value.value.code == "projection.poll_interval_invalid"
    finally:
        store.close()


BAD_TOPICS = ["", "orders/feed", "..", "a" * 250, "caf\u00e9"]


@pytest.mark.parametrize("topic", BAD_TOPICS)
def test_a_topic_name_kafka_does_not_take_is_refused_before_anything_is_stored(tmp_path: Path, topic: str) -> None:
    # Found by a feed review: `publish --topic ''` (or 'orders/feed') exited 0 and stored a publisher
    # position for a topic no consumer could read; `transcripts` then failed with cli.internal
    # ("ValueError: All topics must be non-empty strings").
    url = f"sqlite:///{tmp_path / 'store.db'}"
    EventStore(url).close()  # a store that exists: the refusal is the topic's, not the store's
    before = (tmp_path / "store.db").read_bytes()
    for command in (["publish", "--once"], ["transcripts", "--group", "g", "--db", f"sqlite:///{tmp_path / 't.db'}", "--once"]):
        ran = refused(agentfold(command[0], "--bootstrap", "127.0.0.1:9", "--topic", topic, *command[1:], "--json",
                                store=url))
        error = ran.error()
        assert error["code"] == "cli.usage" and "is not a Kafka topic name" in error["message"], error
    assert (tmp_path / "store.db").read_bytes() == before and not (tmp_path / "t.db").exists()
    store = EventStore(url)
    try:
        with pytest.raises(InvalidInput) as refused_topic:  # the Python API, before any broker is contacted
            Publisher(store, "127.0.0.1:9", topic)
        assert refused_topic.value.code == "feed.topic_invalid"
        assert PublisherPosition(store, "t").get() == 0
    finally:
        store.close()


def _topic_exists(bootstrap: str, topic: str) -> bool:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, client_id="test-topics")
    try:
        return topic in consumer.topics()
    finally:
        consumer.close()


def test_transcripts_on_a_topic_that_does_not_exist_fails_at_once_and_creates_nothing(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    # An audit found `transcripts --topic <typo> --once` exit 0 with nothing read (the broker
    # created the topic on the consumer's metadata request), and without --once wait for ever.
    typo = f"typo-{uuid.uuid4().hex[:12]}"
    began = time.monotonic()
    failed = agentfold("transcripts", "--bootstrap", kafka_bootstrap, "--topic", typo, "--group", "g-typo",
                       "--db", f"sqlite:///{tmp_path / 'transcripts.db'}", "--once", "--json")
    assert failed.code == 1, failed.stderr
    error = json.loads(failed.stderr.strip().splitlines()[-1])["error"]
    assert error["code"] == "feed.unavailable", error
    assert f"the topic '{typo}' does not exist" in error["message"], error
    assert time.monotonic() - began < 30
    assert not _topic_exists(kafka_bootstrap, typo)


@pytest.mark.parametrize("value", ["0", "nan", "1e-300", "0.0009", "1e300"])
def test_project_refuses_a_poll_interval_outside_a_millisecond_to_thirty_days(tmp_path: Path, value: str) -> None:
    # Refused while parsing, before the store is opened (this one does not exist): 1e-300 spun a
    # core polling an idle SQLite store, 1e300 overflowed a wait once it followed (cli.internal).
    ran = refused(agentfold("project", "--follow", "--poll-interval", value, "--json",
                            store=f"sqlite:///{tmp_path / 'missing.db'}"))
    error = ran.error()
    assert error["code"] == "cli.usage" and "from 0.001 up to 2592000" in error["message"], error


class _SilentBroker:
    """A TCP listener that accepts connections and never answers (a wrong port of a live host,
    a firewall that swallows packets after the handshake): nothing refuses, nothing replies."""

    def __init__(self) -> None:
        import socket

        self.server = socket.create_server(("127.0.0.1", 0))
        self.bootstrap = f"127.0.0.1:{self.server.getsockname()[1]}"

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize("broker", ["refusing", "silent"])
@pytest.mark.parametrize("command", ["publish", "transcripts --once", "transcripts"])
def test_an_unreachable_broker_fails_the_feed_commands_after_connect_timeout(
    tmp_path: Path, broker: str, command: str
) -> None:
    # Before --connect-timeout, each waited kafka-python's 30 s bootstrap timeout, untested.
    url = f"sqlite:///{tmp_path / 'store.db'}"
    EventStore(url).close()
    silent = _SilentBroker() if broker == "silent" else None
    bootstrap = silent.bootstrap if silent is not None else "127.0.0.1:9"
    name, *rest = command.split()
    extra = ["--once"] if name == "publish" else ["--group", "g", "--db", f"sqlite:///{tmp_path / 't.db'}", *rest]
    try:
        began = time.monotonic()
        ran = agentfold(name, "--bootstrap", bootstrap, "--topic", "feed", "--connect-timeout", "1", *extra, "--json",
                        store=url, timeout=60)
        took = time.monotonic() - began
    finally:
        if silent is not None:
            silent.close()
    assert ran.code == 1, ran.stderr
    error = json.loads(ran.stderr.strip().splitlines()[-1])["error"]
    assert error["code"] == "feed.unavailable", error
    assert f"cannot reach the broker at {bootstrap} within 1 s (--connect-timeout)" in error["message"], error
    assert took < 15, took  # the default (30 s) would still be waiting


def test_connect_timeout_must_be_a_positive_number_of_seconds(tmp_path: Path) -> None:
    for command in (["publish", "--once"], ["transcripts", "--group", "g", "--db", f"sqlite:///{tmp_path / 't.db'}"]):
        for value in ("0", "-1", "soon"):
            ran = refused(agentfold(command[0], "--bootstrap", "127.0.0.1:9", "--topic", "feed", *command[1:],
                                    "--connect-timeout", value, "--json", store=f"sqlite:///{tmp_path / 'missing.db'}"))
            error = ran.error()
            assert error["code"] == "cli.usage" and "--connect-timeout" in error["message"], error


class _Client:
    """Stands in for a kafka-python client class: records how each instance was built."""

    def __init__(self, built: list[tuple[str, dict[str, object]]], kind: str) -> None:
        self.built, self.kind = built, kind

    def __call__(self, *args: object, **config: object) -> _Client:
        self.built.append((self.kind, config))
        return self

    def create_topics(self, *args: object, **kwargs: object) -> None:
        return None

    def flush(self, *args: object, **kwargs: object) -> None:
        return None

    def close(self, *args: object, **kwargs: object) -> None:
        return None


def test_every_kafka_client_of_the_feed_waits_connect_timeout_for_its_broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The admin client, the producer (at the start and each one made again after a broker
    failure) and the transcripts consumer: each waits ``connect_timeout`` for a first answer."""
    import kafka

    from agentfold.adapters.transcripts import TranscriptConsumer, TranscriptStore

    built: list[tuple[str, dict[str, object]]] = []
    for kind in ("KafkaAdminClient", "KafkaProducer", "KafkaConsumer"):
        monkeypatch.setattr(kafka, kind, _Client(built, kind))
    url = f"sqlite:///{tmp_path / 'store.db'}"
    store = EventStore(url)
    transcripts = TranscriptStore(f"sqlite:///{tmp_path / 't.db'}")
    try:
        publisher = Publisher(store, "127.0.0.1:9", "feed", connect_timeout=2.5)
        try:
            publisher._new_producer()  # what following makes after a broker failure
        finally:
            publisher.close()
        TranscriptConsumer(transcripts, "127.0.0.1:9", "feed", "g", connect_timeout=0.25)
    finally:
        transcripts.close()
        store.close()
    assert [(kind, config["bootstrap_servers"], config["bootstrap_timeout_ms"]) for kind, config in built] == [
        ("KafkaAdminClient", "127.0.0.1:9", 2500),
        ("KafkaProducer", "127.0.0.1:9", 2500),
        ("KafkaProducer", "127.0.0.1:9", 2500),
        ("KafkaConsumer", "127.0.0.1:9", 250),
    ]

"""`agentfold publish` and `agentfold transcripts` (following) outlive a dropped PostgreSQL connection.

Each command runs as a real subprocess against a real PostgreSQL database and the test
broker; the test ends every other session of that database with ``pg_terminate_backend``
(what a server restart or a failover does to a client) while the command runs, appends
more runs, and then checks what a user can observe: the process is still running, it
said so in one line on stderr, every event reached the topic (every transcript entry
reached the tables) exactly once after dedupe, and SIGTERM still ends it with status 0
and a report that counts the failures. Non-retryable conditions (a corrupt stream, a gap
in the feed) still end a following command with its classified error.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.feed import APPLICATION_PREFIX, Publisher, ensure_topic, envelope_bytes, store_envelopes
from agentfold.adapters.transcripts import TranscriptStore, transcripts_from_store
from tests.feed.support import ROOT, read_topic_confluent, stored_envelopes
from tests.feed.workload import Workload


class Command:
    """``python -m agentfold.adapters.cli ARGS`` in a child process, its stderr read line by line."""

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "AGENTFOLD_STORE"}
        env["PYTHONPATH"] = str(ROOT)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agentfold.adapters.cli", *args], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._lines.put(line.rstrip("\n"))

    def _drain(self) -> None:
        while True:
            try:
                self.stderr.append(self._lines.get_nowait())
            except queue.Empty:
                return

    def alive(self) -> bool:
        return self.process.poll() is None

    def expect(self, needle: str, timeout: float) -> str:
        """The first stderr line (not seen before) holding ``needle``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                assert self.alive() or not self._lines.empty(), f"exited {self.process.returncode}: {self.stderr}"
                continue
            self.stderr.append(line)
            if needle in line:
                return line
        raise AssertionError(f"no stderr line with {needle!r} within {timeout} s: {self.stderr}")

    def wait_until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            self._drain()
            assert self.alive(), f"it exited ({self.process.returncode}) before {what}: {self.stderr}"
            assert time.monotonic() < deadline, f"{what} within {timeout} s: {self.stderr}"
            time.sleep(0.05)

    def finish(self, timeout: float) -> tuple[int, str]:
        """Its exit status and stdout once it ended by itself (killed after ``timeout``)."""
        try:
            self.process.wait(timeout=timeout)
        finally:
            if self.alive():
                self.process.kill()
                self.process.wait()
        assert self.process.stdout is not None
        out = self.process.stdout.read()  # only the final report: it fits the pipe
        time.sleep(0.1)  # the reader thread drains stderr
        self._drain()
        return self.process.returncode, out

    def stop(self) -> tuple[int, str]:
        """SIGTERM, then its exit status and stdout."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
        return self.finish(30)

    def ends_unretried_with(self, code: str) -> None:
        """It ends by itself (no retry line), exit 1, its last stderr line the error ``code``."""
        status, _ = self.finish(60)
        assert status == 1, self.stderr
        assert json.loads(self.stderr[-1])["error"]["code"] == code
        assert not [line for line in self.stderr if "following failed" in line]

    def retried_report(self, status: int, out: str) -> dict[str, Any]:
        """The JSON report of a run that ended with exit 0 after ``stop()``, checked to count as
        failures exactly the retry lines it printed (at least one)."""
        assert status == 0, self.stderr
        report: dict[str, Any] = json.loads(out)
        retried = [line for line in self.stderr if "following failed" in line]
        assert report["failures"] == len(retried) >= 1
        return report


def _scalar(url: str, sql: str, params: tuple[Any, ...] = ()) -> int:
    """One number, read on a short-lived connection of its own (never one the kill ends)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(sql, params).fetchone()
    return int(row[0] or 0) if row else 0


def _terminate_other_sessions(url: str) -> int:
    """What a server restart or failover does to every client of the database."""
    return _scalar(
        url,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )


def transcripts_built_from_every_event(store_url: str, db: str, total: int) -> dict[str, Any]:
    """The transcript tables of ``db``, checked: ``total`` events applied, and the transcripts
    exactly those built straight from the store (complete, every entry once, in order)."""
    store = EventStore(store_url)
    try:
        expected = transcripts_from_store(store)
    finally:
        store.close()
    tables = TranscriptStore(db)
    try:
        assert tables.events_applied() == total
        built = tables.transcripts()
    finally:
        tables.close()
    assert built == expected
    return built  # type: ignore[no-any-return]


def _runs(url: str, count: int) -> int:
    """``count`` complete runs appended on a store opened (and closed) for them; the store's last id."""
    store = EventStore(url)
    workload = Workload(store)
    try:
        workload.runs(count)
        return store.max_notification_id()
    finally:
        workload.close()
        store.close()


def _retry_line(line: str, command: str) -> None:
    assert line.startswith(f"agentfold: {command}: following failed: "), line
    assert line.rstrip().split("; retrying in ")[-1] in {"0.5 s", "1 s", "2 s", "4 s", "8 s"}, line


# ---------------------------------------------------------------------------
# The publisher


def test_a_following_publisher_outlives_terminated_postgresql_sessions_and_every_event_reaches_the_topic_once(
    kafka_bootstrap: str, pg_database: str
) -> None:
    url = pg_database
    topic = f"reconnect-{uuid.uuid4().hex[:12]}"
    batch = 3
    first_total = _runs(url, 9)

    def position() -> int:
        try:
            return _scalar(url, "SELECT max(notification_id) FROM agentfold_tracking WHERE application_name = %s",
                           (APPLICATION_PREFIX + topic,))
        except psycopg.errors.UndefinedTable:  # the publisher has not started yet
            return 0

    publisher = Command("--store", url, "publish", "--bootstrap", kafka_bootstrap, "--topic", topic,
                        "--batch-size", str(batch), "--json")
    try:
        # In the middle of the backlog: every session it has is gone, its pool's (which
        # eventsourcing's recorders retry by themselves) and its LISTEN session (which fails
        # once the backlog is published and it waits for new events).
        publisher.wait_until(lambda: position() > 0, 30, "the first batch was published")
        assert _terminate_other_sessions(url) >= 1
        _retry_line(publisher.expect("following failed", 15), "publish")
        publisher.expect("following again from position", 30)

        total = _runs(url, 3)  # after the failure: on a new connection of the store
        assert total > first_total
        publisher.wait_until(lambda: position() == total, 30, f"every event up to {total} was published")
        assert publisher.alive()
    finally:
        status, out = publisher.stop()
    report = publisher.retried_report(status, out)
    assert (report["from_position"], report["position"]) == (0, total)

    store = EventStore(url, create=False)
    try:
        stored = {e["notification_id"]: e for e in store_envelopes(store)}
    finally:
        store.close()
    read = read_topic_confluent(kafka_bootstrap, topic, expected=len(stored))
    ids = read.notification_ids()
    assert sorted(set(ids)) == sorted(stored)  # nothing skipped
    duplicates = len(ids) - len(set(ids))
    # Re-produced only when a failure fell between an acknowledged batch and its position write.
    assert duplicates <= batch * report["failures"], f"{duplicates} duplicate record(s)"
    assert report["events"] == len(stored)  # the JSON counts events whose position was stored, once each
    for r in read.records:  # a re-sent record is the same record
        assert envelope_bytes(r.envelope) == envelope_bytes(stored[r.envelope["notification_id"]])
    for records in read.by_partition().values():  # each tree in position order, a re-sent window after it
        last: dict[str, int] = {}
        for r in records:
            tree, at = r.envelope["tree_id"], r.envelope["position"]
            assert at <= last.get(tree, 0) or at == last.get(tree, 0) + 1, (tree, at, last.get(tree))
            last[tree] = max(at, last.get(tree, 0))


def test_a_corrupt_tree_does_not_stop_a_following_publisher_it_holds_that_tree_back_and_goes_on(
    kafka_bootstrap: str, pg_database: str
) -> None:
    # It used to stop with store.corrupt (exit 1), holding back every other tree's records.
    url = pg_database
    topic = f"corrupt-{uuid.uuid4().hex[:12]}"
    total = _runs(url, 1)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE agentfold_events SET topic = 'not-an-agentfold-topic' WHERE notification_id = %s",
                     (total - 2,))
    application = APPLICATION_PREFIX + topic

    def position() -> int:
        return _scalar(url, "SELECT max(notification_id) FROM agentfold_tracking WHERE application_name = %s",
                       (application,))

    publisher = Command("--store", url, "publish", "--bootstrap", kafka_bootstrap, "--topic", topic,
                        "--batch-size", "5", "--json")
    try:
        line = publisher.expect("is corrupt at position", 60)
        assert line.startswith("agentfold: publish: tree tree:") and "stream.event_type" in line, line
        assert "held back from the topic while the other trees are published" in line
        newer = _runs(url, 2)  # later runs reach the topic while the damaged one stays held
        publisher.wait_until(lambda: position() == newer, 60, f"every event up to {newer} was published")
        assert publisher.alive()
    finally:
        status, out = publisher.stop()
    assert status == 0, publisher.stderr
    assert not [line for line in publisher.stderr if "following failed" in line]
    report = json.loads(out)
    [held] = report["held_trees"]
    assert (held["code"], held["rule"], held["found_at"]) == ("store.corrupt", "stream.event_type", total - 2)
    assert report["held_events"] == 3  # the damaged event and the two after it, all of the same run
    assert report["events"] == newer - 3 and report["position"] == newer

    read = read_topic_confluent(kafka_bootstrap, topic, expected=newer - 3)
    assert sorted(read.notification_ids()) == [i for i in range(1, newer + 1) if i < total - 2 or i > total]

    # A restarted publisher still holds it, and says so once as it starts.
    again = Command("--store", url, "publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--json")
    try:
        line = again.expect("is corrupt at position", 60)
        assert held["tree_id"] in line
        time.sleep(1.0)
    finally:
        status, out = again.stop()
    assert status == 0 and json.loads(out)["held_trees"] == report["held_trees"], again.stderr
    assert len([line for line in again.stderr if "is corrupt at position" in line]) == 1


def test_a_position_write_whose_reply_was_lost_is_not_taken_for_a_second_publisher(
    kafka_bootstrap: str, pg_database: str
) -> None:
    # eventsourcing retries a tracking write whose connection died; when the first attempt had
    # committed, the retry meets the stored position and raises IntegrityError. That is this
    # publisher's own write: it used to stop with feed.position_conflict ("another publisher").
    from eventsourcing.persistence import IntegrityError

    total = _runs(pg_database, 2)
    topic = f"lostpos-{uuid.uuid4().hex[:12]}"
    store = EventStore(pg_database)
    publisher = Publisher(store, kafka_bootstrap, topic, batch_size=5)
    real_save = publisher._position.save
    lost: list[int] = []

    def save_losing_the_reply(notification_id: int) -> None:
        real_save(notification_id)
        if not lost:
            lost.append(notification_id)
            raise IntegrityError("duplicate key value violates unique constraint (the retried write)")

    publisher._position.save = save_losing_the_reply  # type: ignore[method-assign]
    try:
        assert publisher.drain().position == total
    finally:
        publisher.close()
        store.close()
    assert lost == [5]
    # A position another publisher stored past this one's (it had lost the lease, and had not
    # noticed yet): the lease holder goes on from the stored position, as after a restart.
    other_store = EventStore(pg_database)
    other = Publisher(other_store, kafka_bootstrap, topic, batch_size=5)
    try:
        other._position.save(total + 1000)
        other.position = 0
        assert other.step() == 0
        assert other.position == total + 1000
    finally:
        other.close()
        other_store.close()


# ---------------------------------------------------------------------------
# The transcript consumer


def _publish(url: str, bootstrap: str, topic: str) -> int:
    store = EventStore(url)
    publisher = Publisher(store, bootstrap, topic)
    try:
        return publisher.drain().position
    finally:
        publisher.close()
        store.close()


def _applied(db: str) -> int:
    """The distinct events the transcript tables reflect (the sum of the trees' positions)."""
    try:
        return _scalar(db, "SELECT COALESCE(SUM(position), 0) FROM agentfold_transcript_trees")
    except psycopg.errors.UndefinedTable:  # the consumer has not started yet
        return 0


def test_a_following_transcript_consumer_outlives_its_terminated_postgresql_session_without_lost_or_repeated_entries(
    kafka_bootstrap: str, pg_database: str, tmp_path: Path
) -> None:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    db = pg_database  # the transcript tables; the only sessions there are the consumer's
    topic = f"reconnect-{uuid.uuid4().hex[:12]}"
    first = _runs(store_url, 3)
    _publish(store_url, kafka_bootstrap, topic)

    consumer = Command("transcripts", "--bootstrap", kafka_bootstrap, "--topic", topic,
                       "--group", f"g-{uuid.uuid4().hex}", "--group-instance-id", f"m-{uuid.uuid4().hex[:8]}",
                       "--db", db, "--max-records", "25", "--json")
    try:
        consumer.wait_until(lambda: _applied(db) == first, 30, "the first runs were in the tables")
        assert _terminate_other_sessions(db) >= 1
        # Its next batch meets the dead connection: that batch must come again, whole.
        total = _runs(store_url, 3)
        _publish(store_url, kafka_bootstrap, topic)
        _retry_line(consumer.expect("following failed", 15), "transcripts")
        consumer.expect("following again from the committed offsets", 15)
        consumer.wait_until(lambda: _applied(db) == total, 30, f"all {total} events were in the tables")
        time.sleep(0.5)  # nothing more comes (a re-read batch would be skipped, not applied)
        assert consumer.alive()
    finally:
        status, out = consumer.stop()
    report = consumer.retried_report(status, out)
    assert report["applied"] == total  # every event applied once: the failed batch was not half-applied

    built = transcripts_built_from_every_event(store_url, db, total)
    for t in built.values():
        assert [e["seq"] for e in t["entries"]] == list(range(1, t["entry_count"] + 1))


def test_a_gap_in_the_feed_still_stops_a_following_transcript_consumer_with_feed_gap(
    kafka_bootstrap: str, pg_database: str, tmp_path: Path
) -> None:
    from kafka import KafkaProducer

    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    _runs(store_url, 1)
    envelopes = stored_envelopes(store_url)
    topic = f"gap-{uuid.uuid4().hex[:12]}"
    ensure_topic(kafka_bootstrap, topic)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    try:
        for e in envelopes[:3] + envelopes[4:]:  # one tree's position 4 is missing
            producer.send(topic, value=envelope_bytes(e), key=str(e["tree_id"]).encode())
        producer.flush(30)
    finally:
        producer.close()
    consumer = Command("transcripts", "--bootstrap", kafka_bootstrap, "--topic", topic,
                       "--group", f"g-{uuid.uuid4().hex}", "--db", pg_database, "--json")
    consumer.ends_unretried_with("feed.gap")
    assert json.loads(consumer.stderr[-1])["error"]["detail"] == {
        "tree_id": envelopes[3]["tree_id"], "expected": envelopes[3]["position"], "position": envelopes[4]["position"]}


def test_a_record_with_a_nul_byte_is_kept_as_a_reject_in_a_postgresql_transcript_database(
    kafka_bootstrap: str, pg_database: str
) -> None:
    from kafka import KafkaProducer

    topic = f"nul-{uuid.uuid4().hex[:12]}"
    ensure_topic(kafka_bootstrap, topic)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    try:
        producer.send(topic, value=b"\x00not an envelope").get(30)
    finally:
        producer.close()
    consumer = Command("transcripts", "--bootstrap", kafka_bootstrap, "--topic", topic,
                       "--group", f"g-{uuid.uuid4().hex}", "--db", pg_database, "--once", "--json")
    status, out = consumer.finish(60)
    assert status == 0, consumer.stderr
    assert json.loads(out)["rejected"] == 1
    with psycopg.connect(pg_database) as conn:
        (value,) = conn.execute("SELECT value FROM agentfold_transcript_rejects").fetchone() or (None,)
    assert value == "\\u0000not an envelope"


def test_only_connection_failures_are_retried_by_following_commands() -> None:
    # A revoked grant or a dropped table meets every retry again: following commands stop and
    # say why instead of printing a retry line every 30 s for ever.
    from eventsourcing.persistence import OperationalError, ProgrammingError

    from agentfold.adapters.eventstore import CorruptStream
    from agentfold.adapters.follower import store_failed
    from agentfold.domain.errors import StoreFailure

    def wrapped(cause: BaseException, code: str = "store.read_failed") -> StoreFailure:
        failure = StoreFailure(code, f"reading failed: {cause}")
        failure.__cause__ = cause  # as `raise StoreFailure(...) from cause` leaves it
        return failure

    retried = [
        psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
        psycopg.OperationalError("server closed the connection unexpectedly"),
        OperationalError("couldn't get a connection"),
        wrapped(OperationalError("terminating connection")),
        StoreFailure("store.unavailable", "cannot open store"),
        ConnectionRefusedError("refused"),
    ]
    stopped = [
        psycopg.errors.InsufficientPrivilege("permission denied for table agentfold_events"),
        psycopg.errors.UndefinedTable('relation "agentfold_tracking" does not exist'),
        wrapped(ProgrammingError("permission denied")),
        PermissionError("read-only file system"),
        CorruptStream("tree:x", 3, "integrity.digest_chain", "broken"),
        wrapped(CorruptStream("tree:x", 3, "integrity.digest_chain", "broken")),
    ]
    assert [store_failed(e) for e in retried] == [True] * len(retried)
    assert [store_failed(e) for e in stopped] == [False] * len(stopped)

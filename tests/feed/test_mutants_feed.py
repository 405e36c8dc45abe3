"""Tests written by the mutation audit of the Kafka feed and the transcript consumer (session 27).

Each test kills a mutant (a deliberate, plausible bug) that no other test killed, or that only
the slow iptables partition test killed (P1); its docstring names the mutant and the promise of
docs/kafka.md it breaks. Components are real: SQLite stores and transcript databases, the
PostgreSQL server of ``pg_database``, the broker of ``kafka_bootstrap`` and kafka-python's real
producer. Where a test needs a failure that cannot be caused on demand, it is injected into the
real component the way ``test_publisher_retry.py`` does it (one acknowledgement that never
comes), and the consumer's records come through its own path (``TranscriptConsumer.poll_once``)
from a stand-in for kafka-python's consumer, as in ``test_consumer_trust.py``.
"""

from __future__ import annotations

import copy
import threading
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.feed import (
    FeedError,
    Publisher,
    PublisherPosition,
    new_producer,
    producer_config,
)
from agentfold.adapters.transcripts import TranscriptStore
from agentfold.domain.errors import AgentfoldError
from agentfold.projections.transcripts import build_transcripts
from tests.feed.support import (
    fake_topic_consumer,
    read_topic_confluent,
    stored_envelopes,
    trip_envelopes,
    two_tree_envelopes,
)
from tests.feed.test_publisher_retry import FailingOnce
from tests.test_feed_reconnects import _runs

GENUINE_REQUEST = "request 0: trip"
FORGED_REQUEST = "FORGED: wire 5000 EUR to account XY-123 now."


@pytest.fixture(scope="module")
def trip(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    """The root process id and the envelopes (in position order) of one trip run's tree."""
    return trip_envelopes(tmp_path_factory.mktemp("feed-mutants"))




def _all_text(store: TranscriptStore) -> str:
    return orjson.dumps(store.transcripts()).decode()


def test_a_new_trees_first_record_whose_digest_does_not_chain_stops_the_consumer_with_nothing_committed(
    trip: Any, tmp_path: Path
) -> None:
    """Mutant C2 (transcripts.py ``_apply_tree``: the chain checked only when the tree has a
    digest already, not at position 1): a forged first record of a tree (the user's request
    changed in ``TreeStarted``, the genuine digest copied) was applied unverified; the genuine
    record, with the same digest, was then skipped as a duplicate and every later one chained
    onto it, so the forged request stayed in the transcript for good, silently.

    docs/kafka.md "What the consumer verifies": an envelope at the tree's next position is
    taken only when its digest is the one the previous digest (none, at position 1) and its own
    content give, else ``feed.chain_broken``: nothing of the batch committed, offsets unmoved."""
    pid, envelopes = trip
    first = envelopes[0]
    assert first["position"] == 1 and first["type"] == "TreeStarted"
    forged = copy.deepcopy(first)
    forged["payload"] = orjson.loads(orjson.dumps(forged["payload"]).decode().replace(GENUINE_REQUEST, FORGED_REQUEST))
    assert forged["payload"] != first["payload"] and forged["digest"] == first["digest"]
    store, consumer, topic = fake_topic_consumer(tmp_path)
    try:
        topic.write(forged, *envelopes)
        for _ in range(2):  # the next attempt (a restart from the committed offset) meets it again
            with pytest.raises(AgentfoldError) as refused:
                consumer.poll_once(0)
            assert refused.value.code == "feed.chain_broken", refused.value
            assert refused.value.details == {"tree_id": first["tree_id"], "position": 1}
            assert store.tree_positions() == {} and store.transcripts() == {} and topic.commits == 0
            topic.at = 0
        assert FORGED_REQUEST not in _all_text(store)
        # The genuine records alone are applied, and the transcript holds the genuine request.
        genuine_store, genuine_consumer, genuine_topic = fake_topic_consumer(tmp_path / "genuine")
        try:
            genuine_topic.write(*envelopes)
            while genuine_consumer.poll_once(0) is not None:
                pass
            assert genuine_store.transcript(pid) == build_transcripts(envelopes)[pid]
            assert GENUINE_REQUEST in _all_text(genuine_store)
        finally:
            genuine_store.close()
    finally:
        store.close()


# ---------------------------------------------------------------------------
# The publisher (a real broker: ``kafka_bootstrap``)


def test_a_following_publisher_stops_on_a_record_the_broker_client_refuses_for_good(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    """Mutant P14 (feed.py ``publish_failed``: every ``FeedError`` taken as retriable): a record
    refused for good (too large) was retried for ever, one "following failed" line every 30 s,
    and the publisher never stopped.

    docs/kafka.md "Failures while following": it does not retry, and exits with the classified
    error, on "a record the broker refuses for good (feed.unavailable from a non-retriable
    broker error: too large, not authorized)". The refusal is real: the real kafka-python
    producer with a 1,000-byte request limit refuses a scenario's TreeStarted (a few KB) itself
    (``MessageSizeTooLargeError``, not retriable), as it refuses a record above 16 MiB."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    _runs(url, 1)
    new_producer(kafka_bootstrap).close()  # the broker answers (a failure below is not an outage)
    producer = KafkaProducer(**producer_config(kafka_bootstrap, max_request_size=1000))
    topic = f"refused-{uuid.uuid4().hex[:12]}"
    store = EventStore(url)
    publisher = Publisher(store, kafka_bootstrap, topic, producer=producer)
    stop = threading.Event()
    lines: list[str] = []
    raised: list[BaseException] = []

    def follow() -> None:
        try:
            publisher.follow_until_stopped(stop, lines.append)
        except BaseException as exc:  # noqa: BLE001 - what the thread ended with is the test's subject
            raised.append(exc)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    try:
        follower.join(20)
        stopped_by_itself = not follower.is_alive()
    finally:
        stop.set()
        follower.join(30)
        publisher.close()
    try:
        assert stopped_by_itself, f"still retrying after 20 s: {lines}"
        [error] = raised
        assert isinstance(error, FeedError) and error.code == "feed.unavailable" and not error.retriable, error
        assert not any("following failed" in line for line in lines), lines
        assert PublisherPosition(store, topic).get() == 0  # nothing recorded as published
    finally:
        store.close()


class _Unacknowledged(FailingOnce):
    """The real producer, whose record number ``fail_at`` is sent for real but whose
    acknowledgement never comes back (its future fails as kafka-python's does when a record
    expires unacknowledged: ``KafkaTimeoutError``); every other call is the real producer's."""

    def send(self, *args: Any, **kwargs: Any) -> Any:
        self.sent += 1
        future = self.inner.send(*args, **kwargs)
        if self.sent != self.fail_at:
            return future

        class _Lost:
            def get(self, timeout: float | None = None) -> Any:
                raise KafkaTimeoutError("injected: the record expired before the broker acknowledged it")

        return _Lost()


def test_a_batch_with_a_record_the_broker_did_not_acknowledge_stores_no_position(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    """Mutant P1 (feed.py ``Publisher.produce``: the records' acknowledgements not waited for,
    only the flush): a batch one of whose records was never acknowledged was recorded as
    published, so the event was skipped for good if the broker had not kept it.

    docs/kafka.md "Publishing" 2-3: it "waits until the broker acknowledged **every** record of
    the batch (a failed send is feed.unavailable, before anything is recorded)", and "only then
    stores the batch's last notification id as its position". The next step produces the
    batch again (at least once: duplicates, never a hole)."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    _runs(url, 2)
    stored = stored_envelopes(url)
    producer = _Unacknowledged(new_producer(kafka_bootstrap), fail_at=5)
    topic = f"unacked-{uuid.uuid4().hex[:12]}"
    store = EventStore(url)
    publisher = Publisher(store, kafka_bootstrap, topic, batch_size=500, producer=producer)
    try:
        with pytest.raises(FeedError) as failed:
            publisher.step()
        assert failed.value.code == "feed.unavailable" and failed.value.retriable
        assert publisher.position == 0 and PublisherPosition(store, topic).get() == 0
        report = publisher.drain()  # the next attempt: the whole batch again
        assert report.position == stored[-1]["notification_id"] == PublisherPosition(store, topic).get()
    finally:
        publisher.close()
        store.close()
    read = read_topic_confluent(kafka_bootstrap, topic, expected=2 * len(stored), timeout=20)
    assert sorted(read.notification_ids()) == sorted(2 * [e["notification_id"] for e in stored])


# ---------------------------------------------------------------------------
# What a transcript says (docs/kafka.md "Entry kinds", "Transcript header")


def test_assistant_entries_carry_each_responses_finish_reason_usage_and_tool_call_arguments(
    trip: Any, tmp_path: Path
) -> None:
    """Mutants B1, B2, B4 (projections/transcripts.py: an ``assistant_message`` without the
    response's ``finish_reason``, a tool call without its ``arguments``, or without the
    response's ``usage``): the feed tests compare the transcript tables with the same builder
    run over the store (``transcripts_from_store``), or check other members, so none failed.

    The expected values come from the scripted model's responses in the run's own
    ``TreeStarted`` (its configuration), not from the builder: each assistant entry has the
    response's ``finish_reason``, ``usage`` when the response had one (only the first here),
    and ``tool_calls`` with each call's ``id``, ``name`` and ``arguments`` as the model gave them."""
    pid, envelopes = trip
    responses = envelopes[0]["payload"]["configuration"]["model"]["responses"]
    store = TranscriptStore(f"sqlite:///{tmp_path / 'transcripts.db'}")
    try:
        store.apply(envelopes)
        transcript = store.transcript(pid)
    finally:
        store.close()
    assert transcript is not None
    said = [e for e in transcript["entries"] if e["kind"] == "assistant_message"]
    assert len(said) == len(responses) == 3
    for entry, response in zip(said, responses, strict=True):
        assert entry["finish_reason"] == response["finish_reason"]
        assert [{k: c[k] for k in ("id", "name", "arguments")} for c in entry["tool_calls"]] == [
            {k: c[k] for k in ("id", "name", "arguments")} for c in response["message"].get("tool_calls", [])]
        assert entry.get("usage") == response.get("usage")
    assert [e["finish_reason"] for e in said] == ["tool_calls", "tool_calls", "stop"]
    assert said[0]["usage"] == {"completion_tokens": 40, "prompt_tokens": 120, "total_tokens": 160}
    assert said[0]["tool_calls"][1]["arguments"] == '{"city": "Lisbon", "nights": 3}'


def test_a_transcript_header_names_the_notifications_that_created_and_last_updated_it(
    trip: Any, tmp_path: Path
) -> None:
    """Mutant B3 (projections/transcripts.py ``_emit``: the header's ``updated_notification_id``
    no longer moved on with each entry): a consumer that reads the headers to find what changed
    since a notification id (the table has the column for that) saw every transcript as last
    updated when it was created.

    docs/kafka.md "Transcript header": ``created_notification_id`` and
    ``updated_notification_id``; the tables are written in two batches here, so the header row
    is updated in place, as a following consumer does it."""
    pid, envelopes = trip
    half = len(envelopes) // 2
    store = TranscriptStore(f"sqlite:///{tmp_path / 'transcripts.db'}")
    try:
        store.apply(envelopes[:half])
        middle = store.transcript(pid)
        store.apply(envelopes[half:])
        transcript = store.transcript(pid)
        (row,) = store._rows("SELECT created_notification_id AS c, updated_notification_id AS u, status, entry_count "
                             "FROM agentfold_transcripts WHERE process_id = ?", (pid,))
    finally:
        store.close()
    assert middle is not None and transcript is not None
    entries = transcript["entries"]
    ended = next(e for e in envelopes if e["type"] == "ProcessTerminated" and e["process_id"] == pid)
    assert transcript["created_notification_id"] == entries[0]["notification_id"]
    assert transcript["updated_notification_id"] == entries[-1]["notification_id"] == ended["notification_id"]
    assert middle["updated_notification_id"] == middle["entries"][-1]["notification_id"] < ended["notification_id"]
    assert (row["c"], row["u"], row["status"], row["entry_count"]) == (
        entries[0]["notification_id"], ended["notification_id"], "completed", len(entries))


# ---------------------------------------------------------------------------
# Two consumers on one PostgreSQL database (docs/kafka.md "Tables")


@pytest.fixture(scope="module")
def two_trees(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """The envelopes of two runs' trees, each tree's in position order."""
    return two_tree_envelopes(tmp_path_factory.mktemp("feed-mutants-two"))


ROUNDS = 15


def test_two_consumers_applying_the_same_new_trees_in_opposite_orders_never_deadlock(
    two_trees: list[list[dict[str, Any]]], pg_database: str,
) -> None:
    """Mutant C7 (transcripts.py ``_lock_trees``: a new tree's row inserted in the batch's order,
    not sorted): two consumers whose batches hold the same two new trees in opposite orders
    (two groups sharing the database, or a partition changing owner) each inserted its first
    tree's row, then waited for the other's: PostgreSQL broke the deadlock by aborting one
    batch (``DeadlockDetected``; a ``--once`` consumer exited 1 with it).

    docs/kafka.md "Tables": "Both statements go through the trees in one order (sorted), so
    that two batches with trees in common never wait for each other in a cycle". To make the
    interleaving happen, a third session inserts (uncommitted) the row of the tree that sorts
    first: the first consumer, whose batch starts with that tree, waits for it; the second,
    whose batch starts with the other tree, inserts that one's row and then waits for it too
    (sorted, it would wait without holding anything). The third session then rolls back: when
    the first consumer takes the row, each consumer waits for the other. The race after the
    roll back is the scheduler's, so it is run several times."""
    import psycopg

    low, high = sorted(two_trees, key=lambda envelopes: envelopes[0]["tree_id"])
    low, high = low[:5], high[:5]
    first, second = TranscriptStore(pg_database), TranscriptStore(pg_database)
    blocker = psycopg.connect(pg_database)
    try:
        for _ in range(ROUNDS):
            first.reset()
            blocker.execute("INSERT INTO agentfold_transcript_trees (tree_id, position, notification_id, state) "
                            "VALUES (%s, 0, 0, 'null')", (low[0]["tree_id"],))
            results: dict[str, Any] = {}

            one = threading.Thread(target=_apply, args=(results, "first", first, low + high))
            one.start()
            _wait_for_lock_waits(pg_database, 1)
            two = threading.Thread(target=_apply, args=(results, "second", second, high + low))
            two.start()
            _wait_for_lock_waits(pg_database, 2)
            blocker.rollback()
            one.join(30)
            two.join(30)
            assert not any(isinstance(r, Exception) for r in results.values()), results
            assert sorted((r.applied, r.duplicates) for r in results.values()) == [(0, 10), (10, 0)]
            assert first.tree_positions() == {low[0]["tree_id"]: 5, high[0]["tree_id"]: 5}
    finally:
        blocker.close()
        first.close()
        second.close()


def _apply(results: dict[str, Any], name: str, store: TranscriptStore, envelopes: list[dict[str, Any]]) -> None:
    """One consumer's batch; what it returned or raised goes to ``results[name]``."""
    try:
        results[name] = store.apply(envelopes)
    except Exception as exc:  # noqa: BLE001 - shown by the test's assertion
        results[name] = exc


def _wait_for_lock_waits(url: str, count: int, timeout: float = 10.0) -> None:
    """Until ``count`` sessions of the database wait for a lock (the test's interleaving)."""
    import time

    import psycopg

    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as c:
        while True:
            (waiting,) = c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                   "AND wait_event_type = 'Lock'").fetchone()  # type: ignore[misc]
            if waiting >= count:
                return
            assert time.monotonic() < deadline, f"{waiting} session(s) wait for a lock, not {count}"
            time.sleep(0.02)

"""A publisher whose batch the broker did not take goes on from what the store holds, never from
what it remembered of that batch (docs/kafka.md, "Failures while following": "every attempt
starts again from the command's durable position, never from what it held in memory").

Found by a review: a row restored by hand under a later notification id (docs/kafka.md: "no
damage: it is published in its place, before the tree's later events") was marked as produced
(``Publisher._ahead``), and the chain check remembered the tree's later events as checked (which
``Publisher._behind`` takes as produced), while the batch holding them was still being sent. When
a send of that batch failed, the next attempt passed over the restored row and every earlier
event of its tree for good; the publisher reported success and a transcript consumer stopped on
``feed.gap``.

A send that fails in the middle of a batch cannot be caused on demand at a real broker (the test
broker keeps its topics in memory only: restarting it loses them), so these tests inject one
failed ``send`` into the publisher's real ``KafkaProducer``, as the broker's client raises it when
the broker cannot be reached (``KafkaTimeoutError``: no metadata in time); every other send, and
every record on the topic, is the real producer's and the real broker's.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from kafka.errors import KafkaTimeoutError

from agentfold.adapters import feed
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.feed import FeedError, Publisher
from agentfold.adapters.transcripts import TranscriptStore
from agentfold.domain.ids import TreeID
from agentfold.projections.transcripts import build_transcripts
from tests.audit.support import Sql
from tests.feed.support import TopicRead, follow_until, read_topic_confluent, stored_envelopes
from tests.test_feed_reconnects import _runs


class FailingOnce:
    """The real producer, whose ``send`` number ``fail_at`` raises what kafka-python raises when
    the broker cannot be reached; every other call is the real producer's."""

    def __init__(self, inner: Any, fail_at: int) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.sent = 0

    def send(self, *args: Any, **kwargs: Any) -> Any:
        self.sent += 1
        if self.sent == self.fail_at:
            raise KafkaTimeoutError("injected: no metadata in time (the broker cannot be reached)")
        return self.inner.send(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _restored_store(url: str, position: int = 10) -> tuple[str, list[dict[str, Any]]]:
    """Three runs; the event at ``position`` of a tree in the middle of the log (one that goes
    on past it) deleted and inserted again (a restore from a backup: a later notification id).
    Returns that tree's id and every envelope as stored (the store verifies)."""
    _runs(url, 3)
    envelopes = stored_envelopes(url)
    tree_id = next(e for e in envelopes[len(envelopes) // 2 :] if e["position"] > position + 2)["tree_id"]
    sql = Sql(url)
    _, topic_name, state = next(r for r in sql.raw_rows(TreeID(tree_id)) if r[0] == position)
    sql.delete(TreeID(tree_id), position)
    sql.insert(TreeID(tree_id), position, topic_name, state)
    stored = stored_envelopes(url)
    restored = next(e for e in stored if e["tree_id"] == tree_id and e["position"] == position)
    assert restored["notification_id"] == max(e["notification_id"] for e in stored)  # now the log's last
    return tree_id, stored


def _every_tree_complete_in_order(read: TopicRead, stored: list[dict[str, Any]]) -> None:
    """What a consumer that dedupes by (tree, position) sees: each tree's records in partition
    order are its next position or one it had already (a duplicate of the stored event), never
    one past a hole, up to the tree's last stored position."""
    by_position = {(e["tree_id"], e["position"]): e for e in stored}
    last: dict[str, int] = {}
    for r in read.envelopes_in_partition_order():
        tree, position = r["tree_id"], r["position"]
        assert r["digest"] == by_position[(tree, position)]["digest"]
        assert position <= last.get(tree, 0) + 1, f"{tree}: position {position} after {last.get(tree, 0)}"
        last[tree] = max(last.get(tree, 0), position)
    want: dict[str, int] = {}
    for e in stored:
        want[e["tree_id"]] = max(want.get(e["tree_id"], 0), e["position"])
    assert last == want


def _consumed_as_stored(read: TopicRead, stored: list[dict[str, Any]], tmp_path: Path) -> None:
    """The transcript consumer's tables, fed the topic in partition order, hold the transcripts
    of the stored events (no ``feed.gap``). Built from them in position order per tree: in log
    order the restored row comes after its tree's later events."""
    transcripts = TranscriptStore(f"sqlite:///{tmp_path / 'transcripts.db'}")
    try:
        transcripts.apply(read.envelopes_in_partition_order())
        assert transcripts.transcripts() == build_transcripts(sorted(stored, key=lambda e: (e["tree_id"], e["position"])))
    finally:
        transcripts.close()


def test_a_following_publisher_whose_batch_fails_at_the_broker_still_publishes_a_restored_row_in_its_place(
    durable_store_url: str, kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One batch holds the whole log; its first send fails, so nothing of it reaches the topic,
    but building it had taken the restored row as produced ahead of its notification. The retry
    publishes every event once, every tree complete and in order: the restored row in its
    place, and the events of its tree before it."""
    url = durable_store_url
    tree_id, stored = _restored_store(url)
    made: list[FailingOnce] = []
    real_new_producer = feed.new_producer

    def new_producer(bootstrap: str, *args: Any) -> Any:
        made.append(FailingOnce(real_new_producer(bootstrap, *args), 1 if not made else 0))
        return made[-1]

    monkeypatch.setattr(feed, "new_producer", new_producer)
    topic = f"restored-retry-{uuid.uuid4().hex[:8]}"
    store = EventStore(url)
    publisher = Publisher(store, kafka_bootstrap, topic, batch_size=500)
    lines = follow_until(
        publisher, lambda: publisher.position >= stored[-1]["notification_id"] and publisher.failures >= 1
    )
    assert made[0].sent == 1 and len(made) == 2  # the failure happened, and a new producer took over
    assert publisher.failures == 1 and any("following again from position 0" in line for line in lines), lines
    read = read_topic_confluent(kafka_bootstrap, topic, expected=len(stored), timeout=20)
    assert [e["position"] for e in read.envelopes_in_partition_order() if e["tree_id"] == tree_id][:1] == [1]
    assert len(read.records) == len(stored)  # each once: the failed attempt put nothing on the topic
    _every_tree_complete_in_order(read, stored)
    _consumed_as_stored(read, stored, tmp_path)


def test_a_step_the_broker_did_not_take_leaves_nothing_behind_for_the_next_step(
    tmp_path: Path, kafka_bootstrap: str,
) -> None:
    """The same failure under ``Publisher.step`` itself (the Python API: a caller that calls
    ``step`` again after a ``FeedError``): the failed step stored no position, and the next one
    produces the batch again as if it had never been tried, the restored row in its place."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    tree_id, stored = _restored_store(url)
    producer = FailingOnce(feed.new_producer(kafka_bootstrap), 1)
    topic = f"restored-step-{uuid.uuid4().hex[:8]}"
    store = EventStore(url)
    publisher = Publisher(store, kafka_bootstrap, topic, batch_size=500, producer=producer)
    try:
        with pytest.raises(FeedError) as failed:
            publisher.step()
        assert failed.value.retriable and publisher.position == 0
        report = publisher.drain()
        assert report.position == stored[-1]["notification_id"]
    finally:
        publisher.close()
        store.close()
    read = read_topic_confluent(kafka_bootstrap, topic, expected=len(stored), timeout=20)
    assert [e["position"] for e in read.envelopes_in_partition_order() if e["tree_id"] == tree_id][:1] == [1]
    assert len(read.records) == len(stored)  # each once: the failed attempt put nothing on the topic
    _every_tree_complete_in_order(read, stored)
    _consumed_as_stored(read, stored, tmp_path)

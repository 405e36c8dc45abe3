"""One publisher per (store, topic): a second one is refused at start, not left to duplicate.

Found by a feed review: two following `agentfold publish` processes on one store and topic
both ran and produced every new event twice (57 records for 37 events), and neither ever
failed with the `feed.position_conflict` docs/kafka.md promised: they read the same batches
and stored the same positions, and the slower one's position write took the other's for its
own lost reply. Real publishers (the console script as child processes), a real broker, the
topic read back with an independent client; SQLite and PostgreSQL stores.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.feed import Publisher, PublisherPosition, store_envelopes
from agentfold.domain.errors import StoreFailure
from tests.feed.support import ROOT, read_topic_confluent
from tests.feed.workload import Workload
from tests.test_cli import agentfold, ok


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'feed.db'}"
    return str(request.getfixturevalue("pg_database"))


def test_a_second_publisher_on_one_store_and_topic_is_refused_and_every_event_reaches_the_topic_once(
    kafka_bootstrap: str, store_url: str
) -> None:
    topic = f"one-publisher-{uuid.uuid4().hex[:12]}"
    publish = ["publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--json"]
    store = EventStore(store_url)
    workload = Workload(store)
    try:
        workload.runs(2)
        position = PublisherPosition(store, topic)
        first = subprocess.Popen(
            [sys.executable, "-m", "agentfold.adapters.cli", "--store", store_url, *publish, "--poll-interval", "0.05"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while position.get() < store.max_notification_id():
                assert first.poll() is None, first.communicate()[1]
                assert time.monotonic() < deadline, "the first publisher did not catch up"
                time.sleep(0.05)
            # A second one, following or --once, while the first runs: refused before it produces anything.
            for extra in (["--once"], ["--poll-interval", "0.05"]):
                ran = agentfold(*publish, *extra, store=store_url, timeout=60)
                assert ran.code == 1, (extra, ran)
                error = ran.error()
                assert error["code"] == "feed.position_conflict", error
                assert "another publisher is running on topic" in error["message"], error
                assert ran.stdout == "", ran.stdout
            # The first goes on publishing what is appended meanwhile.
            workload.run(2)
            deadline = time.monotonic() + 60
            while position.get() < store.max_notification_id():
                assert first.poll() is None, first.communicate()[1]
                assert time.monotonic() < deadline, "the first publisher stopped publishing"
                time.sleep(0.05)
            # Another topic of the same store is another publisher's: it runs beside.
            ok(agentfold("publish", "--bootstrap", kafka_bootstrap, "--topic", topic + "-other", "--once",
                         store=store_url, timeout=60))
            first.send_signal(signal.SIGTERM)
            out, err = first.communicate(timeout=30)
        finally:
            if first.poll() is None:
                first.kill()
                first.communicate()
        assert first.returncode == 0, err
        assert json.loads(out)["events"] == store.max_notification_id()
        # Gone with the first one's exit: the next publisher starts.
        workload.run(3)
        ok(agentfold(*publish, "--once", store=store_url, timeout=60))
        total = store.max_notification_id()
        ids = [e["notification_id"] for e in store_envelopes(store)]
    finally:
        workload.close()
        store.close()
    read = read_topic_confluent(kafka_bootstrap, topic, expected=total)
    assert sorted(read.notification_ids()) == ids  # each event exactly once


def _refused_beside(holder: EventStore, other: EventStore, bootstrap: str, topic: str) -> None:
    """A publisher on ``other`` is refused while one on ``holder`` runs, and starts once it closed."""
    first = Publisher(holder, bootstrap, topic)
    with pytest.raises(StoreFailure) as refused:
        Publisher(other, bootstrap, topic)
    assert refused.value.code == "feed.position_conflict"
    first.close()
    Publisher(other, bootstrap, topic).close()


def test_the_publisher_api_holds_the_topic_until_it_closes(kafka_bootstrap: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'api.db'}"
    topic = f"one-publisher-api-{uuid.uuid4().hex[:12]}"
    store = EventStore(url)
    other_store = EventStore(url)  # another EventStore (as another process would open it)
    try:
        _refused_beside(store, other_store, kafka_bootstrap, topic)
    finally:
        other_store.close()
        store.close()


def test_a_publisher_that_lost_its_lease_stops_at_its_next_write_and_the_holder_goes_on(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    # Found by a review of the lease: a publisher catching up a backlog whose lease was lost (its
    # PostgreSQL session ended, its `.leases` file removed) went on storing positions for up to a
    # second, while a second publisher took the lease; the holder's own position write then failed
    # with feed.position_conflict and both stopped (no publisher left, ~20 records twice).
    url = f"sqlite:///{tmp_path / 'lost.db'}"
    topic = f"one-publisher-lost-{uuid.uuid4().hex[:12]}"
    store_a, store_b = EventStore(url), EventStore(url)
    workload = Workload(store_a)
    try:
        workload.runs(4)
        total = store_a.max_notification_id()
        first = Publisher(store_a, kafka_bootstrap, topic, batch_size=10)
        first.step()
        first.step()
        (tmp_path / "lost.db.leases").unlink()  # the lease file removed under it
        second = Publisher(store_b, kafka_bootstrap, topic, batch_size=10)  # a new file, a free lease
        with pytest.raises(StoreFailure) as stopped:
            first.step()  # no position written: the lease is checked before the write
        assert stopped.value.code == "feed.position_conflict"
        first.close()
        # A position stored past the holder's by one that had not noticed yet (which produced those
        # events first; here they are claimed only): the holder goes on from it instead of stopping.
        claimed = (second.position, second.position + 30)
        PublisherPosition(store_a, topic).save(claimed[1])
        while second.position < total:
            second.step()
        assert second.position == total
        second.close()
        ids = [e["notification_id"] for e in store_envelopes(store_a)]
    finally:
        workload.close()
        store_b.close()
        store_a.close()
    expected = {i for i in ids if not claimed[0] < i <= claimed[1]}
    read = read_topic_confluent(kafka_bootstrap, topic, expected=len(expected))
    # Every other event on the topic (the holder's batch whose position write found the other
    # position was produced too; a batch may come twice).
    assert expected <= set(read.notification_ids()) <= set(ids)


def test_a_store_opened_through_a_symlink_holds_the_same_publisher_lease(kafka_bootstrap: str, tmp_path: Path) -> None:
    # Found by a review of the lease: the lease file was named after the path as given, so a store
    # opened through a symlink locked another file and two publishers both ran.
    (tmp_path / "real").mkdir()
    (tmp_path / "link").mkdir()
    topic = f"one-publisher-link-{uuid.uuid4().hex[:12]}"
    by_path = EventStore(f"sqlite:///{tmp_path / 'real' / 's.db'}")
    (tmp_path / "link" / "s.db").symlink_to(tmp_path / "real" / "s.db")  # the database file itself
    by_link = EventStore(f"sqlite:///{tmp_path / 'link' / 's.db'}")
    try:
        _refused_beside(by_path, by_link, kafka_bootstrap, topic)
    finally:
        by_link.close()
        by_path.close()


def test_a_lease_file_that_cannot_be_opened_is_a_classified_store_failure(tmp_path: Path) -> None:
    # Found by a review of the lease: `publish` (and `run`, `recover`) failed with cli.internal
    # ("PermissionError: ... s.db.leases", "IsADirectoryError") when the lease file could not be opened.
    url = f"sqlite:///{tmp_path / 's.db'}"
    EventStore(url).close()
    (tmp_path / "s.db.leases").mkdir()
    ran = agentfold("publish", "--bootstrap", "127.0.0.1:9", "--topic", "t", "--once", "--json", store=url)
    assert ran.code == 1, ran
    error = ran.error()
    assert error["code"] == "store.unavailable" and "cannot open the lease file" in error["message"], error

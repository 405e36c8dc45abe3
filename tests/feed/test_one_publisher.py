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


def test_the_publisher_api_holds_the_topic_until_it_closes(kafka_bootstrap: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'api.db'}"
    topic = f"one-publisher-api-{uuid.uuid4().hex[:12]}"
    store = EventStore(url)
    other_store = EventStore(url)  # another EventStore (as another process would open it)
    try:
        first = Publisher(store, kafka_bootstrap, topic)
        with pytest.raises(StoreFailure) as refused:
            Publisher(other_store, kafka_bootstrap, topic)
        assert refused.value.code == "feed.position_conflict"
        first.close()
        Publisher(other_store, kafka_bootstrap, topic).close()
    finally:
        other_store.close()
        store.close()

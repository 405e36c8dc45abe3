"""Shared fixtures: one store URL per backend (memory, SQLite file, PostgreSQL database).

PostgreSQL tests use the server named by AGENTFOLD_TEST_PG (scripts/test starts a
throwaway one) and a fresh database per test. Without it they are skipped, except
under CI=true, where a missing PostgreSQL fails them. Kafka feed tests use the broker
named by AGENTFOLD_TEST_KAFKA (``kafka_bootstrap``), with the same rule.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from agentfold.adapters.eventstore import EventStore
    from tests.http_api.support import ApiServer

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BACKENDS = ["memory", "sqlite", "postgresql"]

#: Tests that take half a minute or more in CI (its log lists the 30 slowest), longest first.
#: They are collected first, so that pytest-xdist's workers start them at once (its first tests
#: go round robin, one to each worker) instead of one of them starting near the end of the
#: run and keeping it going alone: the suite's time is then closer to its work divided among
#: the workers. A prefix of node ids; order within a prefix is kept.
SLOW_FIRST = (
    "tests/http_api/test_failover_chaos.py::",
    "tests/feed/test_publish_broker_partition.py::",
    "tests/projections/test_read_models.py::test_after_every_append_the_tables_equal_the_pure_projections",
    "tests/feed/test_feed_kafka.py::test_a_publisher_killed_after_producing_before_storing_its_position",
    "tests/http_api/test_serve_store_faults.py::test_requests_succeed_again_within_seconds_of_postgresql",
    "tests/http_api/test_serve_failover.py::test_a_run_whose_owner_line_here_stopped_on_a_store_failure",
    "tests/http_api/test_slow_clients.py::test_health_answers_at_once_while_long_polls_hold_every_worker",
    "tests/feed/test_feed_kafka.py::test_a_transcript_consumer_killed_between_its_db_commit_and_its_offset",
    "tests/http_api/test_serve_partition.py::test_requests_answer_during_a_network_partition",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the ``SLOW_FIRST`` tests first, longest first; every other test keeps its place."""
    def rank(item: pytest.Item) -> int:
        for i, prefix in enumerate(SLOW_FIRST):
            if item.nodeid.startswith(prefix):
                return i
        return len(SLOW_FIRST)

    items.sort(key=rank)  # stable: the order among equals is pytest's


def _pg_admin_url() -> str | None:
    return os.environ.get("AGENTFOLD_TEST_PG")


def require_kafka() -> str:
    """The Kafka-protocol broker scripts/test starts (AGENTFOLD_TEST_KAFKA=host:port)."""
    bootstrap = os.environ.get("AGENTFOLD_TEST_KAFKA")
    if bootstrap:
        return bootstrap
    if os.environ.get("CI") == "true":
        pytest.fail("AGENTFOLD_TEST_KAFKA is not set and CI=true: Kafka feed tests must run")
    pytest.skip("Kafka broker not available (set AGENTFOLD_TEST_KAFKA, start one with scripts/kafka-throwaway, or run scripts/test)")


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """The broker's bootstrap address; skipped without one, failed under CI=true."""
    return require_kafka()


def require_postgres() -> str:
    url = _pg_admin_url()
    if url:
        return url
    if os.environ.get("CI") == "true":
        pytest.fail("AGENTFOLD_TEST_PG is not set and CI=true: PostgreSQL tests must run")
    pytest.skip("PostgreSQL not available (set AGENTFOLD_TEST_PG or run scripts/test)")


def create_pg_database() -> tuple[str, Callable[[], None]]:
    """A new PostgreSQL database on the test server: its URL and the function that drops it."""
    import psycopg

    admin = require_postgres()
    name = "t_" + uuid.uuid4().hex[:16]
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return admin.rsplit("/", 1)[0] + "/" + name, drop


def fresh_pg_database(request: pytest.FixtureRequest) -> str:
    """One more database beside the ``pg_database`` fixture's, dropped at the end of the test."""
    url, drop = create_pg_database()
    request.addfinalizer(drop)
    return url


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database; yields its URL and drops it afterwards."""
    url, drop = create_pg_database()
    yield url
    drop()


def make_store_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if backend == "memory":
        return "memory:"
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'agentfold.db'}"
    return str(request.getfixturevalue("pg_database"))


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store URL, once per backend."""
    return make_store_url(request.param, tmp_path, request)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """The SQLite file of ``store``."""
    return tmp_path / "agentfold.db"


@pytest.fixture
def store(db: Path) -> Iterator[EventStore]:
    """An EventStore on a fresh SQLite file (``db``), closed after the test (a module's own
    ``store`` fixture takes its place there)."""
    from agentfold.adapters.eventstore import EventStore

    opened = EventStore(f"sqlite:///{db}")
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def durable_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store URL on a backend that survives process death."""
    return make_store_url(request.param, tmp_path, request)


@pytest.fixture
def servers() -> Iterator[list[ApiServer]]:
    """``agentfold serve`` processes a test started (append them): each is stopped at the end
    of the test and must have ended cleanly."""
    started: list[ApiServer] = []
    yield started
    for server in started:
        code, _ = server.stop()
        assert code == 0, server.logs()

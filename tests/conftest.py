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
    from tests.http_api.support import ApiServer

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BACKENDS = ["memory", "sqlite", "postgresql"]


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

"""One ``agentfold serve`` process per test module and backend (SQLite file, PostgreSQL database)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.conftest import require_postgres
from tests.http_api.support import ApiServer, start_server


def _pg_database() -> Iterator[str]:
    import psycopg

    admin = require_postgres()
    name = "h_" + uuid.uuid4().hex[:16]
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{admin.rsplit('/', 1)[0]}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """A server on a fresh store; stopped with SIGTERM after the module, which must end it cleanly."""
    folder = tmp_path_factory.mktemp(f"http-{request.param}")
    if request.param == "sqlite":
        databases: Iterator[str] | None = None
        store = f"sqlite:///{folder / 'agentfold.db'}"
    else:
        databases = _pg_database()
        store = next(databases)
    server = start_server(store, folder)
    try:
        yield server
    finally:
        code, last = server.stop()
        if databases is not None:
            databases.close()
    assert code == 0, f"exit {code}\n{server.logs()}"
    assert '"stopped": true' in last, last

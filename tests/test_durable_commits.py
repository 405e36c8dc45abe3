"""An acknowledged append is on disk, whatever the database's defaults say.

A dispatcher is called as soon as its Effect's permission is committed. A commit the
database acknowledged before it reached the disk (SQLite ``synchronous`` NORMAL or OFF in
WAL mode, PostgreSQL ``synchronous_commit = off``) is lost by a power cut or a server crash,
and the recovered run would call that tool again. agentfold sets the durable mode on each
connection it writes with: SQLite ``synchronous=FULL`` (a build may default WAL mode to
NORMAL), PostgreSQL ``synchronous_commit`` at least ``local`` (a stronger setting is kept).
The same holds for the transcript consumer's database, whose offsets are committed after
its tables.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.transcripts import TranscriptStore
from agentfold.domain.requests import Settlement
from tests.conftest import create_pg_database
from tests.kernel_programs import chain_program

FULL = 2


@pytest.fixture
def lax_sqlite(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[sqlite3.Connection]]:
    """Every sqlite3 connection opened from now on starts with ``synchronous=OFF``, as on a
    build whose default is not durable; yields the connections opened."""
    real = sqlite3.connect
    opened: list[sqlite3.Connection] = []

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = real(*args, **kwargs)
        conn.execute("PRAGMA synchronous=OFF")
        opened.append(conn)
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect)
    yield opened


def synchronous_of(conns: list[sqlite3.Connection]) -> list[int]:
    """The ``synchronous`` setting of each connection still open."""
    values = []
    for conn in conns:
        try:
            values.append(int(conn.execute("PRAGMA synchronous").fetchone()[0]))
        except sqlite3.ProgrammingError:  # closed since
            continue
    return values


def commit_mode_after_a_run(url: str, effects: int = 5) -> str:
    """Run a chain of ``effects`` Effects on ``url``; the commit setting of a pooled connection
    of its store afterwards (SQLite ``synchronous``, PostgreSQL ``synchronous_commit``)."""
    sqlite = url.startswith("sqlite")
    program = chain_program(lambda request, context: Settlement.succeeded({"value": 1}), name="durable.chain")
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            result = runtime.start(program, {"n": effects}, start_id="durable:1").result(timeout=60)
            assert result.status == "completed", result
            with store.recorder.datastore.transaction(commit=False) as cursor:  # a pooled connection
                cursor.execute("PRAGMA synchronous" if sqlite else "SHOW synchronous_commit")
                row = cursor.fetchone()
                return str(row[0] if sqlite else row["synchronous_commit"])
    finally:
        store.close()


def test_sqlite_store_connections_commit_with_a_sync_whatever_the_build_default(
    tmp_path: Path, lax_sqlite: list[sqlite3.Connection]
) -> None:
    assert commit_mode_after_a_run(f"sqlite:///{tmp_path / 'store.db'}") == str(FULL)
    assert lax_sqlite, "the store opened no connection through sqlite3.connect"


def test_the_sqlite_transcript_database_commits_with_a_sync(
    tmp_path: Path, lax_sqlite: list[sqlite3.Connection]
) -> None:
    store = TranscriptStore(f"sqlite:///{tmp_path / 'transcripts.db'}")
    try:
        values = synchronous_of(lax_sqlite)
        assert values and set(values) == {FULL}, values
    finally:
        store.close()


@pytest.mark.parametrize(("database_setting", "expected"), [("off", "local"), ("remote_write", "remote_write")])
def test_postgresql_sessions_never_commit_with_synchronous_commit_off(
    request: pytest.FixtureRequest, database_setting: str, expected: str
) -> None:
    url, drop = create_pg_database()
    request.addfinalizer(drop)
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = {database_setting}')
    assert commit_mode_after_a_run(url) == expected
    transcripts = TranscriptStore(url)
    try:
        row = transcripts._conn.execute("SHOW synchronous_commit").fetchone()
        assert row["synchronous_commit"] == expected
    finally:
        transcripts.close()


def test_serve_warns_about_a_postgresql_server_run_with_fsync_off(tmp_path: Path) -> None:
    # Nothing agentfold sets can make such a server's commits durable (docs/guarantees.md);
    # the tests' throwaway servers run with fsync=off, so this one must warn (and SQLite must not).
    from tests.http_api.support import start_server

    url, drop = create_pg_database()
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute("SHOW fsync").fetchone()
        fsync = row[0] if row is not None else None
        store = EventStore(url)
        try:
            said = store.undurable_server()
        finally:
            store.close()
        assert (said is not None) == (fsync == "off")
        pg = start_server(url, tmp_path)
        sqlite = start_server(f"sqlite:///{tmp_path / 'agentfold.db'}", tmp_path)
        try:
            warned = [line for line in pg.logs().splitlines() if "fsync=off" in line]
            assert warned == ([f"agentfold: warning: {said}"] if said is not None else [])
            assert "fsync" not in sqlite.logs()
        finally:
            pg.stop()
            sqlite.stop()
    finally:
        drop()

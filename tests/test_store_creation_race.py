"""Several processes opening one new PostgreSQL database at once all succeed.

An operations audit started two ``agentfold serve`` on an empty database at the same moment:
one exited with ``store.unavailable`` in 3 of 7 tries (``duplicate key value violates unique
constraint "pg_type_typname_nsp_index"``, ``type "agentfold_tracking" already exists``,
``Failed to record tracking for __migration__ 1``): concurrent ``CREATE TABLE IF NOT EXISTS``
is not safe in PostgreSQL, and eventsourcing's tracking table decides on its migration row
before its transaction. Each opener here has its own connections (separate sessions), as
separate processes would; the table creation of every store, read-model and tracking table
is serialized by an advisory lock.
"""

from __future__ import annotations

import threading
import uuid

import psycopg

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.read_models import ReadModels
from tests.conftest import require_postgres

OPENERS = 3
ROUNDS = 6


def _open_everything(url: str, barrier: threading.Barrier | None = None) -> None:
    """The store's tables, then the read-model and tracking tables, as serve's follower makes
    them; with a ``barrier``, the store is opened first (its tables exist) and the read models
    are raced on their own."""
    if barrier is not None:
        store = EventStore(url, create=False)
        barrier.wait()
    else:
        store = EventStore(url)
    try:
        ReadModels(store)
    finally:
        store.close()


def test_openers_racing_on_a_new_database_all_succeed() -> None:
    admin = require_postgres()
    failures: list[str] = []
    for round_ in range(ROUNDS):
        name = "race_" + uuid.uuid4().hex[:12]
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        url = f"{admin.rsplit('/', 1)[0]}/{name}"
        barrier = threading.Barrier(OPENERS)
        read_models_only = round_ % 2 == 1
        if read_models_only:
            EventStore(url).close()

        def opener(url: str = url, barrier: threading.Barrier = barrier, only: bool = read_models_only) -> None:
            try:
                if only:
                    _open_everything(url, barrier)
                else:
                    barrier.wait()
                    _open_everything(url)
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                failures.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=opener) for _ in range(OPENERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        try:
            _open_everything(url)  # and the database is whole afterwards
        finally:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    assert failures == [], failures[:3]

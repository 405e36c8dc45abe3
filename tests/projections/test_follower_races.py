"""Read models read and written while another follower commits (found by a review of the read models).

Real stores (an SQLite file, a PostgreSQL database), real runs recorded with the CLI, real
followers; the interleavings two processes can hit are forced with a hook at the moment
they need (a commit by another follower between two reads, or while a batch is written).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.audit import programs_for, verify_tree
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.follower import Follower
from agentfold.adapters.read_models import PENDING, RUNS, ReadModels
from agentfold.adapters.sources import default_sources
from agentfold.projections.read_models import project_tree
from tests.audit.support import Sql, record_demo


def test_verify_reads_a_trees_rows_as_of_one_moment(
    durable_store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The run row, then the rounds, delegates, ... were each read in a transaction of their
    # own: a follower committing in between gave rows no state of the tree ever had, and
    # `audit verify` reported read_model.mismatch for a follower that worked correctly.
    url = durable_store_url
    tree_id = record_demo(tmp_path / "run", url)
    reader, writer = EventStore(url), EventStore(url)
    try:
        catalog = default_sources().catalog()
        records = reader.read(tree_id)
        events = len(records)
        programs = programs_for(catalog, records[0].event)
        # The first position whose rows differ from the end's: the human input pending.
        parked = next(k for k in range(1, events) if project_tree(reader.load(tree_id, programs, upto=k).state,
                                                                     programs).to_json()["pending"])
        follower = Follower(writer, catalog, batch_size=parked)  # the store's only tree: ids are positions
        follower.step()  # the tables hold the run up to there
        follower.batch_size = 1
        models = ReadModels(reader, create=False)
        stepped: list[int] = []
        real_sql = ReadModels._sql

        def sql(self: ReadModels, statement: str) -> str:
            if self is models and PENDING in statement and not stepped:
                while follower.step().events:  # another follower commits the rest meanwhile
                    stepped.append(follower.position)
            return real_sql(self, statement)

        monkeypatch.setattr(ReadModels, "_sql", sql)
        check = verify_tree(reader, tree_id, catalog, models)[0]
        assert stepped, "the follower committed while the rows were read"
        assert check.read_model == "equal" and check.problems == [], check.problems
        # The rows were those of the parked run; read again, they are the whole run's, equal too.
        monkeypatch.setattr(ReadModels, "_sql", real_sql)
        again = verify_tree(reader, tree_id, catalog, models)[0]
        assert again.read_model == "equal" and again.problems == []
        assert models.counter(str(tree_id)) == (events, events)
    finally:
        reader.close()
        writer.close()


def test_a_follower_racing_a_rebuild_writes_each_runs_creation_position(durable_store_url: str, tmp_path: Path) -> None:
    # A follower whose batch lost the compare-and-set to a rebuild kept the tree it had folded,
    # with the creation position it had read from the tables the rebuild had just emptied (0):
    # its next batch wrote the run's pending input with creation position 0, so listings put
    # it first and a page after the first run's cursor skipped it; verify did not see it.
    url = durable_store_url
    first = record_demo(tmp_path / "first", url, start_id="first-run", answer=False)
    parked = record_demo(tmp_path / "parked", url, start_id="parked-run", answer=False)
    store = EventStore(url)
    try:
        catalog = default_sources().catalog()
        ids = [n.id for n in store.tree_notifications(parked, 1, 10_000)]
        pre = Follower(store, catalog, batch_size=1)  # serve's follower, then restarted (empty cache)
        while pre.position < ids[-3]:
            pre.step()
        serving = Follower(store, catalog, batch_size=1)
        rebuilding = Follower(store, catalog, batch_size=1)
        done = threading.Event()
        done.set()
        rebuilding.rebuild(stop=done)  # `project --rebuild`: the reset, then ...
        real_write = serving.read_models.write

        def write(*args: Any, **kwargs: Any) -> Any:
            serving.read_models.write = real_write  # type: ignore[method-assign]
            while rebuilding.position < ids[-2]:  # ... the rebuild commits meanwhile
                rebuilding.step()
            return real_write(*args, **kwargs)

        serving.read_models.write = write  # type: ignore[method-assign]
        assert serving.step().events == 0  # lost the compare-and-set: nothing of it written
        assert serving.step().events == 1  # the parked run's last event, from the kept fold
        rebuilding.catch_up()
        sql = Sql(url)
        created = {str(t): int(c) for t, c in sql._run(f"SELECT tree_id, created_position FROM {RUNS}")}
        assert created[str(parked)] == ids[0] and created[str(first)] < ids[0]
        pending = sql._run(f"SELECT tree_id, created_position FROM {PENDING} ORDER BY created_position")
        assert [(str(t), int(c)) for t, c in pending] == [(str(first), created[str(first)]), (str(parked), ids[0])]
        # As one fresh follower writes them.
        before = sql._run(f"SELECT tree_id, created_position, body FROM {PENDING} ORDER BY tree_id")
        Follower(store, catalog).rebuild()
        assert sql._run(f"SELECT tree_id, created_position, body FROM {PENDING} ORDER BY tree_id") == before
    finally:
        store.close()


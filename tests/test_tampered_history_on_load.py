"""A missing, reordered or inserted event is reported where it is found by every load, not
only by ``agentfold audit verify`` (docs/guarantees.md "History is tamper-evident").

The tampering is plain SQL on the events table of a real store (SQLite file, PostgreSQL).
Each stored row is left intact; only their set or order changes, which a check of each
row's bytes alone would not see. Then the store is opened as a user would: ``EventStore.load``
(what the runtime and every command fold) and ``agentfold show``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import CorruptStream, EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.ids import TreeID
from tests.audit.support import Sql
from tests.kernel_programs import chain_program
from tests.test_cli import agentfold


def missing(sql: Sql, tree_id: TreeID) -> int:
    sql.delete(tree_id, 4)
    return 4  # the chain breaks at the row after the gap: its position follows no event 4


def reordered(sql: Sql, tree_id: TreeID) -> int:
    rows = {v: (t, s) for v, t, s in sql.raw_rows(tree_id)}
    sql.set_row(tree_id, 4, *rows[5])
    sql.set_row(tree_id, 5, *rows[4])
    return 4


def inserted(sql: Sql, tree_id: TreeID) -> int:
    rows = sql.raw_rows(tree_id)
    last = rows[-1][0]
    for version, topic, state in reversed(rows[4:]):  # make room after position 4
        sql.delete(tree_id, version)
        sql.insert(tree_id, version + 1, topic, state)
    _, topic, state = rows[1]
    sql.insert(tree_id, 5, topic, state)  # a copy of an earlier, valid event
    assert sql.raw_rows(tree_id)[-1][0] == last + 1
    return 5


TAMPERING: dict[str, Callable[[Sql, TreeID], int]] = {"missing": missing, "reordered": reordered, "inserted": inserted}


@pytest.mark.parametrize("how", list(TAMPERING))
def test_a_load_reports_a_missing_reordered_or_inserted_event_at_its_position(
    durable_store_url: str, how: str, tmp_path: Path
) -> None:
    program = chain_program(name="tamper.chain")
    with Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0, snapshot_every=0) as runtime:
        handle = runtime.start(program, {"n": 3}, start_id="tamper-1")
        assert handle.result(timeout=30).status == "completed"
    tree_id = handle.tree_id
    sql = Sql(durable_store_url)
    assert len(sql.raw_rows(tree_id)) > 8
    position = TAMPERING[how](sql, tree_id)

    store = EventStore(durable_store_url)
    try:
        with pytest.raises(CorruptStream) as loaded:
            store.load(tree_id)
        assert loaded.value.code == "store.corrupt"
        assert loaded.value.position == position, loaded.value
    finally:
        store.close()
    shown = agentfold("show", str(tree_id), "--json", store=durable_store_url)
    assert shown.code == 1, shown
    error = shown.error()
    assert error["code"] == "store.corrupt" and f"at position {position}" in error["message"], error

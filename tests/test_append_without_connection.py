"""An append that gets no PostgreSQL connection within ``AGENTFOLD_PG_POOL_WAIT`` is
``store.unavailable`` (nothing was sent), not ``store.append_failed`` with a hint to free disk
space (found by an operations review: a `resolve` during a PostgreSQL outage said so)."""

from __future__ import annotations

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import RandomIds, index_head, utc_now
from agentfold.domain.errors import StoreFailure
from agentfold.domain.ids import StartID, TreeID
from agentfold.domain.kernel import Kernel, start_tree
from agentfold.domain.requests import Settlement
from agentfold.domain.tree import TreeState
from tests.kernel_programs import chain_program


def test_an_append_without_a_pooled_connection_is_store_unavailable_and_stores_nothing(
    pg_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTFOLD_PG_POOL_WAIT", "1")
    program = chain_program(lambda request, context: Settlement.succeeded({"value": 1}), name="test.no_connection")
    resolve = Catalog([program]).resolve
    ids = RandomIds()
    sid = StartID("no-connection")
    tree_id = TreeID.for_start(sid)
    started = start_tree(program, {"n": 1}, start_id=sid, root_id=ids.root_process_id(),
                         incarnation_id=ids.incarnation_id(), configuration=program.configuration)
    tree = TreeState(resolve)
    tree.apply(started)
    events = [started, *Kernel(tree, resolve, ids).advance().events]
    store = EventStore(pg_database)
    pool = store.factory.datastore.pool
    held = []
    try:
        # Every connection the pool may hand out is busy (a real exhausted pool, as during an
        # outage no new one can be made): the append waits its second and gets none.
        while len(held) < pool.max_size:
            held.append(pool.getconn())
        now = utc_now()
        with pytest.raises(StoreFailure) as failed:
            store.append(tree_id, 0, events, previous_digest=None, timestamp=now,
                         head=index_head(tree, tree_id, events, now))
        assert failed.value.code == "store.unavailable", failed.value
        assert "no PostgreSQL connection within 1 s" in failed.value.message
        assert f"append to tree {tree_id} failed" in failed.value.message
        assert "nothing was sent" in (failed.value.hint or "") and "disk" not in (failed.value.hint or "")
    finally:
        for conn in held:
            pool.putconn(conn)
    assert store.read(tree_id) == []  # nothing was stored
    store.close()

"""``EventStore.changes``: which trees the events after a notification id belong to, read
without the events' states (what a reader uses to find the trees its read models lag behind).
It must say exactly what the notification log says, on every store."""

from __future__ import annotations

import uuid

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import Changed, EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.ids import TreeID
from agentfold.domain.requests import Settlement
from tests.kernel_programs import chain_program


def two_finished_chains(store: EventStore, name: str, effects: int) -> None:
    """Two finished runs (start ids ``one`` and ``two``) of a chain of ``effects`` Effects."""
    program = chain_program(lambda request, context: Settlement.succeeded({"value": 1}), name=name)
    with Runtime(store, Catalog([program])) as runtime:
        for start in ("one", "two"):
            runtime.start(program, {"n": effects}, start_id=start).result(timeout=30)


def test_changes_name_the_trees_and_positions_of_the_notification_log(store_url: str) -> None:
    store = EventStore(store_url)
    try:
        two_finished_chains(store, "test.changes", 3)
        log = [(n.id, TreeID.from_uuid(uuid.UUID(str(n.originator_id))), n.originator_version)
               for n in store.notifications(0, 10_000)]
        head = store.max_notification_id()
        assert log[-1][0] == head

        def expected(after: int, upto: int, limit: int = 10_000) -> set[Changed]:
            window = [c for c in log if after < c[0] <= upto][:limit]
            trees = {tree for _, tree, _ in window}
            return {Changed(tree, min(n for n, t, _ in window if t == tree), min(p for _, t, p in window if t == tree),
                            max(p for _, t, p in window if t == tree), max(n for n, t, _ in window if t == tree))
                    for tree in trees}

        middle = log[len(log) // 2][0]
        for after, upto, limit in ((0, head, 10_000), (middle, head, 10_000), (0, middle, 10_000), (0, head, 3),
                                   (middle - 2, head, 4)):
            assert set(store.changes(after, upto, limit)) == expected(after, upto, limit), (after, upto, limit)
        assert {c.tree_id for c in store.changes(0, head)} == {TreeID.for_start("one"), TreeID.for_start("two")}  # type: ignore[arg-type]
        assert all(c.low == 1 for c in store.changes(0, head))
        assert store.changes(head, head) == []
    finally:
        store.close()

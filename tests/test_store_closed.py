"""A closed EventStore refuses every later use with ``store.closed`` (every backend).

eventsourcing's own ConnectionPoolClosedError (no message, no code) used to escape from a
closed SQLite or PostgreSQL store, and a closed memory store went on working; an embedding
service that closed a store under a live Runtime got an unclassified failure, or none.
"""

from __future__ import annotations

import time

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import StoreFailure
from agentfold.domain.ids import TreeID
from tests.kernel_programs import chain_program


def test_every_use_of_a_closed_store_is_refused_as_store_closed(store_url: str) -> None:
    program = chain_program()
    store = EventStore(store_url)
    runtime = Runtime(store, Catalog([program]))
    try:
        assert runtime.start(program, {"n": 2}, start_id="before").result(timeout=30).status == "completed"
        # A finished run's owner line lets the tree go just after result() returns; until then
        # capture answers from the line's memory, not from the store.
        deadline = time.monotonic() + 10
        while runtime.drives(TreeID.for_start("before")) and time.monotonic() < deadline:  # type: ignore[arg-type]
            time.sleep(0.01)
    finally:
        store.close()
    tree = TreeID.for_start("before")
    uses = {
        "heads": store.heads,
        "read": lambda: store.read(tree),
        "load": lambda: store.load(tree),
        "leases": store.leases,
        "notifications": lambda: store.notifications(0),
        "a start through a runtime": lambda: runtime.start(program, {"n": 1}, start_id="after"),
        "a tree captured from the store": lambda: runtime.capture(tree),
        # Host questions go through the read models (SQLite, PostgreSQL) or the fold (memory).
        "Host.pending": Host(runtime).pending,
        "Host.unknown": Host(runtime).unknown,
        "Host.runs": Host(runtime).runs,
    }
    for name, use in uses.items():
        with pytest.raises(StoreFailure) as refused:
            use()
        assert refused.value.code == "store.closed", name
        assert "was closed by this process" in refused.value.message and refused.value.hint, name
    runtime.close()
    store.close()  # closing again is harmless

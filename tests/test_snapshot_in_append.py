"""Snapshots are written by the owner's append itself, in the same transaction as its events.

On every store: when the append that makes a snapshot due returns, the snapshot of exactly
that version is stored (it is never behind or ahead of its events, and no second writer
competes with the owner for the store); the tree keeps one snapshot row; its digest is the
stored event's; and loading from it gives the tree that folding every event gives.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import orjson

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.codec import stored_json
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.events import TreeEvent
from agentfold.domain.ids import TreeID
from tests.kernel_programs import chain_program

EVERY = 10
EFFECTS = 40  # 161 events: snapshots at about every 10 events, each replacing the one before


def _snapshot_versions(store: EventStore, tree_id: TreeID) -> list[int]:
    return [row.originator_version for row in store.snapshots.select_events(tree_id.uuid)]


def test_each_snapshot_is_stored_by_the_append_that_makes_it_due(store_url: str) -> None:
    store = EventStore(store_url)
    program = chain_program(name="test.snapshots")
    catalog = Catalog([program])
    seen: list[tuple[int, list[int]]] = []  # (stored version after an append, snapshot versions then)
    lock = threading.Lock()
    original = store.append

    def append(tree_id: TreeID, expected: int, events: Sequence[TreeEvent], **kwargs: Any) -> Any:
        result = original(tree_id, expected, events, **kwargs)
        with lock:
            seen.append((expected + len(events), _snapshot_versions(store, tree_id)))
        return result

    store.append = append  # type: ignore[method-assign]
    with Runtime(store, catalog, snapshot_every=EVERY) as runtime:
        handle = runtime.start(program, {"n": EFFECTS}, start_id="snapshots")
        assert handle.result(timeout=30).status == "completed"
    tree_id = handle.tree_id
    versions_after = [version for version, _ in seen]
    snapshots = sorted({v for _, rows in seen for v in rows})
    assert len(snapshots) >= 10, f"expected a snapshot about every {EVERY} events, saw {snapshots}"
    for version, rows in seen:
        # At most one row per tree, never ahead of what is stored ...
        assert len(rows) <= 1 and all(v <= version for v in rows), (version, rows)
    for snapshot in snapshots:
        # ... and each one taken at an append boundary, present when that very append returned.
        assert snapshot in versions_after
        assert (snapshot, [snapshot]) in seen, f"the snapshot at {snapshot} was not stored by its append"

    (row,) = store.snapshots.select_events(tree_id.uuid)
    body = orjson.loads(stored_json(row.state))
    (event,) = store.read(tree_id, after=row.originator_version - 1, upto=row.originator_version, verify=False)
    assert body["digest"] == event.digest
    from_snapshot = store.load(tree_id, catalog.resolve)
    folded = store.load(tree_id, catalog.resolve, use_snapshot=False)
    assert from_snapshot.snapshot_version == row.originator_version > 0
    assert from_snapshot.state.to_json() == folded.state.to_json()
    assert from_snapshot.digest == folded.digest
    store.close()


def test_a_large_snapshot_is_written_after_its_append_off_the_owner_line(store_url: str, monkeypatch: Any) -> None:
    """A snapshot larger than INLINE_SNAPSHOT_BYTES (here: any) comes back from the append and is
    deflated and stored by the runtime afterwards; it is as good as one written inline."""
    import agentfold.adapters.eventstore

    monkeypatch.setattr(agentfold.adapters.eventstore, "INLINE_SNAPSHOT_BYTES", 0)
    store = EventStore(store_url)
    program = chain_program(name="test.snapshots.large")
    catalog = Catalog([program])
    deferred: list[int] = []
    original = store.append

    def append(tree_id: TreeID, expected: int, events: Sequence[TreeEvent], **kwargs: Any) -> Any:
        result = original(tree_id, expected, events, **kwargs)
        if result.snapshot_body is not None:
            deferred.append(expected + len(events))
        return result

    store.append = append  # type: ignore[method-assign]
    with Runtime(store, catalog, snapshot_every=EVERY) as runtime:
        handle = runtime.start(program, {"n": EFFECTS}, start_id="large-snapshots")
        assert handle.result(timeout=30).status == "completed"
    # closing the runtime waits for the snapshot writer
    assert len(deferred) >= 10
    rows = store.snapshots.select_events(handle.tree_id.uuid)
    assert [row.originator_version for row in rows] == [deferred[-1]]
    from_snapshot = store.load(handle.tree_id, catalog.resolve)
    folded = store.load(handle.tree_id, catalog.resolve, use_snapshot=False)
    assert from_snapshot.snapshot_version == deferred[-1]
    assert from_snapshot.state.to_json() == folded.state.to_json()
    store.close()

"""Mutation audit of the PostgreSQL recorders (agentfold/adapters/recorders_postgres.py): each
test here fails with a planted bug the rest of the suite let through (named in its docstring).

The reconnection pauses and the rate-limited pool log are checked on the objects the store
installs on its pool, with an injected clock (no outage to wait for); the reads of the log
run on SQLite and a fresh PostgreSQL database.
"""

from __future__ import annotations

import logging
import types
import uuid as _uuid
from pathlib import Path

import pytest

from agentfold.adapters import recorders_postgres
from agentfold.adapters.recorders_postgres import PG_RECONNECT_EVERY, _EveryThirtySeconds, _SteadyReconnect


def test_reconnection_attempts_after_a_long_outage_come_every_two_seconds_not_doubling() -> None:
    """Mutant M17 (``_SteadyReconnect.update_delay`` without its cap: psycopg_pool's doubling
    pauses, 1, 2, 4 ... 64 s). docs: the pool tries to replace a lost connection every
    ~2 s, so requests succeed again within seconds of PostgreSQL coming back, after an outage
    of any length (a minute's outage left ``GET /health`` 503 for 51 s after the server was back)."""
    attempt = _SteadyReconnect(timeout=300.0)
    now, pauses = 0.0, []
    for _ in range(12):  # ~25 s of outage with a pause of 2 s, or ~1 hour doubling
        attempt.update_delay(now)
        pauses.append(attempt.delay)
        now += attempt.delay
    assert max(pauses) <= PG_RECONNECT_EVERY * 1.2, pauses
    # Still a pause between attempts (no busy loop against a server that is down), jittered
    # so that processes that lost the server together do not reconnect in step.
    assert min(pauses[2:]) >= PG_RECONNECT_EVERY * 0.8, pauses
    assert len(set(pauses[2:])) > 1, pauses


def _pool_warning(message: str) -> logging.LogRecord:
    return logging.LogRecord("psycopg.pool", logging.WARNING, __file__, 1, message, None, None)


def test_connection_failure_warnings_are_let_through_once_per_thirty_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant M18 (``_EveryThirtySeconds.filter`` letting every "error connecting in" warning
    through). During an outage psycopg_pool logs one per failed attempt (every 2 s per lost
    connection): the log gets one every 30 s, and every other pool message as it is."""
    clock = [1000.0]
    monkeypatch.setattr(recorders_postgres, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    only = _EveryThirtySeconds()
    failed = "error connecting in 'pool-1': connection refused"
    seen = []
    for _ in range(31):  # an attempt every 2 s for a minute
        seen.append(only.filter(_pool_warning(failed)))
        assert only.filter(_pool_warning("some other pool message"))
        clock[0] += 2.0
    assert seen.count(True) == 3, seen  # at 0 s, 30 s and 60 s
    assert [i for i, let in enumerate(seen) if let] == [0, 15, 30]


def test_the_raw_and_per_tree_reads_of_the_log_say_what_the_notification_log_says(durable_store_url: str) -> None:
    """Mutants M7 (``select_raw_notifications``: ``notification_id >= after``, the row at
    ``after`` read again) and M9 (``select_position_before``: ``notification_id <= n``, the
    event at ``n`` counted as before it). The publisher reads ``raw_notifications`` in place
    of ``notifications`` when a row cannot be decoded (it would publish the event at its
    position twice) and ``tree_position_before`` to find where a held tree resumes (it would
    skip an event): both must say exactly what the notification log says (SQLite and PostgreSQL; the memory
    store has no raw rows)."""
    from agentfold.adapters.eventstore import EventStore
    from agentfold.domain.ids import TreeID
    from tests.test_store_changes import two_finished_chains

    store = EventStore(durable_store_url)
    try:
        two_finished_chains(store, "test.rawlog", 2)
        log = [(n.id, _uuid.UUID(str(n.originator_id)), n.originator_version, n.topic)
               for n in store.notifications(0, 10_000)]
        assert len(log) >= 4
        for after in (0, log[0][0], log[len(log) // 2][0], log[-2][0], log[-1][0]):
            raw = [(n.id, _uuid.UUID(str(n.originator_id)), n.originator_version, n.topic)
                   for n in store.raw_notifications(after, 3)]
            assert raw == [row for row in log if row[0] > after][:3], after
        for tree in (TreeID.for_start("one"), TreeID.for_start("two")):
            rows = [row for row in log if row[1] == tree.uuid]
            for n, _, version, _ in rows:
                assert store.tree_position_before(tree, n) == version - 1, (tree, n)
            assert store.tree_position_before(tree, log[-1][0] + 1) == rows[-1][2]
            assert [n.originator_version for n in store.tree_notifications(tree, 2, 2)] == [2, 3]
    finally:
        store.close()


def test_an_append_refused_as_a_version_conflict_stores_and_prunes_no_snapshot(
    durable_store_url: str, tmp_path: Path
) -> None:
    """Mutant M24 (PostgreSQL ``insert_events``: the snapshot statements outside the append's
    transaction). A snapshot is saved "in the same transaction" as its append
    (``EventStore.append``): a writer that lost the race for the tree's next position must
    leave the snapshots as they were, not store its own state at a position another writer's
    event holds (and prune the tree's older snapshot for it)."""
    from agentfold.adapters.catalog import Catalog
    from agentfold.adapters.eventstore import EventStore, VersionConflict
    from agentfold.domain.events import ControlRequested
    from tests.test_mutants_store import NOW, pause_after
    from tests.test_tampered_history_on_load import parked_in_flight

    tree_id, _, program, last = parked_in_flight(durable_store_url, tmp_path)
    store = EventStore(durable_store_url)
    try:
        whole, pause, head = pause_after(store, tree_id, program, last)
        store.append(tree_id, last, [pause], previous_digest=whole.digest, timestamp=NOW, head=head)  # the winner
        after = store.load(tree_id, Catalog([program]).resolve)
        assert after.state.version == last + 1
        snapshots = [(r.originator_version, r.state) for r in store.snapshots.select_events(tree_id.uuid)]
        late = ControlRequested(process_id=whole.state.root.process_id, control="pause", reason="the loser")
        with pytest.raises(VersionConflict):
            store.append(tree_id, last, [late], previous_digest=whole.digest, timestamp=NOW, head=head,
                         snapshot=after.state)
        assert [(r.originator_version, r.state) for r in store.snapshots.select_events(tree_id.uuid)] == snapshots
        reloaded = store.load(tree_id, Catalog([program]).resolve)
        assert (reloaded.digest, reloaded.snapshot_version) == (after.digest, after.snapshot_version)
    finally:
        store.close()

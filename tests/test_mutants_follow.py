"""The read-model follower as ``project`` and ``serve`` run it side by side: behaviour the mutation
audit of the follower (2026-12-05, "follow") found undefended.

docs/read-models.md promises that a corrupt tree is recorded, skipped, and reported **once**, when
the batch that records it commits, and that several followers on one store take turns (a batch
read from a position another follower has committed past since writes nothing). The existing
tests run one follower at a time against a corrupt tree, or two followers against healthy
trees; these run two real followers, in this process, on a real SQLite file with one tree
damaged with plain SQL, and look at what each one reports and what the tables hold.
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.follower import Follower, follow_until_stopped
from agentfold.adapters.read_models import CorruptTree, ReadModels
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.sources import default_sources
from agentfold.domain.ids import TreeID
from tests.test_corrupt_tree_listings import corrupt
from tests.test_mutants_reads import start_waiting


def damaged_store(store: EventStore) -> tuple[str, str]:
    """A store with a run "bad", damaged at its first event (its later events still stored, after
    it in the log), and a healthy run "ok" started after it: (bad's tree id, ok's tree id)."""
    catalog = default_sources().catalog()
    with Runtime(store, catalog, poll_interval=0) as runtime:
        bad = start_waiting(runtime, 1, "bad")
        ok = start_waiting(runtime, 1, "ok")
    assert corrupt(store.url, bad, 1) == 1
    return bad, ok


def test_a_corrupt_tree_another_follower_recorded_is_not_reported_again_by_a_follower_that_lost_its_turn(
    store: EventStore,
) -> None:
    """Mutants (follower.py ``step``): on a lost compare-and-set, keep the corrupt trees known
    before it instead of reading them from the tables again; or report a corrupt tree before the
    batch that records it commits. ``serve``'s follower records a corrupt tree; ``project``
    (started before, so it read an empty list of corrupt trees) loses its turn with the batch
    that found it too, goes on from the committed position, and met the tree's later events:
    it reported the tree a second time (an extra stderr line and exit 1 for ``project``) although
    its batches recorded nothing new. Reported once, by the follower whose batch recorded it."""
    bad, ok = damaged_store(store)
    catalog = default_sources().catalog()
    said_late: list[CorruptTree] = []
    said_first: list[CorruptTree] = []
    late = Follower(store, catalog, on_corrupt=said_late.append)  # reads position 0, no corrupt tree
    first = Follower(store, catalog, batch_size=1, on_corrupt=said_first.append)
    report = first.step()  # commits bad's first event only: bad recorded at position 1
    assert [c.tree_id for c in report.corrupt] == [bad] and report.position == 1

    late.catch_up()  # its first batch (from 0) loses its turn; then from 1: bad's later events, ok's

    assert [c.tree_id for c in said_first] == [bad]
    assert said_late == [] and late.corrupt_found == []
    models = ReadModels(store)
    assert models.position() == late.position == store.max_notification_id()
    assert [c.tree_id for c in models.corrupt_trees()] == [bad]
    assert [r["tree_id"] for r in models.runs()] == [ok]
    head = store.head(TreeID(ok))
    assert head is not None and models.counters() == {ok: (head.version, head.version)}


class FailsOnce(ReadModels):
    """The tables of a database that fails one batch's commit (a locked file, a server restart)."""

    def __init__(self, store: EventStore, fail_at: int) -> None:
        super().__init__(store)
        self.calls = 0
        self.fail_at = fail_at

    def write(self, *args: Any, **kwargs: Any) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise sqlite3.OperationalError("database is locked")
        super().write(*args, **kwargs)


def test_project_follow_reports_every_event_it_applied_across_failed_batches_and_their_retries(
    store: EventStore,
) -> None:
    """Mutants (follower.py ``FollowProgress.following``: the events of the followers before the
    current one not added, or the last one's count replacing the others'). ``project --follow``
    commits a batch, the database fails the next one, a new follower goes on from the committed
    position, and so again: its final report (and the one printed at the last resort) said only
    the events of the last follower or two. Each event is counted once: a failed batch's not at
    all, its retry's once."""
    catalog = default_sources().catalog()
    with Runtime(store, catalog, poll_interval=0) as runtime:
        for i in range(3):
            start_waiting(runtime, 1, f"run-{i}")
    end = store.max_notification_id()
    assert end > 9
    first = Follower(store, catalog, FailsOnce(store, fail_at=2), batch_size=3, poll_interval=0.01)
    made: list[Follower] = []

    def make() -> Follower:
        # The second follower meets the failure again after one batch; the third does not.
        models = FailsOnce(store, fail_at=2 if not made else 0)
        made.append(Follower(store, catalog, models, batch_size=3, poll_interval=0.01))
        return made[-1]

    stop = threading.Event()
    said: list[str] = []

    def stop_when_current() -> None:
        models = ReadModels(store)
        while models.position() < end and not stop.wait(0.01):
            pass
        stop.set()

    watcher = threading.Thread(target=stop_when_current, daemon=True)
    watcher.start()
    report = follow_until_stopped(make, stop, said.append, first=first, backoff=0.01, max_backoff=0.01)
    watcher.join(5)
    assert (report.events, report.position, report.failures) == (end, end, 2), said
    failed = "following failed: OperationalError: database is locked; retrying in 0.01 s"
    assert said == [failed, "following again from position 3", failed, "following again from position 6"]
    models = ReadModels(store)
    assert models.position() == end
    counters = models.counters()
    assert len(counters) == 3 and all(version == applied for version, applied in counters.values())

"""Mutation audit of the event store (adapters/eventstore.py, recorders*.py, codec.py): each
test here fails with a planted bug the rest of the suite let through (named in its docstring).

They drive the store through its own API on real SQLite files and PostgreSQL databases, and
look at what is stored with plain SQL (``tests.audit.support.Sql``), as an operator would.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from eventsourcing.persistence import StoredEvent

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.codec import TOPIC_PREFIX, DecodeError, OrjsonTranscoder, PydanticMapper
from agentfold.adapters.eventstore import CorruptStream, EventStore, VersionConflict
from agentfold.adapters.runtime import Runtime, index_head
from agentfold.domain.events import ControlRequested
from agentfold.domain.integrity import chain_digest, content_bytes, seal
from tests.audit.support import Sql, digest_of_state
from tests.kernel_programs import chain_program
from tests.test_cli import agentfold
from tests.test_tampered_history_on_load import parked_in_flight

NOW = "2026-12-01T00:00:00Z"


def pause_after(store: EventStore, tree_id: Any, program: Any, last: int) -> tuple[Any, ControlRequested, Any]:
    """The tree as loaded, a host's pause to append after its ``last`` event, and that append's index row."""
    whole = store.load(tree_id, Catalog([program]).resolve)
    pause = ControlRequested(process_id=whole.state.root.process_id, control="pause", reason="hold")
    # The row as a writer stores it: of the tree with the pause applied (loads compare it with the fold).
    ahead = store.load(tree_id, Catalog([program]).resolve).state
    ahead.apply(pause)
    return whole, pause, index_head(ahead, tree_id, [pause], NOW)


def test_a_retry_after_a_lost_reply_is_acknowledged_with_the_same_digest_and_writes_nothing(
    durable_store_url: str, tmp_path: Path
) -> None:
    """Mutant M3 (eventstore.py ``append``: the very same events at the head, found by
    ``_already_stored``, raised VersionConflict instead of being acknowledged).
    docs/guarantees.md: "If the very same events (same bytes, same digests) are already the
    head of the stream, the append is acknowledged without writing anything twice"."""
    tree_id, _, program, last = parked_in_flight(durable_store_url, tmp_path)
    store = EventStore(durable_store_url)
    sql = Sql(durable_store_url)
    try:
        whole, pause, head = pause_after(store, tree_id, program, last)
        first = store.append(tree_id, last, [pause], previous_digest=whole.digest, timestamp=NOW, head=head)
        stored = (sql.raw_rows(tree_id), sql.head(tree_id), store.max_notification_id())
        # The reply was lost: the writer sends the very same append again.
        again = store.append(tree_id, last, [pause], previous_digest=whole.digest, timestamp=NOW, head=head)
        assert again.digest == first.digest
        assert (sql.raw_rows(tree_id), sql.head(tree_id), store.max_notification_id()) == stored
        assert sql.head(tree_id) == (last + 1, first.digest)
    finally:
        store.close()


def test_a_retry_whose_events_are_no_longer_the_head_is_a_version_conflict(
    durable_store_url: str, tmp_path: Path
) -> None:
    """Mutant M1 (eventstore.py ``_already_stored``: the same events followed by others, a
    stale duplicate, acknowledged as an idempotent retry). docs/guarantees.md: acknowledged
    only when they "are already the head of the stream ... otherwise it is a conflict"."""
    tree_id, _, program, last = parked_in_flight(durable_store_url, tmp_path)
    store = EventStore(durable_store_url)
    sql = Sql(durable_store_url)
    try:
        whole, pause, head = pause_after(store, tree_id, program, last)
        root = whole.state.root.process_id
        first = store.append(tree_id, last, [pause], previous_digest=whole.digest, timestamp=NOW, head=head)
        resume = ControlRequested(process_id=root, control="resume", reason="go on")
        store.append(tree_id, last + 1, [resume], previous_digest=first.digest, timestamp=NOW,
                     head=index_head(whole.state, tree_id, [resume], NOW, version=last + 2))
        stored = (sql.raw_rows(tree_id), sql.head(tree_id))
        with pytest.raises(VersionConflict):  # a writer that retries the first append now
            store.append(tree_id, last, [pause], previous_digest=whole.digest, timestamp=NOW, head=head)
        assert (sql.raw_rows(tree_id), sql.head(tree_id)) == stored
    finally:
        store.close()


@pytest.mark.parametrize("row", ["whole row", "progress only"])
def test_an_append_onto_an_index_row_anchoring_another_digest_at_its_version_is_refused(
    durable_store_url: str, tmp_path: Path, row: str
) -> None:
    """Mutants M6 (recorders.py: SQLite's progress-only UPDATE of the index row not comparing
    its ``head_digest``) and M7 (recorders_postgres.py: the append function's UPDATE not
    comparing it). The row anchors the writer's version but another digest (the row or the
    event under it changed): appended anyway, the append rewrote the row and erased the
    evidence, and chained onto an end the row says is not the stored one."""
    tree_id, _, program, last = parked_in_flight(durable_store_url, tmp_path)
    store = EventStore(durable_store_url)
    sql = Sql(durable_store_url)
    try:
        whole = store.load(tree_id, Catalog([program]).resolve)
        pause = ControlRequested(process_id=whole.state.root.process_id, control="pause", reason="hold")
        stored = index_head(whole.state, tree_id, [], NOW).row_state if row == "progress only" else None
        head = index_head(whole.state, tree_id, [pause], NOW, version=last + 1, stored=stored)
        assert head.progress_only == (row == "progress only")
        # The row keeps its version but anchors the digest of the event before the end.
        sql.set_head(tree_id, last, digest_of_state(sql.state(tree_id, last - 1)))
        before = (sql.raw_rows(tree_id), sql.head(tree_id))
        with pytest.raises(CorruptStream) as refused:
            store.append(tree_id, last, [pause], previous_digest=whole.digest, timestamp=NOW, head=head)
        assert refused.value.rule == "index.head_mismatch"
        assert (sql.raw_rows(tree_id), sql.head(tree_id)) == before
    finally:
        store.close()


def test_a_load_whose_end_digest_is_not_the_one_the_index_row_anchors_is_refused(
    durable_store_url: str, tmp_path: Path
) -> None:
    """Mutant M8 (eventstore.py ``_check_anchor``: a stream that reaches the row's version
    with another digest there accepted). The row anchors version ``last`` with the digest of
    the event before it: the stream is not the one the row was written with, and agentfold
    "neither drives nor shows the tree from it" (load, ``show``, ``recover``)."""
    tree_id, log, program, last = parked_in_flight(durable_store_url, tmp_path)
    sql = Sql(durable_store_url)
    sql.set_head(tree_id, last, digest_of_state(sql.state(tree_id, last - 1)))
    store = EventStore(durable_store_url)
    try:
        with pytest.raises(CorruptStream) as loaded:
            store.load(tree_id, Catalog([program]).resolve)
        assert (loaded.value.rule, loaded.value.position) == ("index.head_mismatch", last)
    finally:
        store.close()
    shown = agentfold("show", str(tree_id), "--json", store=durable_store_url)
    assert shown.code == 1 and shown.error()["code"] == "store.corrupt", shown
    assert shown.error()["detail"]["rule"] == "index.head_mismatch"
    assert log.count() == 3


def test_an_event_changed_after_the_snapshot_a_load_starts_from_is_still_refused(tmp_path: Path) -> None:
    """Mutant M13 (eventstore.py ``load``: the tail after a snapshot read without verifying its
    chain). docs/events.md: the events after a snapshot are verified from the snapshot's
    digest. An event in that tail whose content was changed (its recorded digest kept) must
    fail the load at its position, as a full fold does; the row's end is untouched, so the
    index row comparison cannot see it."""
    url = f"sqlite:///{tmp_path / 'tail.db'}"
    program = chain_program(name="test.tail")
    catalog = Catalog([program])
    store = EventStore(url)
    try:
        with Runtime(store, catalog, poll_interval=0, snapshot_every=0) as runtime:
            handle = runtime.start(program, {"n": 3}, start_id="tail-1")
            assert handle.result(timeout=30).status == "completed"
        tree_id = handle.tree_id
        end = store.head(tree_id).version  # type: ignore[union-attr]
        at = 4
        upto = store.load(tree_id, catalog.resolve, upto=at, use_snapshot=False)
        store.save_snapshot(tree_id, upto.state, upto.digest)  # type: ignore[arg-type]
        assert store.load(tree_id, catalog.resolve).snapshot_version == at
        sql = Sql(url)
        changed = at + 2
        assert changed < end
        state = sql.state(tree_id, changed)
        recorded = digest_of_state(state)
        body = orjson.loads(b"{" + state[len(b'{"digest":"') + 71 + 2:])
        (topic,) = [t for v, t, _ in sql.rows(tree_id) if v == changed]
        sql.set_row(tree_id, changed, topic, seal(content_bytes(body["event"], "2031-01-01T00:00:00.000000Z"), recorded))
        for use_snapshot in (False, True):
            with pytest.raises(CorruptStream) as loaded:
                store.load(tree_id, catalog.resolve, use_snapshot=use_snapshot)
            assert (loaded.value.rule, loaded.value.position) == ("integrity.digest_chain", changed), use_snapshot
    finally:
        store.close()
    shown = agentfold("show", str(tree_id), "--json", store=url)
    assert shown.code == 1 and shown.error()["code"] == "store.corrupt", shown


def test_an_append_returns_the_notification_ids_its_events_are_stored_under(
    durable_store_url: str, tmp_path: Path
) -> None:
    """Mutant M14 (recorders.py ``_insert_rows``: the notification ids of a multi-row INSERT
    computed one off from SQLite's last rowid). ``EventStore.append`` answers the ids of the
    events it stored; they must be the ids the notification log (the feed) holds them under."""
    tree_id, _, program, last = parked_in_flight(durable_store_url, tmp_path)
    store = EventStore(durable_store_url)
    try:
        whole = store.load(tree_id, Catalog([program]).resolve)
        root = whole.state.root.process_id
        events = [ControlRequested(process_id=root, control="pause", reason=f"hold {i}") for i in range(3)]
        before = store.max_notification_id()
        result = store.append(tree_id, last, events, previous_digest=whole.digest, timestamp=NOW,
                              head=index_head(whole.state, tree_id, events, NOW, version=last + 3))
        logged = [(n.id, n.originator_version) for n in store.notifications(before)]
        assert logged == [(i, v) for i, v in zip(result.notification_ids, range(last + 1, last + 4), strict=True)]
    finally:
        store.close()


def decode_refused(tree_id: str, tag: str, content: bytes) -> DecodeError:
    """Decode ``content``, stored as the first event of ``tree_id`` under topic ``tag`` and
    correctly chained, as every load does; the refusal it must meet."""
    stored_event = StoredEvent(uuid.UUID(int=1), 1, TOPIC_PREFIX + tag,
                               seal(content, chain_digest(None, tree_id, 1, tag, content)))
    with pytest.raises(DecodeError) as caught:
        PydanticMapper(OrjsonTranscoder()).decode(tree_id, stored_event, None)
    return caught.value


def test_an_event_of_a_schema_version_from_a_later_release_is_refused_as_an_unknown_version() -> None:
    """Mutant M18 (codec.py ``decode``: the topic's schema version accepted up to one past the
    newest this release knows). docs/events.md: decoding "refuses a version it does not know
    (``stream.schema_version``)". A later release's ProcessTerminated@3 carries a member this
    release has no field for: it must be named an unknown version (upgrade), not an invalid
    event (a corrupt history)."""
    from agentfold.domain.events import EVENT_VERSIONS

    newest = EVENT_VERSIONS["ProcessTerminated"]
    tree_id, tag = "tree:00000000000000000000000000000001", f"ProcessTerminated@{newest + 1}"
    body = {"process_id": "process:" + "1" * 32, "status": "completed", "cause": "completion",
            "output": {"ok": True}, "a_later_member": {"kept": 1}}
    content = content_bytes(body, "2026-01-01T00:00:00.000000Z")
    caught = decode_refused(tree_id, tag, content)
    assert (caught.rule, caught.position) == ("stream.schema_version", 1), str(caught)


def test_a_first_append_onto_a_tree_whose_index_row_remains_is_refused_and_writes_nothing(
    durable_store_url: str, tmp_path: Path
) -> None:
    """Mutants M22 (recorders_postgres.py: the append function's INSERT of the first index row
    overwrote a row already there) and M35 (recorders.py: SQLite's). Every event of the tree
    was deleted, and its process rows; its index row, which proves the history existed, remains. A writer that
    starts the tree again at version 0 must be refused, not re-create the history over the
    evidence (docs/guarantees.md: an append happens at an expected version)."""
    tree_id, _, program, last = parked_in_flight(durable_store_url, tmp_path)
    store = EventStore(durable_store_url)
    sql = Sql(durable_store_url)
    try:
        whole = store.load(tree_id, Catalog([program]).resolve)
        first = [record.event for record in store.read(tree_id, upto=1)]
        sql.delete(tree_id, *range(1, last + 1))
        # Its process rows too (else the first append's process row is what refuses it).
        sql._run("DELETE FROM agentfold_processes WHERE tree_id = ?", (str(tree_id),))
        before = (sql.raw_rows(tree_id), sql.head(tree_id), store.max_notification_id())
        assert before[0] == [] and before[1][0] == last
        with pytest.raises(CorruptStream) as refused:
            store.append(tree_id, 0, first, previous_digest=None, timestamp=NOW,
                         head=index_head(whole.state, tree_id, first, NOW, version=1))
        assert refused.value.rule == "index.head_mismatch"
        assert (sql.raw_rows(tree_id), sql.head(tree_id), store.max_notification_id()) == before
    finally:
        store.close()


def test_a_stored_state_with_a_member_besides_event_and_timestamp_is_refused() -> None:
    """Mutant M24 (integrity.py ``unseal``: members besides ``event`` and ``timestamp`` let
    through). docs/events.md: the state is canonical JSON of exactly three members. A state
    chained correctly but carrying one more member (data no writer stores, hidden in a row)
    must be ``integrity.format`` at its position, on every load, not only in an audit."""

    tree_id, tag = "tree:00000000000000000000000000000001", "ProcessTerminated"
    body = {"process_id": "process:" + "1" * 32, "status": "completed", "cause": "completion", "output": {"ok": True}}
    content = orjson.dumps({"event": body, "hidden": "x", "timestamp": "2026-01-01T00:00:00.000000Z"},
                           option=orjson.OPT_SORT_KEYS)
    caught = decode_refused(tree_id, tag, content)
    assert (caught.rule, caught.position) == ("integrity.format", 1), str(caught)


def test_a_postgresql_append_waits_for_an_earlier_uncommitted_append_so_ids_follow_commit_order(
    pg_database: str, tmp_path: Path
) -> None:
    """Mutant M25 (recorders_postgres.py: the append function without its ``LOCK TABLE``).
    Notification ids come from a sequence when a row is inserted; without the lock a later
    append on another tree commits a higher id while an earlier one is still open, and a
    follower that has read past that id never reads the earlier event (docs/read-models.md:
    every event once, in the log's order). Another session holds an append open: ours waits."""
    import threading

    import psycopg

    from agentfold.adapters.recorders import APPEND_FUNCTION

    tree_id, _, program, last = parked_in_flight(pg_database, tmp_path)
    store = EventStore(pg_database)
    try:
        whole, pause, head = pause_after(store, tree_id, program, last)
        done = threading.Event()

        def ours() -> None:
            store.append(tree_id, last, [pause], previous_digest=whole.digest, timestamp=NOW, head=head)
            done.set()

        with psycopg.connect(pg_database) as other:  # a transaction: open until rolled back
            other.execute(f"SELECT * FROM {APPEND_FUNCTION}(%s, %s, %s, %s, NULL, %s)",
                          (uuid.uuid4(), [1], ["domain.events:TreeStarted"], [b"{}"], []))
            writer = threading.Thread(target=ours, daemon=True)
            writer.start()
            assert not done.wait(2.0), "an append committed while an earlier one held its notification ids open"
            other.rollback()
        assert done.wait(20)
        writer.join(5)
        assert [n.originator_version for n in store.notifications(0)][-1] == last + 1
    finally:
        store.close()


def test_a_retry_whose_stored_events_are_damaged_is_not_acknowledged(durable_store_url: str, tmp_path: Path) -> None:
    """Mutant M30 (eventstore.py ``_already_stored``: a stored head row that cannot be read
    taken for the writer's own events). Only the very same bytes are an idempotent retry: a
    damaged row at those positions is a conflict, never acknowledged as stored."""
    tree_id, _, program, last = parked_in_flight(durable_store_url, tmp_path)
    store = EventStore(durable_store_url)
    sql = Sql(durable_store_url)
    try:
        whole, pause, head = pause_after(store, tree_id, program, last)
        store.append(tree_id, last, [pause], previous_digest=whole.digest, timestamp=NOW, head=head)
        (topic,) = [t for v, t, _ in sql.raw_rows(tree_id) if v == last + 1]
        sql.set_row(tree_id, last + 1, topic, b"\x01not deflate")
        with pytest.raises(VersionConflict):
            store.append(tree_id, last, [pause], previous_digest=whole.digest, timestamp=NOW, head=head)
    finally:
        store.close()

"""A missing, reordered or inserted event is reported where it is found by every load, not
only by ``agentfold audit verify`` (docs/guarantees.md "History is tamper-evident").

The tampering is plain SQL on the events table of a real store (SQLite file, PostgreSQL).
Each stored row is left intact; only their set or order changes, which a check of each
row's bytes alone would not see. Then the store is opened as a user would: ``EventStore.load``
(what the runtime and every command fold) and ``agentfold show``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import CorruptStream, EventStore, VersionConflict
from agentfold.adapters.runtime import Runtime, index_head
from agentfold.domain.events import ControlRequested, EffectSettled
from agentfold.domain.ids import TreeID
from agentfold.domain.program import Program
from agentfold.domain.requests import Settlement
from tests.audit.support import Sql
from tests.kernel_programs import CallLog, GatedCall, chain_program
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


def parked_in_flight(url: str, tmp_path: Path) -> tuple[TreeID, CallLog, Program, int]:
    """A chain whose third call was in flight when its owner stopped (the stream ends with
    that call's dispatch permission, as after a crash): the tree, its call log, its Program
    and the stream's last position."""
    log = CallLog(tmp_path / "calls.jsonl")
    gate = GatedCall(log, at=2)
    program = chain_program(gate, name="tamper.cut")
    runtime = Runtime(EventStore(url), Catalog([program]), poll_interval=0, snapshot_every=0)
    handle = runtime.start(program, {"n": 3}, start_id="cut-1")
    assert gate.entered.wait(30)
    runtime.close()
    gate.release.set()
    rows = Sql(url).raw_rows(handle.tree_id)
    assert rows[-1][1].endswith(":EffectDispatched") and log.count() == 3
    return handle.tree_id, log, program, rows[-1][0]


def test_a_history_cut_at_its_end_is_refused_by_every_load_and_no_call_is_made_again(
    durable_store_url: str, tmp_path: Path
) -> None:
    # Found by a tamper audit: with its last event (the third call's dispatch permission)
    # deleted, the stream is a whole history of a tree whose third call was never permitted.
    # Loads used it: `recover` called the tool again, and its append rewrote the index row
    # that proved the cut, so `audit verify` said OK afterwards.
    tree_id, log, program, last = parked_in_flight(durable_store_url, tmp_path)
    sql = Sql(durable_store_url)
    sql.delete(tree_id, last)
    before = (sql.raw_rows(tree_id), sql.head(tree_id))

    store = EventStore(durable_store_url)
    try:
        with pytest.raises(CorruptStream) as loaded:
            store.load(tree_id)
        assert (loaded.value.rule, loaded.value.position) == ("index.head_mismatch", last)
        assert f"says version {last}" in loaded.value.message and f"ends at position {last - 1}" in loaded.value.message
        with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
            with pytest.raises(CorruptStream):
                runtime.recover(str(tree_id))
    finally:
        store.close()
    ran = agentfold("recover", "--json", store=durable_store_url)
    assert ran.code == 1, ran
    shown = agentfold("show", str(tree_id), "--json", store=durable_store_url)
    assert shown.code == 1 and shown.error()["code"] == "store.corrupt", shown
    assert log.count() == 3  # the cut-off call was not made again
    assert (sql.raw_rows(tree_id), sql.head(tree_id)) == before  # and the evidence is intact
    verified = agentfold("audit", "verify", str(tree_id), "--json", store=durable_store_url)
    assert verified.code == 1 and "index.head_mismatch" in verified.stdout


@pytest.mark.parametrize("row", ["whole row", "progress only"])
def test_an_append_onto_a_cut_history_is_refused_and_writes_nothing(
    durable_store_url: str, tmp_path: Path, row: str
) -> None:
    # The index row is compared in the append's own transaction, against the end the writer
    # loaded: a writer that read the stream before it was cut cannot chain onto the cut either
    # (whether its append rewrites the whole row or, in steady state, only its progress).
    tree_id, _, program, last = parked_in_flight(durable_store_url, tmp_path)
    store = EventStore(durable_store_url)
    sql = Sql(durable_store_url)
    try:
        before_cut = store.load(tree_id, Catalog([program]).resolve, upto=last - 1)
        assert before_cut.state.version == last - 1
        now = "2026-12-01T00:00:00Z"
        pause = ControlRequested(process_id=before_cut.state.root.process_id, control="pause", reason="hold")
        stored = index_head(before_cut.state, tree_id, [], now).row_state if row == "progress only" else None
        head = index_head(before_cut.state, tree_id, [pause], now, stored=stored)
        assert head.progress_only == (row == "progress only")

        def append() -> None:
            store.append(tree_id, last - 1, [pause], previous_digest=before_cut.digest, timestamp=now, head=head)

        with pytest.raises(VersionConflict):  # uncut, another writer's event holds the position
            append()
        sql.delete(tree_id, last)
        before = (sql.raw_rows(tree_id), sql.head(tree_id))
        with pytest.raises(CorruptStream) as refused:
            append()
        assert refused.value.rule == "index.head_mismatch" and refused.value.position == last
        assert (sql.raw_rows(tree_id), sql.head(tree_id)) == before
    finally:
        store.close()


def test_a_tree_whose_index_row_was_deleted_is_neither_shown_nor_driven(durable_store_url: str, tmp_path: Path) -> None:
    # Found by a review: with the row deleted too, a cut history had no anchor to compare
    # with; a pause and a resume drove it on (the cut-off call ran again) and their append
    # wrote a new row, after which `audit verify` said OK.
    tree_id, log, program, last = parked_in_flight(durable_store_url, tmp_path)
    sql = Sql(durable_store_url)
    store = EventStore(durable_store_url)
    try:
        whole = store.load(tree_id, Catalog([program]).resolve)
        root = whole.state.root.process_id
        sql._run("DELETE FROM agentfold_trees WHERE tree_id = ?", (str(tree_id),))
        # A writer that loaded before the row went: its append expects the row, and refuses its absence.
        pause = ControlRequested(process_id=root, control="pause", reason="hold")
        now = "2026-12-01T00:00:00Z"
        with pytest.raises(CorruptStream) as refused:
            store.append(tree_id, last, [pause], previous_digest=whole.digest, timestamp=now,
                         head=index_head(whole.state, tree_id, [pause], now))
        assert refused.value.rule == "index.head_mismatch" and "no row for this tree" in refused.value.message
        sql.delete(tree_id, last)  # and the history cut under it
        before = sql.raw_rows(tree_id)
        with pytest.raises(CorruptStream) as loaded:
            store.load(tree_id)
        assert loaded.value.rule == "index.head_mismatch" and "no row for this tree" in loaded.value.message
        with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
            for control in (runtime.pause, runtime.resume):
                with pytest.raises(CorruptStream):
                    control(root)
    finally:
        store.close()
    # Named by its tree id, the tree is refused as corrupt, not reported as one that does not exist.
    shown = agentfold("show", str(tree_id), "--json", store=durable_store_url)
    assert shown.code == 1, shown
    assert shown.error()["code"] == "store.corrupt"
    assert shown.error()["detail"] == {"tree_id": str(tree_id), "position": last - 1, "rule": "index.head_mismatch"}
    missing = agentfold("show", "tree:" + "0" * 32, "--json", store=durable_store_url)
    assert missing.code == 2 and missing.error()["code"] == "engine.tree.not_found"
    assert log.count() == 3 and sql.raw_rows(tree_id) == before
    assert not sql._run("SELECT 1 FROM agentfold_trees WHERE tree_id = ?", (str(tree_id),))


def test_a_postgresql_store_of_an_earlier_release_gets_the_checking_append_function(
    pg_database: str, tmp_path: Path
) -> None:
    # Found by a review: the function that compares the row was installed only by an open that
    # creates tables; commands that open an existing store (answer, recover, ...) kept calling
    # an earlier release's function, which writes the row without comparing it.
    tree_id, _, program, last = parked_in_flight(pg_database, tmp_path)
    sql = Sql(pg_database)
    sql._run("DROP FUNCTION agentfold_append_checked(uuid, bigint[], text[], bytea[], text[], text[])")
    store = EventStore(pg_database, create=False)
    try:
        before_cut = store.load(tree_id, Catalog([program]).resolve, upto=last - 1)
        sql.delete(tree_id, last)
        pause = ControlRequested(process_id=before_cut.state.root.process_id, control="pause", reason="hold")
        now = "2026-12-01T00:00:00Z"
        with pytest.raises(CorruptStream):
            store.append(tree_id, last - 1, [pause], previous_digest=before_cut.digest, timestamp=now,
                         head=index_head(before_cut.state, tree_id, [pause], now))
    finally:
        store.close()
    assert sql._run("SELECT 1 FROM pg_proc WHERE proname = 'agentfold_append_checked'")


def test_events_added_past_the_index_row_with_a_valid_chain_are_refused_by_loads(
    durable_store_url: str, tmp_path: Path
) -> None:
    # Found by a tamper audit: a forged settlement appended by hand, chained correctly but with
    # the index row left alone, was shown as the outcome of the call in flight, and the next
    # command drove the run on from it (its append then rewrote the row over the evidence).
    tree_id, log, program, last = parked_in_flight(durable_store_url, tmp_path)
    store = EventStore(durable_store_url)
    sql = Sql(durable_store_url)
    try:
        loaded = store.load(tree_id, Catalog([program]).resolve)
        (in_flight,) = loaded.state.root.in_flight()
        forged = EffectSettled(
            process_id=loaded.state.root.process_id, effect_id=in_flight.effect_id, status="succeeded",
            payload={"value": 1}, attempt_id=in_flight.attempt_id,
        )
        record, _ = store.mapper.encode(
            tree_id, tree_id.uuid, last + 1, forged, "2026-12-01T00:00:00Z", loaded.digest
        )
        sql.insert(tree_id, last + 1, record.topic, record.state)
        with pytest.raises(CorruptStream) as refused:
            store.load(tree_id, Catalog([program]).resolve)
        assert (refused.value.rule, refused.value.position) == ("index.head_mismatch", last + 1)
        assert "events were added past it" in refused.value.message
    finally:
        store.close()
    shown = agentfold("show", str(tree_id), "--json", store=durable_store_url)
    assert shown.code == 1 and shown.error()["code"] == "store.corrupt", shown
    assert log.count() == 3


def test_an_append_whose_new_process_is_indexed_already_is_refused_as_corrupt_and_writes_nothing(
    durable_store_url: str, tmp_path: Path
) -> None:
    # Found by a tamper audit: a history cut back before a child was created, with its index
    # row rewritten to match, verified OK; re-driving it created the child again under the same
    # deterministic id, and the process index's stale row refused every append as
    # store.append_failed (an outage: the runtime retried it for good). The refusal is now
    # store.corrupt (index.process_mismatch), which no retry is made for.
    tree_id, _, program, last = parked_in_flight(durable_store_url, tmp_path)
    other = Runtime(EventStore(durable_store_url), Catalog([chain_program(name="tamper.other")]), poll_interval=0)
    with other:
        done = other.start(chain_program(name="tamper.other"), {"n": 1}, start_id="other-1")
        assert done.result(timeout=30).status == "completed"
        taken = str(other.capture(str(done.tree_id)).root.process_id)
    sql = Sql(durable_store_url)
    store = EventStore(durable_store_url)
    try:
        whole = store.load(tree_id, Catalog([program]).resolve)
        pause = ControlRequested(process_id=whole.state.root.process_id, control="pause", reason="hold")
        now = "2026-12-01T00:00:00Z"
        head = dataclasses.replace(index_head(whole.state, tree_id, [pause], now), new_processes=(taken,))
        before = (sql.raw_rows(tree_id), sql.head(tree_id))
        with pytest.raises(CorruptStream) as refused:
            store.append(tree_id, last, [pause], previous_digest=whole.digest, timestamp=now, head=head)
        assert (refused.value.rule, refused.value.position) == ("index.process_mismatch", last + 1)
        assert f"process {taken}, which this append creates, is indexed already" in refused.value.message
        assert (sql.raw_rows(tree_id), sql.head(tree_id)) == before
    finally:
        store.close()


def test_a_tree_whose_first_append_commits_while_it_is_looked_up_is_found_not_refused(
    durable_store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by a review: a lookup (`show START_ID`, GET /runs/{start_id}) that read no index row,
    # then found the tree's events because its first append committed in between, reported the
    # healthy tree as corrupt ("the row was deleted"). The interleaving is forced here: the
    # first read of the row answers as it did before the commit.
    tree_id, _, _, _ = parked_in_flight(durable_store_url, tmp_path)
    store = EventStore(durable_store_url)
    real_head = EventStore.head
    for ref in (str(tree_id), "cut-1"):
        reads: list[TreeID] = []

        def head_before_the_commit(self: EventStore, tree: TreeID, reads: list[TreeID] = reads) -> object:
            reads.append(tree)
            return None if len(reads) == 1 else real_head(self, tree)

        monkeypatch.setattr(EventStore, "head", head_before_the_commit)
        try:
            assert store.find_tree(ref) == tree_id
            assert reads == [tree_id, tree_id]  # the row was read again once events were seen
        finally:
            monkeypatch.setattr(EventStore, "head", real_head)
    store.close()


@pytest.mark.parametrize("upto", [0, -1, True, 1.5])
def test_a_load_up_to_no_position_is_refused_before_reading(tmp_path: Path, upto: object) -> None:
    # Left by the last notes: `load(upto=0)` answered `store.not_found` for a tree that is
    # there (nothing folded, the tree taken for absent). A position is 1 or more.
    store = EventStore(f"sqlite:///{tmp_path / 's.db'}")
    try:
        program = chain_program(lambda request, context: Settlement.succeeded({"value": 1}), name="upto.chain")
        with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
            handle = runtime.start(program, {"n": 1}, start_id="upto")
            assert handle.result(timeout=10).status == "completed"
        with pytest.raises(ValueError, match="upto must be a position, 1 or more"):
            store.load(handle.tree_id, upto=upto)  # type: ignore[arg-type]
        assert store.load(handle.tree_id, upto=1).state.version == 1
    finally:
        store.close()


@pytest.mark.parametrize("edit", [
    "status = 'completed', classification = 'terminal'",
    "unknown_effect_ids = '[]'",
    "start_id = 'evil'",
])
def test_a_hand_edited_index_row_is_refused_by_every_load_and_keeps_its_evidence(
    durable_store_url: str, tmp_path: Path, edit: str
) -> None:
    # Found by an auditor's walk: `audit verify` reported the row (index.row_mismatch), but
    # loads checked only its version and head digest; `resolve` and `recover` drove the run on
    # and their append rewrote the row, after which `audit verify` said OK.
    tree_id, log, program, last = parked_in_flight(durable_store_url, tmp_path)
    store = EventStore(durable_store_url)
    try:
        with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
            assert runtime.recover(str(tree_id))  # the call in flight becomes unknown: a parked run
        last = len(store.read(tree_id))
        assert store.head(tree_id).unknown_effect_ids
        sql = Sql(durable_store_url)
        sql._run(f"UPDATE agentfold_trees SET {edit} WHERE tree_id = ?", (str(tree_id),))
        before = (sql.raw_rows(tree_id), sql.head(tree_id))
        with pytest.raises(CorruptStream) as loaded:
            store.load(tree_id)
        assert (loaded.value.rule, loaded.value.position) == ("index.row_mismatch", last)
        assert "the row was changed by hand" in loaded.value.message
        (unknown,) = store.read(tree_id)[-1].event.effect_id,  # the call's unknown settlement
        with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
            with contextlib.suppress(CorruptStream):  # refused, or (a row saying terminal) nothing to drive
                runtime.recover(str(tree_id))
            with pytest.raises(CorruptStream):
                runtime.capture(tree_id)
    finally:
        store.close()
    resolved = agentfold("resolve", unknown, "--output", '"host"', "--json", store=durable_store_url)
    assert resolved.code != 0, resolved
    shown = agentfold("show", str(tree_id), "--json", store=durable_store_url)
    assert shown.code == 1 and shown.error()["detail"]["rule"] == "index.row_mismatch", shown
    assert log.count() == 3  # nothing called again
    assert (sql.raw_rows(tree_id), sql.head(tree_id)) == before  # the evidence is intact
    verified = agentfold("audit", "verify", str(tree_id), "--json", store=durable_store_url)
    assert verified.code == 1 and "index.row_mismatch" in verified.stdout

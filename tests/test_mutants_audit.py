"""Audit tooling promises a mutation audit (2026-12-05) found undefended: each test failed with a
planted bug the rest of the suite let through (the audit's report lists them).

- the digest of every stored event is the documented formula (docs/events.md "The digest chain"),
  recomputed here with hashlib alone: previous digest, tree id, position and type are all bound;
- an event changed and sealed again on its own breaks the chain at the next position;
- a last event rewritten and chained again, its index row left alone, is ``index.head_mismatch``;
- every column of the tree index the listings read is compared with the fold;
- ``replay`` and ``audit drift`` over a changed event say ``store.corrupt``, never the changed
  state or a verdict on the code;
- an imported tree is listed as its source lists it (``created_at`` / ``updated_at``);
- a sealed snapshot naming another event's digest is ``snapshot.mismatch``;
- a damaged snapshot (a cache, not exported) does not stand in the way of ``export``.
"""

from __future__ import annotations

import hashlib
import sqlite3
import zlib
from pathlib import Path
from typing import Any

import orjson
import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.domain.ids import ProcessID, TreeID, effect_id
from agentfold.domain.integrity import chain_digest, content_bytes, seal
from tests.audit.support import Sql, chain_sources, cli, record_chain
from tests.kernel_programs import chain_program

PREFIX = len(b'{"digest":"')


def documented_digest(previous: str, tree_id: str, position: int, event_type: str, content: bytes) -> str:
    """docs/events.md: "sha256:" + hex(SHA-256(previous NUL tree_id NUL position NUL event_type NUL content))."""
    parts = [previous.encode(), tree_id.encode(), str(position).encode(), event_type.encode(), content]
    return "sha256:" + hashlib.sha256(b"\0".join(parts)).hexdigest()


def sqlite_rows(path: Path, tree_id: TreeID) -> list[tuple[int, str, bytes]]:
    """The stored rows, read with the sqlite3 module (no agentfold code)."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT originator_version, topic, state FROM agentfold_events WHERE originator_id = ? "
            "ORDER BY originator_version", (tree_id.uuid.hex,)).fetchall()
    finally:
        conn.close()
    return [(int(v), str(t), bytes(s)) for v, t, s in rows]


def verify_json(capsys: pytest.CaptureFixture[str], store: str) -> tuple[int, dict[str, Any]]:
    ran = cli(capsys, "audit", "verify", "--all", "--json", "--store", store, sources=chain_sources())
    return ran.code, ran.json()


def test_every_stored_digest_is_the_documented_sha256_formula(tmp_path: Path) -> None:
    path = tmp_path / "formula.db"
    tree_id = record_chain(f"sqlite:///{path}")
    rows = sqlite_rows(path, tree_id)
    assert [v for v, _, _ in rows] == list(range(1, 16))
    assert any(s[:1] == b"\x01" for _, _, s in rows)  # deflated states are chained over their JSON too
    previous = ""
    for position, topic, state in rows:
        state = zlib.decompress(state[1:], -15) if state[:1] == b"\x01" else state
        recorded = state[PREFIX:PREFIX + 71].decode()
        content = b"{" + state[PREFIX + 71 + 2:]
        expected = documented_digest(previous, str(tree_id), position, topic.removeprefix("domain.events:"), content)
        assert recorded == expected, f"position {position}"
        previous = recorded
    # The index row anchors the last of them.
    assert Sql(f"sqlite:///{path}").head(tree_id) == (15, previous)


def test_an_event_changed_and_sealed_again_on_its_own_breaks_the_chain_at_the_next_position(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A tamperer who reseals the event he changed (its digest is right for its content and its
    predecessor) but not the events after it: the next event's digest no longer chains."""
    store = f"sqlite:///{tmp_path / 'resealed.db'}"
    tree_id = record_chain(store)
    sql = Sql(store)
    state = sql.state(tree_id, 9)
    assert state.count(b'"value":1') == 1
    content = b"{" + state[PREFIX + 71 + 2:].replace(b'"value":1', b'"value":7')
    previous = sql.state(tree_id, 8)[PREFIX:PREFIX + 71].decode()
    # Sealed with agentfold's own chain function: whatever its formula, each event binds its predecessor.
    sql.set_row(tree_id, 9, "domain.events:EffectSettled",
                seal(content, chain_digest(previous, str(tree_id), 9, "EffectSettled", content)))
    code, report = verify_json(capsys, store)
    assert code == 1 and report["ok"] is False
    error = report["first_error"]
    assert (error["tree"], error["position"], error["rule"]) == (str(tree_id), 10, "integrity.digest_chain")


def test_a_last_event_rewritten_and_chained_again_without_its_index_row_is_a_head_mismatch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The tamperer rewrites the last event (its timestamp) and chains it correctly from its
    predecessor, but leaves the tree index: the row's head digest is what shows it."""
    store = f"sqlite:///{tmp_path / 'rechained.db'}"
    tree_id = record_chain(store)
    sql = Sql(store)
    state = sql.state(tree_id, 15)
    recorded = state[PREFIX:PREFIX + 71].decode()
    assert sql.head(tree_id) == (15, recorded)
    body = orjson.loads(b"{" + state[PREFIX + 71 + 2:])
    content = content_bytes(body["event"], "2031-01-01T00:00:00.000000Z")
    previous = sql.state(tree_id, 14)[PREFIX:PREFIX + 71].decode()
    topic = "domain.events:ProcessTerminated"
    forged = seal(content, chain_digest(previous, str(tree_id), 15, "ProcessTerminated", content))
    sql.set_row(tree_id, 15, topic, forged)
    code, report = verify_json(capsys, store)
    assert code == 1 and report["ok"] is False
    error = report["first_error"]
    assert (error["tree"], error["position"], error["rule"]) == (str(tree_id), 15, "index.head_mismatch")
    assert recorded in error["detail"]


@pytest.mark.parametrize("column", ["start_id", "root_process_id", "program", "status", "classification",
                                    "unknown_effect_ids"])
def test_each_index_column_the_listings_filter_on_is_compared_with_the_fold(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, column: str
) -> None:
    """A well-formed but wrong value in any of the tree index's columns (``trees --classification
    parked`` would list a finished run as waiting) is ``index.row_mismatch`` naming the column."""
    store = f"sqlite:///{tmp_path / 'index.db'}"
    tree_id = record_chain(store)
    sql = Sql(store)
    ((root,),) = sql._run("SELECT root_process_id FROM agentfold_trees WHERE tree_id = ?", (str(tree_id),))
    wrong = {
        "start_id": "another-start",
        "root_process_id": "process:" + "0" * 32,
        "program": "test.another",
        "status": "failed",
        "classification": "parked",
        "unknown_effect_ids": orjson.dumps([str(effect_id(ProcessID(root), 1, 0))]).decode(),
    }[column]
    sql._run(f"UPDATE agentfold_trees SET {column} = ? WHERE tree_id = ?", (wrong, str(tree_id)))
    code, report = verify_json(capsys, store)
    assert code == 1 and report["ok"] is False
    error = report["first_error"]
    assert (error["tree"], error["position"], error["rule"]) == (str(tree_id), 15, "index.row_mismatch")
    assert f"the tree index's {column} is" in error["detail"]


def _change_settled_value(store: str, tree_id: TreeID) -> None:
    """Event 9 (the second EffectSettled) says value 7 where the run settled value 1; not sealed again."""
    sql = Sql(store)
    state = sql.state(tree_id, 9)
    assert state.count(b'"value":1') == 1
    sql.set_row(tree_id, 9, "domain.events:EffectSettled", state.replace(b'"value":1', b'"value":7'))


def test_replay_after_a_changed_event_is_a_corrupt_store_not_the_changed_state(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """docs/audit.md: a history that breaks the chain before POSITION is ``store.corrupt`` (exit 1);
    positions before the change still replay."""
    store = f"sqlite:///{tmp_path / 'replay.db'}"
    tree_id = record_chain(store)
    _change_settled_value(store, tree_id)
    for position in (9, 12, 15):
        ran = cli(capsys, "replay", str(tree_id), "--at", str(position), "--json", "--store", store,
                  sources=chain_sources())
        assert ran.code == 1 and ran.stdout == "", ran.stdout
        error = ran.error()
        assert (error["code"], error["detail"]["position"], error["detail"]["rule"]) == (
            "store.corrupt", 9, "integrity.digest_chain"), error
    ran = cli(capsys, "replay", str(tree_id), "--at", "8", "--json", "--store", store, sources=chain_sources())
    assert ran.code == 0 and ran.json()["position"] == 8


def test_drift_over_a_changed_event_is_a_corrupt_store_not_a_verdict_on_the_code(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """docs/audit.md: drift reads the history as every load does; a broken chain is ``store.corrupt``
    (exit 1), neither "no drift" nor drift of the code."""
    store = f"sqlite:///{tmp_path / 'drift.db'}"
    tree_id = record_chain(store)
    _change_settled_value(store, tree_id)
    ran = cli(capsys, "audit", "drift", str(tree_id), "--json", "--store", store, sources=chain_sources())
    assert ran.code == 1 and ran.stdout == "", ran.stdout
    error = ran.error()
    assert (error["code"], error["detail"]["position"], error["detail"]["rule"]) == (
        "store.corrupt", 9, "integrity.digest_chain"), error


def test_an_imported_tree_is_listed_exactly_as_in_its_source_store_with_its_own_times(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """docs/audit.md: the index row an import writes has ``created_at`` / ``updated_at`` = the first
    and last events' timestamps, which is what the recording store's row says: ``trees`` (sorted
    and filtered by ``created_at``) lists the moved tree exactly as its source does."""
    source, target = f"sqlite:///{tmp_path / 'source.db'}", f"sqlite:///{tmp_path / 'target.db'}"
    tree_id = record_chain(source)
    exported = tmp_path / "tree.jsonl"
    assert cli(capsys, "export", str(tree_id), "--out", str(exported), "--store", source,
               sources=chain_sources()).code == 0
    assert cli(capsys, "import", str(exported), "--store", target, sources=chain_sources()).code == 0
    rows = [cli(capsys, "trees", "--json", "--store", store, sources=chain_sources()).json()["trees"]
            for store in (source, target)]
    assert rows[1] == rows[0]
    ((row,),) = rows[:1]
    again = tmp_path / "again.jsonl"  # and the records moved are the records exported, byte for byte
    assert cli(capsys, "export", str(tree_id), "--out", str(again), "--store", target,
               sources=chain_sources()).code == 0
    assert again.read_bytes() == exported.read_bytes()
    lines = exported.read_text().splitlines()
    first, last = (orjson.loads(orjson.loads(line)["state"])["timestamp"] for line in (lines[0], lines[-2]))
    assert (row["created_at"], row["updated_at"]) == (first, last) and first < last


def test_a_sealed_snapshot_that_names_another_events_digest_is_a_snapshot_mismatch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The fold's tree at version 8, sealed (as a writer seals one) with a digest that is not
    position 8's (a snapshot of another store's history): loads skip it; verify names it."""
    store = f"sqlite:///{tmp_path / 'snapshot.db'}"
    tree_id = record_chain(store)
    events = EventStore(store)
    try:
        loaded = events.load(tree_id, Catalog([chain_program()]).resolve, use_snapshot=False, upto=8)
        assert loaded.digest is not None
        other = Sql(store).state(tree_id, 7)[PREFIX:PREFIX + 71].decode()
        assert other != loaded.digest
        events.save_snapshot(tree_id, loaded.state, other)
    finally:
        events.close()
    code, report = verify_json(capsys, store)
    assert code == 1 and report["ok"] is False
    error = report["first_error"]
    assert (error["tree"], error["position"], error["rule"]) == (str(tree_id), 8, "snapshot.mismatch")
    assert f"names digest {other}" in error["detail"]


def test_a_damaged_snapshot_fails_verify_but_not_the_export_of_the_history(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """docs/audit.md: export refuses a tree that fails steps 1-4 of verify; the snapshot is a cache,
    not exported, so a damaged one (verify's step 5) does not stand in the way: the history is
    exported whole and verifies in the store it is imported into."""
    store, target = f"sqlite:///{tmp_path / 'cached.db'}", f"sqlite:///{tmp_path / 'moved.db'}"
    tree_id = record_chain(store)
    events = EventStore(store)
    try:
        loaded = events.load(tree_id, Catalog([chain_program()]).resolve, use_snapshot=False, upto=8)
        assert loaded.digest is not None
        events.save_snapshot(tree_id, loaded.state, loaded.digest)
    finally:
        events.close()
    sql = Sql(store)
    assert sql._run("SELECT count(*) FROM agentfold_snapshots WHERE originator_id = ?", (tree_id.uuid.hex,)) == [(1,)]
    sql._run("UPDATE agentfold_snapshots SET state = ? WHERE originator_id = ?", (b"{damaged", tree_id.uuid.hex))
    code, report = verify_json(capsys, store)
    assert code == 1 and report["first_error"]["rule"] == "snapshot.mismatch"
    exported = tmp_path / "tree.jsonl"
    ran = cli(capsys, "export", str(tree_id), "--out", str(exported), "--json", "--store", store,
              sources=chain_sources())
    assert ran.code == 0, ran.stderr
    assert ran.json()["events"] == 15 and len(exported.read_text().splitlines()) == 16
    assert cli(capsys, "import", str(exported), "--store", target, sources=chain_sources()).code == 0
    code, report = verify_json(capsys, target)
    assert code == 0 and report["events"] == 15

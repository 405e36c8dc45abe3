"""``agentfold snapshot``: a current snapshot for trees whose loads fold their history.

A finished tree takes no more appends, so nobody writes it a snapshot: one that never had
one (imported, or run with snapshots off), or whose snapshot a later release does not read
(another format), is folded from its first event on every ``show``, HTTP read or result.
The command writes the snapshot a runtime would, from the verified fold, with the tree's
Programs bound; loads then read it, and ``audit verify`` checks it.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest
from eventsourcing.persistence import StoredEvent

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import SNAPSHOT_TOPIC, EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.sources import ProgramSources
from agentfold.domain.ids import StartID, TreeID
from agentfold.domain.program import Program
from tests.audit.support import chain_sources, cli
from tests.kernel_programs import Chain, chain_program


def _finished(url: str, program: Program, *sizes: int, prefix: str = "snap") -> list[TreeID]:
    """Completed chain runs of ``sizes`` effects, written without any snapshot."""
    store = EventStore(url)
    try:
        with Runtime(store, Catalog([program]), snapshot_every=0) as runtime:
            trees = []
            for i, n in enumerate(sizes):
                handle = runtime.start(program, {"n": n}, start_id=StartID(f"{prefix}-{i}"))
                assert handle.result(timeout=60).status == "completed"
                trees.append(handle.tree_id)
            return trees
    finally:
        store.close()


def _loaded(url: str, program: Program, tree_id: TreeID) -> tuple[int, int, dict[str, Any]]:
    """(the snapshot version a load started from, the tree's version, its JSON)."""
    store = EventStore(url)
    try:
        loaded = store.load(tree_id, Catalog([program]).resolve)
        return loaded.snapshot_version, loaded.state.version, loaded.state.to_json()
    finally:
        store.close()


def _snapshot_rows(url: str, tree_id: TreeID) -> list[int]:
    store = EventStore(url)
    try:
        return [row.originator_version for row in store.snapshots.select_events(tree_id.uuid)]
    finally:
        store.close()


def test_snapshot_writes_the_snapshot_loads_then_start_from(
    capsys: pytest.CaptureFixture[str], durable_store_url: str
) -> None:
    url = durable_store_url
    program = chain_program()
    big, small = _finished(url, program, 40, 2)
    before, version, folded_tree = _loaded(url, program, big)
    assert before == 0 and version > 100

    ran = cli(capsys, "snapshot", "--all", "--min-events", "50", "--json", "--store", url,
              sources=chain_sources(program))
    assert ran.code == 0 and ran.stderr == "", ran.stderr  # a short run says nothing but its report
    report = json.loads(ran.stdout)
    by_tree = {e["tree_id"]: e for e in report["trees"]}
    assert (report["written"], report["skipped"], report["failed"]) == (1, 0, 0)
    assert by_tree[str(big)]["outcome"] == "written" and by_tree[str(big)]["folded"] == version
    assert by_tree[str(small)]["outcome"] == "current"  # 11 events: under --min-events
    assert _snapshot_rows(url, small) == []

    after, again, tree = _loaded(url, program, big)
    assert (after, again) == (version, version) and tree == folded_tree  # the fold's tree, from the snapshot
    verified = cli(capsys, "audit", "verify", "--all", "--json", "--store", url, sources=chain_sources(program))
    assert verified.code == 0 and json.loads(verified.stdout)["ok"] is True, verified.stdout

    # Nothing left to do: the same command writes nothing more.
    ran = cli(capsys, "snapshot", str(big), "--min-events", "1", "--json", "--store", url,
              sources=chain_sources(program))
    assert ran.code == 0 and json.loads(ran.stdout)["trees"][0]["outcome"] == "current", ran.stdout
    assert _snapshot_rows(url, big) == [version]


def test_a_snapshot_loads_do_not_use_is_replaced_at_the_same_version(
    capsys: pytest.CaptureFixture[str], durable_store_url: str
) -> None:
    """A finished tree's last snapshot is often at its last event: one of another format (a
    release before) sits at the very version the new one is written at."""
    url = durable_store_url
    program = chain_program()
    (tree_id,) = _finished(url, program, 30)
    store = EventStore(url)
    try:
        loaded = store.load(tree_id, Catalog([program]).resolve)
        body = orjson.loads(EventStore.encode_snapshot(loaded.state, loaded.digest or ""))
        body["format"] = 2  # a release's before the seal: not read
        version = loaded.state.version
        store.snapshots.insert_events([StoredEvent(tree_id.uuid, version, SNAPSHOT_TOPIC, orjson.dumps(body))])
    finally:
        store.close()
    assert _loaded(url, program, tree_id)[0] == 0  # present, not used: loads fold

    ran = cli(capsys, "snapshot", str(tree_id), "--min-events", "10", "--json", "--store", url,
              sources=chain_sources(program))
    assert ran.code == 0, ran.stderr
    (entry,) = json.loads(ran.stdout)["trees"]
    assert entry["outcome"] == "written" and entry["snapshot_version"] is None, entry
    assert _loaded(url, program, tree_id)[0] == version
    assert _snapshot_rows(url, tree_id) == [version]


def test_trees_whose_programs_are_not_bound_here_are_skipped_and_nothing_is_written(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    program = chain_program(name="test.unbound_here")
    (tree_id,) = _finished(url, program, 30)
    ran = cli(capsys, "snapshot", "--all", "--min-events", "10", "--json", "--store", url, sources=ProgramSources())
    assert ran.code == 0, ran.stderr
    report = json.loads(ran.stdout)
    (entry,) = report["trees"]
    assert entry["outcome"] == "skipped" and "test.unbound_here" in entry["reason"], entry
    assert report["skipped"] == 1 and report["written"] == 0
    assert _snapshot_rows(url, tree_id) == []
    text = cli(capsys, "snapshot", "--all", "--min-events", "10", "--store", url, sources=ProgramSources())
    assert text.stdout.splitlines()[0] == "wrote 0 snapshot(s) of 1 tree(s); 1 skipped", text.stdout


def test_a_corrupt_tree_fails_its_entry_and_the_others_are_written(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    db = tmp_path / "agentfold.db"
    url = f"sqlite:///{db}"
    program = chain_program()
    broken, sound = _finished(url, program, 30, 30)
    with sqlite3.connect(db) as conn:  # the last byte of one stored event changed under its digest
        (state,) = conn.execute("SELECT state FROM agentfold_events WHERE originator_id = ? AND originator_version = 5",
                                (broken.uuid.hex,)).fetchone()
        changed = bytes(state)[:-1] + bytes([state[-1] ^ 1])
        conn.execute("UPDATE agentfold_events SET state = ? WHERE originator_id = ? AND originator_version = 5",
                     (changed, broken.uuid.hex))
    ran = cli(capsys, "snapshot", "--all", "--min-events", "10", "--json", "--store", url,
              sources=chain_sources(program))
    assert ran.code == 1, (ran.stdout, ran.stderr)
    report = json.loads(ran.stdout)
    by_tree = {e["tree_id"]: e for e in report["trees"]}
    assert by_tree[str(broken)]["outcome"] == "failed" and "store.corrupt" in by_tree[str(broken)]["reason"]
    assert by_tree[str(sound)]["outcome"] == "written"
    assert _snapshot_rows(url, broken) == []


@pytest.mark.parametrize("argv,message", [
    ([], "name the trees to snapshot, or pass --all"),
    (["snap-0", "--all"], "name the trees to snapshot, or pass --all"),
    (["--all", "--min-events", "0"], "is not a number of events from 1"),
    (["--all", "--min-events", "many"], "is not a whole number of events"),
    (["tree:" + "0" * 32], "engine.tree.not_found"),
])
def test_bad_input_is_refused_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    program = chain_program()
    (tree_id,) = _finished(url, program, 30)
    ran = cli(capsys, "snapshot", *argv, "--store", url, sources=chain_sources(program))
    assert ran.code == 2 and message in ran.stderr and ran.stdout == "", (ran.code, ran.stdout, ran.stderr)
    assert _snapshot_rows(url, tree_id) == []


def test_exactly_min_events_folded_is_written_and_older_snapshots_go(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    program = chain_program()
    (tree_id,) = _finished(url, program, 30)
    store = EventStore(url)
    try:
        early = store.load(tree_id, Catalog([program]).resolve, use_snapshot=False, upto=40)
        store.save_snapshot(tree_id, early.state, early.digest or "")  # usable, 40 events behind... and more
        version = store.load(tree_id, Catalog([program]).resolve).state.version
    finally:
        store.close()
    folded = version - 40
    ran = cli(capsys, "snapshot", str(tree_id), "--min-events", str(folded + 1), "--json", "--store", url,
              sources=chain_sources(program))
    assert json.loads(ran.stdout)["trees"][0]["outcome"] == "current", ran.stdout
    ran = cli(capsys, "snapshot", str(tree_id), "--min-events", str(folded), "--json", "--store", url,
              sources=chain_sources(program))
    (entry,) = json.loads(ran.stdout)["trees"]
    assert (entry["outcome"], entry["snapshot_version"], entry["folded"]) == ("written", 40, folded), entry
    assert _snapshot_rows(url, tree_id) == [version]  # the older one is gone, as after a runtime's


def test_a_snapshot_row_beyond_the_folded_version_is_reported_not_hidden_behind(
    capsys: pytest.CaptureFixture[str], durable_store_url: str
) -> None:
    """Loads read only the newest row: one beyond the tree's end (a history cut or restored by
    hand) would hide the snapshot written under it, and "written" would be untrue. Beside an
    older usable row too (a prune that did not run, a snapshots table restored from another
    backup than the events): the newest row decides, not the one the load used."""
    url = durable_store_url
    program = chain_program()
    (tree_id,) = _finished(url, program, 30)
    version = _loaded(url, program, tree_id)[1]
    store = EventStore(url)
    try:
        early = store.load(tree_id, Catalog([program]).resolve, use_snapshot=False, upto=40)
        store.save_snapshot(tree_id, early.state, early.digest or "")
        store.snapshots.insert_events([StoredEvent(tree_id.uuid, version + 7, SNAPSHOT_TOPIC, b"{}")])
    finally:
        store.close()
    ran = cli(capsys, "snapshot", str(tree_id), "--min-events", "10", "--json", "--store", url,
              sources=chain_sources(program))
    assert ran.code == 0, ran.stderr
    (entry,) = json.loads(ran.stdout)["trees"]
    assert entry["outcome"] == "skipped" and f"a snapshot at version {version + 7}" in entry["reason"], entry
    assert _snapshot_rows(url, tree_id) == [40, version + 7]


class _Unencodable(Chain):
    def encode_state(self, state: Any) -> Any:
        raise RuntimeError("this state has no JSON form")


def test_a_program_whose_state_cannot_be_encoded_fails_its_tree_only(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    sound = chain_program()
    broken = dataclasses.replace(chain_program(name="test.unencodable"), strategy=_Unencodable())
    (bad,) = _finished(url, broken, 30)
    (good,) = _finished(url, sound, 30, prefix="sound")
    ran = cli(capsys, "snapshot", str(bad), str(good), "--min-events", "10", "--json", "--store", url,
              sources=chain_sources(broken, sound))
    assert ran.code == 1, (ran.stdout, ran.stderr)
    first, second = json.loads(ran.stdout)["trees"]
    assert first["outcome"] == "failed" and "RuntimeError: this state has no JSON form" in first["reason"], first
    assert second["outcome"] == "written"
    assert _snapshot_rows(url, bad) == []


def test_a_store_that_fails_stops_the_command_saying_how_far_it_got(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holds SQLite's write lock: every tree would wait it out (30 s each; 1 s
    here), so the command stops at the first, with what it wrote so far."""
    from agentfold.adapters import eventstore

    real = eventstore.parse_store_url

    def short_lock_wait(url: str) -> tuple[str, dict[str, str]]:
        backend, env = real(url)
        return backend, {**env, "SQLITE_LOCK_TIMEOUT": "1"}

    db = tmp_path / "agentfold.db"
    url = f"sqlite:///{db}"
    program = chain_program()
    trees = _finished(url, program, 30, 30)
    monkeypatch.setattr(eventstore, "parse_store_url", short_lock_wait)
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        ran = cli(capsys, "snapshot", "--all", "--min-events", "10", "--json", "--store", url,
                  sources=chain_sources(program))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert ran.code == 1 and ran.stdout == "", (ran.stdout, ran.stderr)
    error = json.loads(ran.stderr)["error"]
    assert error["code"] == "store.unavailable", error
    assert "write lock" in error["message"] and "stopped after 0 of 2 tree(s), 0 snapshot(s) written" in error["message"]
    assert [_snapshot_rows(url, t) for t in trees] == [[], []]


def test_a_long_snapshot_all_says_how_far_it_is_on_stderr(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every ``PROGRESS_EVERY`` seconds (5; 0 here), a line on stderr: stdout keeps the report."""
    import agentfold.adapters.cli

    url = f"sqlite:///{tmp_path / 'agentfold.db'}"
    program = chain_program()
    _finished(url, program, 30, 2, 30)
    monkeypatch.setattr(agentfold.adapters.cli, "PROGRESS_EVERY", 0.0)
    ran = cli(capsys, "snapshot", "--all", "--min-events", "50", "--json", "--store", url,
              sources=chain_sources(program))
    assert ran.code == 0 and json.loads(ran.stdout)["written"] == 2, ran.stdout
    lines = ran.stderr.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "agentfold: snapshot: 1 of 3 trees, 1 snapshot(s) written",
        "agentfold: snapshot: 2 of 3 trees, 1 snapshot(s) written",
    ], lines
    assert all(line.endswith(" trees/s)") for line in lines)

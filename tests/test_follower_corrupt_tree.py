"""One corrupt tree does not stop the read models of the others (docs/read-models.md).

A store holds several runs; one stored event of one of them ("bad") is changed on disk
with plain SQL, so its digest chain breaks there. The read-model follower (``agentfold
project``, ``project --follow``, ``serve``'s follower) must project every other tree (its
rows equal to what folding gives), record the corrupt tree in
``agentfold_rm_corrupt_trees`` with the batch that found it (so a rebuild reproduces the
same tables), drop whatever rows the corrupt tree had, skip its later events, report it
once (not once per poll), and keep going.

Everything runs for real: ``agentfold`` subprocesses, an ``agentfold serve`` process,
SQLite files and PostgreSQL databases; the damage is done with plain SQL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from agentfold.adapters.eventstore import CorruptStream, EventStore
from agentfold.adapters.queries import HostQueries
from agentfold.adapters.read_models import CorruptTree, ReadModels
from agentfold.adapters.sources import default_sources
from agentfold.domain.ids import TreeID
from agentfold.projections.read_models import project_tree
from tests.audit.support import Sql, append_past_index_row
from tests.http_api.support import ApiServer, ok, problem, start_server
from tests.streams import expect_line, read_both
from tests.test_cli import ROOT, Ran, agentfold
from tests.test_cli import ok as ran_ok
from tests.test_cli_interaction import approval
from tests.test_corrupt_tree_listings import (
    corrupt,
    named,
    runs_with_one_to_damage,
    start,
    start_runs,
    stderr_errors,
    without_detail,
)
from tests.test_store_opening import assert_rows_equal_folding

PROJECT_KEYS = {"rebuilt", "events", "position", "seconds"}


def canon(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def notification_of(store: EventStore, tree_id: str, version: int) -> int:
    """The notification id of one event of one tree (the store-wide commit order)."""
    wanted = TreeID(tree_id).uuid
    after = 0
    while batch := store.notifications(after, 1000):
        for n in batch:
            if uuid.UUID(str(n.originator_id)) == wanted and n.originator_version == version:
                return int(n.id)
        after = batch[-1].id
    raise AssertionError(f"no event {version} of {tree_id}")


def dump(url: str) -> dict[str, Any]:
    """Everything the read models hold: position, every tree's rows, counters, corrupt trees."""
    store = EventStore(url)
    try:
        models = ReadModels(store, create=False)
        return {
            "position": models.position(),
            "trees": {h.tree_id: models.tree_rows(h.tree_id) for h in store.heads()},
            "counters": models.counters(),
            "corrupt": [asdict(c) for c in models.corrupt_trees()],
        }
    finally:
        store.close()


def empty_rows(tree_id: str) -> dict[str, Any]:
    return {"tree_id": tree_id, "version": 0, "run": None, "rounds": [], "delegates": [], "pending": [],
            "unknown": [], "gates": []}


def assert_tables(url: str, healthy: list[str], bad: str, position: int) -> CorruptTree:
    """The tables are at the store's head; every healthy tree's rows and host answers equal what
    folding it gives; the corrupt tree has a record and no other row; its record is returned."""
    store = EventStore(url)
    try:
        models = ReadModels(store, create=False)
        assert models.position() == store.max_notification_id()
        [record] = models.corrupt_trees()
        expected = CorruptTree(bad, "bad", notification_of(store, bad, 1), position, "integrity.digest_chain",
                               record.detail, notification_of(store, bad, position))
        assert record == expected
        assert record.detail.startswith("recorded digest sha256:")
        assert models.tree_rows(bad) == empty_rows(bad)  # the rows it had before are gone too
        counters = models.counters()
        assert set(counters) == set(healthy)
        tables = HostQueries(store, default_sources())
        folding = HostQueries(store, default_sources(), use_read_models=False)
        view = tables.view()
        assert view is not None and view[1].rows == {}  # current: every answer below is the tables'
        assert list(view[1].corrupt) == [bad]
        for tree_id in healthy:
            head = store.head(TreeID(tree_id))
            assert head is not None and counters[tree_id] == (head.version, head.version)
            tree, programs = folding.fold(TreeID(tree_id))
            rows = project_tree(tree, programs)
            assert canon(models.tree_rows(tree_id)) == canon(rows.to_json()), tree_id
            assert tables.run(TreeID(tree_id)) == rows.run
            assert tables.pending(TreeID(tree_id)) == rows.pending
            assert tables.unknown(TreeID(tree_id)) == rows.unknown
        # Store-wide listings: the tables give folding's answer, the corrupt tree named alike.
        for question in ("pending", "unknown", "gates", "runs"):
            from_tables, folded = getattr(tables, question)(), getattr(folding, question)()
            if question == "runs":  # the two number their page cursors differently
                from_tables, folded = [r["tree_id"] for r in from_tables], [r["tree_id"] for r in folded]
            assert from_tables == folded, question
            assert getattr(tables, question)().corrupt == [record.entry()], question
        with pytest.raises(CorruptStream) as raised:
            tables.pending(TreeID(bad))
        assert (raised.value.code, raised.value.position) == ("store.corrupt", position)
        return record
    finally:
        store.close()


def assert_reports_the_corrupt_tree(ran: Ran, bad: str, position: int) -> None:
    """``project --json`` exit 1: committed, the tree in ``corrupt_trees`` and on one stderr line."""
    assert ran.code == 1, ran.stderr
    data = ran.json()
    assert set(data) == PROJECT_KEYS | {"corrupt_trees"}
    assert without_detail(data["corrupt_trees"]) == [named(bad, "bad", position)]
    assert "Traceback" not in ran.stderr
    [error] = stderr_errors(ran)
    assert error["code"] == "store.corrupt"
    assert error["detail"] == {"tree_id": bad, "start_id": "bad", "position": position,
                               "rule": "integrity.digest_chain"}
    assert f"tree {bad} (start bad) is corrupt at position {position}: integrity.digest_chain" in error["message"]
    assert "the read models skip it" in error["message"]
    assert f"audit verify {bad}" in error["hint"]


def head_of(url: str) -> int:
    store = EventStore(url)
    try:
        return store.max_notification_id()
    finally:
        store.close()


# ---------------------------------------------------------------------------
# agentfold project


def test_project_skips_a_corrupt_tree_projects_every_other_tree_and_a_rebuild_gives_the_same_tables(
    durable_store_url: str, tmp_path: Path
) -> None:
    store = durable_store_url
    _, bad, healthy = runs_with_one_to_damage(store, tmp_path)
    position = corrupt(store, bad, 3)  # an early event: every later one of "bad" is skipped too

    found = agentfold("project", "--json", store=store)
    assert_reports_the_corrupt_tree(found, bad, position)
    assert found.json()["events"] == found.json()["position"] == head_of(store)
    assert_tables(store, healthy, bad, position)

    # Nothing new to report: exit 0, the documented members only, nothing on stderr.
    again = agentfold("project", "--json", store=store)
    assert (again.code, again.stderr) == (0, ""), again.stderr
    assert set(again.json()) == PROJECT_KEYS and again.json()["events"] == 0
    as_text = agentfold("project", store=store)
    assert (as_text.code, as_text.stderr) == (0, "")
    assert as_text.stdout.startswith("projected 0 event(s)")

    # Runs written after the corrupt tree was found are projected as usual.
    later = start(store, tmp_path, "later", approval(None))
    projected = agentfold("project", "--json", store=store)
    assert (projected.code, projected.stderr) == (0, "")
    assert projected.json()["events"] > 0
    record = assert_tables(store, [*healthy, later], bad, position)

    # The tables are a pure function of the log: a rebuild reproduces them, record included
    # (and reports the corrupt tree again: the emptied tables had not recorded it) ...
    before = dump(store)
    assert before["corrupt"] == [asdict(record)]
    rebuilt = agentfold("project", "--rebuild", "--json", store=store)
    assert_reports_the_corrupt_tree(rebuilt, bad, position)
    assert canon(dump(store)) == canon(before)
    # ... whatever the batch size (each batch its own transaction, "bad" split across them).
    small = agentfold("project", "--rebuild", "--batch", "3", "--json", store=store)
    assert_reports_the_corrupt_tree(small, bad, position)
    assert canon(dump(store)) == canon(before)


def test_a_tree_found_corrupt_after_it_was_projected_loses_its_rows_and_listings_answer_from_the_tables(
    durable_store_url: str, tmp_path: Path
) -> None:
    store = durable_store_url
    trees, bad, healthy = runs_with_one_to_damage(store, tmp_path)
    ran_ok(agentfold("project", store=store))  # the tables hold "bad" with its wait and unknown effect
    [bad_wait] = [p for p in ran_ok(agentfold("pending", "--json", store=store)).json()["pending"]
                  if p["tree_id"] == bad]
    ran_ok(agentfold("answer", bad_wait["process_id"], bad_wait["wait_id"], '{"approved": true}', store=store))
    position = corrupt(store, bad)  # an event the tables have not seen yet

    ran = agentfold("project", "--json", store=store)
    assert_reports_the_corrupt_tree(ran, bad, position)
    assert_tables(store, healthy, bad, position)  # no stale row of "bad" is left

    # The CLI listings answer from the current tables and name the tree as before (exit 1).
    listed = agentfold("pending", "--json", store=store)
    assert listed.code == 1
    assert [p["tree_id"] for p in listed.json()["pending"]] == [trees["wait-1"], trees["wait-2"]]
    assert without_detail(listed.json()["corrupt_trees"]) == [named(bad, "bad", position)]
    text = agentfold("project", store=store)
    assert (text.code, text.stderr) == (0, "")


def test_a_recorded_corrupt_tree_stays_skipped_until_a_rebuild_after_its_history_is_repaired(
    durable_store_url: str, tmp_path: Path
) -> None:
    store = durable_store_url
    trees = start_runs(store, tmp_path, "bad", "wait-1")
    bad = trees["bad"]
    sql = Sql(store)
    version, topic, original = sql.raw_rows(TreeID(bad))[-1]
    position = corrupt(store, bad)
    assert_reports_the_corrupt_tree(agentfold("project", "--json", store=store), bad, position)

    # The operator restores the event from a backup; the run goes on (more events of "bad").
    sql.set_row(TreeID(bad), version, topic, original)
    events = EventStore(store)
    try:
        [bad_wait] = HostQueries(events, default_sources(), use_read_models=False).pending(TreeID(bad))
    finally:
        events.close()
    ran_ok(agentfold("answer", bad_wait["process_id"], bad_wait["wait_id"], '{"approved": true}', store=store))

    # Its later events are skipped: still recorded, still no rows, nothing new reported.
    skipped = agentfold("project", "--json", store=store)
    assert (skipped.code, skipped.stderr) == (0, "")
    assert set(skipped.json()) == PROJECT_KEYS and skipped.json()["events"] > 0
    tables = dump(store)
    assert tables["position"] == head_of(store)
    assert [c["tree_id"] for c in tables["corrupt"]] == [bad]
    assert tables["trees"][bad] == empty_rows(bad)
    # audit says why the repaired tree has no rows, and what to do
    audited = agentfold("audit", "verify", bad, "--json", store=store)
    assert audited.code == 1 and "read_model.mismatch" in audited.stdout, audited.stdout
    assert f"recorded this tree corrupt at position {position}" in audited.stdout
    assert "`agentfold project --rebuild` projects it again" in audited.stdout

    # A rebuild reads the repaired history: "bad" is projected like any tree, nothing recorded.
    rebuilt = agentfold("project", "--rebuild", "--json", store=store)
    assert (rebuilt.code, rebuilt.stderr) == (0, "")
    assert set(rebuilt.json()) == PROJECT_KEYS
    tables = dump(store)
    assert tables["corrupt"] == []
    events = EventStore(store)
    try:
        tree, programs = HostQueries(events, default_sources(), use_read_models=False).fold(TreeID(bad))
        assert canon(tables["trees"][bad]) == canon(project_tree(tree, programs).to_json())
    finally:
        events.close()
    unknown = agentfold("unknown", "--json", store=store)
    assert unknown.code == 0 and bad in {u["tree_id"] for u in unknown.json()["unknown_effects"]}


# ---------------------------------------------------------------------------
# agentfold project --follow


def _wait_projected(url: str, tree_ids: list[str]) -> None:
    """Wait for the tables to reach the store's head, then check these trees' rows equal folding."""
    store = EventStore(url)
    try:
        models = ReadModels(store, create=False)
        head = store.max_notification_id()
        assert models.wait_for(head, timeout=30), f"read models stuck at {models.position()} of {head}"
        assert_rows_equal_folding(store, models, tree_ids)
    finally:
        store.close()


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for child in started:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


def test_project_follow_reports_each_corrupt_tree_once_and_keeps_projecting_the_others(
    durable_store_url: str, tmp_path: Path, children: list[subprocess.Popen[str]]
) -> None:
    store = durable_store_url
    trees = start_runs(store, tmp_path, "wait-1", "bad", "unknown-1")
    bad = trees["bad"]
    position = corrupt(store, bad)

    env = {**{k: v for k, v in os.environ.items() if k != "AGENTFOLD_STORE"}, "PYTHONPATH": str(ROOT)}
    follower = subprocess.Popen(
        [sys.executable, "-m", "agentfold.adapters.cli", "project", "--follow", "--store", store],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
    )
    children.append(follower)
    out, err = read_both(follower)
    stdout: list[str] = []
    stderr: list[str] = []

    # Met during the first catch-up: reported, and following starts anyway.
    line = expect_line(err, "is corrupt", 30, stderr)
    assert line.startswith(f"agentfold: project: tree {bad} (start bad) is corrupt at position {position}: "
                           "integrity.digest_chain: "), line
    expect_line(out, "following", 30, stdout)
    assert follower.poll() is None

    # Runs written while it follows are projected.
    trees.update(start_runs(store, tmp_path, "wait-2"))
    _wait_projected(store, [trees["wait-1"], trees["unknown-1"], trees["wait-2"]])

    # A tree damaged while it follows (an event appended with plain SQL that does not chain):
    # reported once as well, and the trees written after it are still projected.
    sql = Sql(store)
    damaged = TreeID(trees["unknown-1"])
    version, topic, state = sql.raw_rows(damaged)[-1]
    sql.insert(damaged, version + 1, topic, state)
    later = start(store, tmp_path, "later", approval(None))
    _wait_projected(store, [trees["wait-1"], trees["wait-2"], later])
    events = EventStore(store)
    try:
        recorded = ReadModels(events, create=False).corrupt_trees()
    finally:
        events.close()
    assert [(c.tree_id, c.position) for c in recorded] == [(bad, position), (str(damaged), version + 1)]
    line = expect_line(err, "is corrupt", 15, stderr)
    assert line.startswith(f"agentfold: project: tree {damaged} (start unknown-1) is corrupt at position "
                           f"{version + 1}: "), line

    time.sleep(1.5)  # many polls: a corrupt tree is not reported again
    follower.send_signal(signal.SIGTERM)
    assert follower.wait(timeout=30) == 0
    time.sleep(0.2)  # let the reader threads drain the pipes
    while not err.empty():
        stderr.append(err.get())
    while not out.empty():
        stdout.append(out.get())
    assert len([s for s in stderr if "is corrupt" in s]) == 2, stderr
    assert not [s for s in stderr if "following failed" in s or "Traceback" in s], stderr
    assert any("2 corrupt tree(s) found and skipped" in s for s in stdout), stdout


# ---------------------------------------------------------------------------
# agentfold serve's follower



def test_serve_keeps_its_read_models_current_past_a_corrupt_tree_and_logs_it_once(
    durable_store_url: str, tmp_path: Path, servers: list[ApiServer]
) -> None:
    store = durable_store_url
    trees = start_runs(store, tmp_path, "wait-1", "bad", "unknown-1")
    bad = trees["bad"]
    position = corrupt(store, bad)
    servers.append(server := start_server(store, tmp_path))
    c = server.client()

    def caught_up() -> bool:
        health = ok(httpx.get(server.url + "/health", timeout=10))
        return bool(health["positions"]["read_models"] == health["positions"]["store"])

    deadline = time.monotonic() + 30
    while not caught_up():
        assert time.monotonic() < deadline, server.logs()
        time.sleep(0.1)
    trees.update(start_runs(store, tmp_path, "wait-2"))  # written while it follows
    deadline = time.monotonic() + 30
    while not caught_up():
        assert time.monotonic() < deadline, server.logs()
        time.sleep(0.1)
    _wait_projected(store, [t for s, t in trees.items() if s != "bad"])

    body = problem(c.get("/pending-inputs"), 503, "store.corrupt")
    assert [p["tree_id"] for p in body["pending"]] == [trees["wait-1"], trees["wait-2"]]
    assert without_detail(body["corrupt_trees"]) == [named(bad, "bad", position)]
    time.sleep(2.5)  # the old follower failed and retried the same batch every second
    logs = server.logs()
    # Once by the follower (listings log the trees they could not read on their own lines).
    assert logs.count(f"read models: tree {bad} (start bad) is corrupt at position {position}") == 1, logs
    assert "read-model follower failed" not in logs and "Traceback" not in logs, logs
    assert ok(c.get("/health"))["follower"] == "running"


def test_project_records_a_tree_with_an_event_added_past_its_index_row_even_when_it_chains(
    durable_store_url: str, tmp_path: Path
) -> None:
    # Found by a regression audit: an event appended by hand with a correct digest chain was
    # projected (a forged answer or steering message in the tables) while every load refused
    # the tree (index.head_mismatch).
    store = durable_store_url
    _, bad, healthy = runs_with_one_to_damage(store, tmp_path)
    ran_ok(agentfold("project", store=store))  # "bad" has rows before the forgery
    forged = append_past_index_row(store, TreeID(bad))

    found = agentfold("project", "--json", store=store)
    assert found.code == 1, found.stderr
    [entry] = found.json()["corrupt_trees"]
    assert entry == {**named(bad, "bad", forged), "rule": "index.head_mismatch", "detail": entry["detail"]}
    assert entry["detail"].endswith("events were added past it")
    [error] = stderr_errors(found)
    assert error["detail"] == {"tree_id": bad, "start_id": "bad", "position": forged, "rule": "index.head_mismatch"}
    events = EventStore(store)
    try:
        models = ReadModels(events, create=False)
        [record] = models.corrupt_trees()
        assert (record.tree_id, record.position, record.rule) == (bad, forged, "index.head_mismatch")
        assert record.found_at == notification_of(events, bad, forged)
        assert models.tree_rows(bad) == empty_rows(bad)
        assert set(models.counters()) == set(healthy)
    finally:
        events.close()
    # a rebuild reproduces the record
    before = dump(store)
    rebuilt = agentfold("project", "--rebuild", "--json", store=store)
    assert rebuilt.code == 1 and canon(dump(store)) == canon(before)

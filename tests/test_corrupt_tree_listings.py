"""One corrupt tree does not take the store-wide listings down (docs/cli.md, docs/http-api.md).

A store holds several runs: two wait for a human (tool input waits), one is blocked on an
unknown tool outcome, and one ("bad") has both. Then one stored event of "bad" is
changed on disk with plain SQL (its recorded timestamp, as bit rot or a careless hand
would do it), so its digest chain breaks there. An operator who lists the pending
inputs, the unknown effects or the runs must still see every other tree's entries, and
be told which tree could not be read, where and which rule: the CLI prints the entries,
one stderr line per corrupt tree and exits 1; the HTTP API answers 503 ``store.corrupt``
whose problem document carries the entries and ``corrupt_trees``. The answer is the same
whether it comes from folding or from the read-model tables. A question about the
corrupt tree alone still fails with ``store.corrupt``, as before.

Everything runs for real: ``agentfold`` subprocesses, an ``agentfold serve`` process,
SQLite files and PostgreSQL databases.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.eventstore import CorruptStream, EventStore
from agentfold.adapters.queries import HostQueries
from agentfold.adapters.sources import default_sources
from agentfold.domain.ids import TreeID
from tests.audit.support import Sql
from tests.http_api.support import ApiServer, ok, problem, start_server
from tests.test_cli import Ran, agentfold
from tests.test_cli import ok as ran_ok
from tests.test_cli_interaction import approval, two_call_round, write

# Two concurrent tool calls: one asks a human (an input wait), one fails (its outcome is
# unknown). The run parks with a pending input and an unknown effect.
MIXED: dict[str, Any] = {
    "name": "mixed",
    "input": {"messages": [{"role": "user", "content": "Look up a, and ask for approval."}]},
    "model": {"responses": [
        {"finish_reason": "tool_calls", "message": {"tool_calls": [
            {"id": "call_ok", "name": "approve", "arguments": '{"amount_eur": 420}'},
            {"id": "call_a", "name": "alpha", "arguments": '{"q": "a"}'}]}},
        {"finish_reason": "stop", "message": {"content": "done"}}]},
    "limits": {"max_concurrent_tool_calls": 2},
    "tools": [
        {"name": "approve", "parameters": {"type": "object"}, "concurrency": {"key": "approve", "concurrent": True},
         "result": {"input": {"prompt": {"question": "Approve?"},
                              "response_schema": {"type": "object", "required": ["approved"],
                                                  "properties": {"approved": {"type": "boolean"}}}},
                    "then": {"answer": True}}},
        {"name": "alpha", "parameters": {"type": "object"}, "concurrency": {"key": "alpha", "concurrent": True},
         "result": {"error": "the alpha API is down"}},
    ],
}


def start(store: str, tmp_path: Path, start_id: str, doc: dict[str, Any]) -> str:
    """Run a scenario until it parks; its tree id."""
    scenario = write(tmp_path, doc, f"{start_id}.json")
    data = ran_ok(agentfold("run", str(scenario), "--start-id", start_id, "--json", store=store)).json()
    assert data["status"] == "waiting", data
    return str(data["tree_id"])


def start_runs(store: str, tmp_path: Path, *start_ids: str) -> dict[str, str]:
    """The runs of these tests, in creation order; start id -> tree id."""
    docs = {
        "wait-1": approval(None), "bad": MIXED, "unknown-1": two_call_round(None, alpha={"error": "down"},
                                                                             concurrent=True),
        "wait-2": approval(None),
    }
    return {s: start(store, tmp_path, s, docs[s]) for s in start_ids}


def runs_with_one_to_damage(store: str, tmp_path: Path) -> tuple[dict[str, str], str, list[str]]:
    """Runs "wait-1", "bad", "unknown-1", "wait-2" (start id -> tree id), the tree id of "bad"
    (the one a test damages) and the other three's, in creation order."""
    trees = start_runs(store, tmp_path, "wait-1", "bad", "unknown-1", "wait-2")
    return trees, trees["bad"], [t for s, t in trees.items() if s != "bad"]


def corrupt(store: str, tree_id: str, position: int | None = None) -> int:
    """Change the recorded timestamp of one stored event (the last one by default) with plain
    SQL: the event still parses, but its digest no longer chains. Returns its position."""
    sql = Sql(store)
    rows = sql.rows(TreeID(tree_id))
    version, topic, state = rows[-1] if position is None else next(r for r in rows if r[0] == position)
    tampered = state.replace(b'"timestamp":"2', b'"timestamp":"1', 1)
    assert tampered != state
    sql.set_row(TreeID(tree_id), version, topic, tampered)
    return version


def named(tree_id: str, start_id: str, position: int) -> dict[str, Any]:
    """How a listing names the corrupt tree (its ``detail`` checked apart)."""
    return {"tree_id": tree_id, "start_id": start_id, "code": "store.corrupt", "position": position,
            "rule": "integrity.digest_chain"}


def without_detail(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for entry in entries:
        assert entry["detail"].startswith("recorded digest sha256:"), entry
    return [{k: v for k, v in e.items() if k != "detail"} for e in entries]


def of_trees(entries: list[dict[str, Any]], *tree_ids: str) -> list[dict[str, Any]]:
    return [e for e in entries if e["tree_id"] in tree_ids]


def stderr_errors(ran: Ran) -> list[dict[str, Any]]:
    """The JSON error lines a ``--json`` command wrote to stderr."""
    return [json.loads(line)["error"] for line in ran.stderr.strip().splitlines()]


def assert_names_on_stderr(ran: Ran, tree_id: str, position: int) -> None:
    """One JSON stderr line naming the corrupt tree: code, tree, position, rule."""
    assert "Traceback" not in ran.stderr
    [error] = stderr_errors(ran)
    assert error["code"] == "store.corrupt"
    assert error["detail"] == {"tree_id": tree_id, "start_id": "bad", "position": position,
                               "rule": "integrity.digest_chain"}
    assert f"tree {tree_id} (start bad) is corrupt at position {position}: integrity.digest_chain" in error["message"]
    assert f"audit verify {tree_id}" in error["hint"]


# ---------------------------------------------------------------------------
# The CLI, answering by folding (no read-model tables)


def test_cli_listings_show_every_healthy_tree_and_name_the_corrupt_one_on_stderr_with_exit_1(
    durable_store_url: str, tmp_path: Path
) -> None:
    store = durable_store_url
    trees, bad, healthy = runs_with_one_to_damage(store, tmp_path)

    # A healthy store: exactly the documented output, nothing on stderr, exit 0.
    before = agentfold("pending", "--json", store=store)
    assert (before.code, before.stderr) == (0, "")
    assert set(before.json()) == {"pending"}
    pending = before.json()["pending"]
    assert [p["tree_id"] for p in pending] == [trees["wait-1"], bad, trees["wait-2"]]
    unknown_before = agentfold("unknown", "--json", store=store)
    assert (unknown_before.code, unknown_before.stderr) == (0, "")
    assert set(unknown_before.json()) == {"unknown_effects"}
    unknown = unknown_before.json()["unknown_effects"]
    assert sorted({u["tree_id"] for u in unknown}) == sorted([bad, trees["unknown-1"]])

    position = corrupt(store, bad)

    listed = agentfold("pending", "--json", store=store)
    assert listed.code == 1, listed.stderr
    data = listed.json()
    assert set(data) == {"pending", "corrupt_trees"}
    assert data["pending"] == of_trees(pending, *healthy)  # both healthy waits, unchanged, in order
    assert without_detail(data["corrupt_trees"]) == [named(bad, "bad", position)]
    assert_names_on_stderr(listed, bad, position)

    as_text = agentfold("pending", store=store)
    assert as_text.code == 1
    for entry in of_trees(pending, *healthy):
        assert f"process {entry['process_id']}  wait {entry['wait_id']}" in as_text.stdout
    assert bad not in as_text.stdout.split("\n\n1 tree(s) could not be read")[0]
    assert "1 tree(s) could not be read (store.corrupt): their tool waits are missing here" in as_text.stdout
    [line] = as_text.stderr.strip().splitlines()
    assert line.startswith(f"agentfold: error: store.corrupt: tree {bad} (start bad) is corrupt at position "
                           f"{position}: integrity.digest_chain: recorded digest"), line

    unknown_after = agentfold("unknown", "--json", store=store)
    assert unknown_after.code == 1, unknown_after.stderr
    assert unknown_after.json()["unknown_effects"] == of_trees(unknown, trees["unknown-1"])
    assert without_detail(unknown_after.json()["corrupt_trees"]) == [named(bad, "bad", position)]
    assert_names_on_stderr(unknown_after, bad, position)

    # A question about the corrupt tree alone fails as it always did.
    alone = agentfold("show", "bad", "--json", store=store)
    assert alone.code == 1
    [error] = stderr_errors(alone)
    assert error["code"] == "store.corrupt" and f"at position {position}: integrity.digest_chain" in error["message"]


def test_a_corrupt_tree_without_anything_to_list_still_makes_the_answer_incomplete(tmp_path: Path) -> None:
    """Only "bad" lists a wait: the answer is empty, but not 'no tool waits for input'."""
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    trees = start_runs(store, tmp_path, "bad", "unknown-1")
    position = corrupt(store, trees["bad"], 3)
    ran = agentfold("pending", store=store)
    assert ran.code == 1
    assert ran.stdout.startswith("no tool waits for input in the trees that could be read\n")
    assert "1 tree(s) could not be read" in ran.stdout
    assert f"tree {trees['bad']} (start bad) is corrupt at position {position}" in ran.stderr
    as_json = agentfold("pending", "--json", store=store)
    assert as_json.code == 1
    assert as_json.json()["pending"] == []
    assert without_detail(as_json.json()["corrupt_trees"]) == [named(trees["bad"], "bad", position)]


def test_a_question_about_the_corrupt_tree_alone_names_it_like_any_error(tmp_path: Path) -> None:
    """``show`` of the corrupt tree: exit 1, and its ``--json`` error has the shape of every
    error (``detail`` an object naming tree, position and rule; a ``hint`` saying what to run);
    a state rewritten by hand as SQLite TEXT is reported as such, not as a Python TypeError."""
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    trees = start_runs(store, tmp_path, "bad")
    bad = trees["bad"]
    position = corrupt(store, bad, 3)
    ran = agentfold("show", bad, "--json", store=store)
    assert ran.code == 1 and ran.stdout == ""
    [error] = stderr_errors(ran)
    assert error["code"] == "store.corrupt"
    assert error["detail"] == {"tree_id": bad, "position": position, "rule": "integrity.digest_chain"}
    assert f"tree {bad} is corrupt at position {position}: integrity.digest_chain: recorded digest" in error["message"]
    assert error["hint"] == f"see what is wrong with `agentfold audit verify {bad}`"

    sql = Sql(store)
    version, topic, state = sql.rows(TreeID(bad))[1]
    sql.set_row(TreeID(bad), version, topic, state.decode())  # type: ignore[arg-type]  # bound as TEXT
    text = agentfold("show", bad, store=store)
    assert text.code == 1 and "Traceback" not in text.stderr
    assert text.stderr.strip() == (
        f"agentfold: error: store.corrupt: tree {bad} is corrupt at position {version}: integrity.format: "
        f"stored state is text, not bytes (see what is wrong with `agentfold audit verify {bad}`)"
    )


# ---------------------------------------------------------------------------
# Read-model tables: the same answer as folding


def test_the_read_models_answer_like_folding_and_drop_the_corrupt_trees_stale_rows(
    durable_store_url: str, tmp_path: Path
) -> None:
    store = durable_store_url
    trees = start_runs(store, tmp_path, "wait-1", "bad", "unknown-1")
    ran_ok(agentfold("project", store=store))  # the tables hold every run so far, "bad" with its wait
    trees.update(start_runs(store, tmp_path, "wait-2"))
    bad = trees["bad"]
    [bad_wait] = [p for p in ran_ok(agentfold("pending", "--json", store=store)).json()["pending"]
                  if p["tree_id"] == bad]
    ran_ok(agentfold("answer", bad_wait["process_id"], bad_wait["wait_id"], '{"approved": true}', store=store))
    position = corrupt(store, bad)  # an event the tables have not seen yet

    # The follower records the corrupt tree, drops its rows and projects every other tree
    # (docs/read-models.md): the tables reach the store's head; exit 1 names the tree.
    projected = agentfold("project", "--json", store=store)
    assert projected.code == 1 and projected.error()["code"] == "store.corrupt"
    assert without_detail(projected.json()["corrupt_trees"]) == [named(bad, "bad", position)]

    listed = agentfold("pending", "--json", store=store)
    assert listed.code == 1, listed.stderr
    data = listed.json()
    # "bad"'s wait was answered: its row in the tables is stale and must not be listed.
    assert [p["tree_id"] for p in data["pending"]] == [trees["wait-1"], trees["wait-2"]]
    assert without_detail(data["corrupt_trees"]) == [named(bad, "bad", position)]
    assert_names_on_stderr(listed, bad, position)

    events = EventStore(store)
    try:
        tables = HostQueries(events, default_sources())
        folding = HostQueries(events, default_sources(), use_read_models=False)
        view = tables.view()
        # The tables path answers, current (nothing folded at query time), "bad" named by its record.
        assert view is not None and view[1].rows == {} and list(view[1].corrupt) == [bad]
        for question in ("pending", "unknown"):
            from_tables, folded = getattr(tables, question)(), getattr(folding, question)()
            assert from_tables == folded, question
            assert from_tables.corrupt == folded.corrupt == data["corrupt_trees"], question
        runs_tables, runs_folded = tables.runs(), folding.runs()
        assert [r["tree_id"] for r in runs_tables] == [r["tree_id"] for r in runs_folded] == [
            trees["wait-1"], trees["unknown-1"], trees["wait-2"]]
        assert runs_tables.corrupt == runs_folded.corrupt == data["corrupt_trees"]
        # A question about one healthy tree is answered from the tables; one about the corrupt
        # tree fails, whichever path.
        assert tables.run(TreeID(trees["wait-2"]))["start_id"] == "wait-2"
        for queries in (tables, folding):
            with pytest.raises(CorruptStream) as raised:
                queries.pending(TreeID(bad))
            assert (raised.value.code, raised.value.position) == ("store.corrupt", position)
    finally:
        events.close()


# ---------------------------------------------------------------------------
# The HTTP API



@pytest.mark.parametrize("follow", [True, False], ids=["read-models", "folding"])
def test_http_listings_answer_503_store_corrupt_with_every_healthy_entry_and_the_corrupt_tree(
    durable_store_url: str, tmp_path: Path, servers: list[ApiServer], follow: bool
) -> None:
    store = durable_store_url
    trees, bad, healthy = runs_with_one_to_damage(store, tmp_path)

    # A healthy store: 200, the documented members only. (No follower: it would bring the
    # tables up to date before the corruption, and the tables answer what they projected.)
    servers.append(before := start_server(store, tmp_path, "--no-follow"))
    c = before.client()
    pending = ok(c.get("/pending-inputs"))
    assert set(pending) == {"pending", "next_after"} and len(pending["pending"]) == 3
    assert pending["next_after"] is None
    unknown = ok(c.get("/unknown-effects"))
    assert set(unknown) == {"unknown_effects", "next_after"} and unknown["next_after"] is None
    runs = ok(c.get("/runs"))
    assert set(runs) == {"runs", "next_after"} and len(runs["runs"]) == 4
    servers.remove(before)
    assert before.stop()[0] == 0

    position = corrupt(store, bad)
    servers.append(server := start_server(store, tmp_path, *(() if follow else ("--no-follow",))))
    c = server.client()
    corrupt_trees = [named(bad, "bad", position)]

    body = problem(c.get("/pending-inputs"), 503, "store.corrupt")
    assert body["pending"] == of_trees(pending["pending"], *healthy)
    assert without_detail(body["corrupt_trees"]) == corrupt_trees
    assert bad in body["detail"] and "integrity.digest_chain" in body["detail"]
    assert "audit verify" in body["hint"]

    body = problem(c.get("/unknown-effects"), 503, "store.corrupt")
    assert body["unknown_effects"] == of_trees(unknown["unknown_effects"], *healthy)
    assert without_detail(body["corrupt_trees"]) == corrupt_trees

    body = problem(c.get("/runs"), 503, "store.corrupt")
    assert [r["tree_id"] for r in body["runs"]] == healthy
    assert (body["next_after"], without_detail(body["corrupt_trees"])) == (None, corrupt_trees)
    # Paging: a page whose range holds no corrupt tree is complete (200); the page whose
    # range holds it names it, and paging goes on past it.
    first = ok(c.get("/runs", params={"limit": 1}))
    assert [r["tree_id"] for r in first["runs"]] == [trees["wait-1"]] and "corrupt_trees" not in first
    second = problem(c.get("/runs", params={"limit": 1, "after": first["next_after"]}), 503, "store.corrupt")
    assert [r["tree_id"] for r in second["runs"]] == [trees["unknown-1"]]
    assert without_detail(second["corrupt_trees"]) == corrupt_trees
    third = ok(c.get("/runs", params={"limit": 1, "after": second["next_after"]}))
    assert [r["tree_id"] for r in third["runs"]] == [trees["wait-2"]]
    # The pending inputs page the same way ("bad" waits too; "unknown-1" has no wait).
    first = ok(c.get("/pending-inputs", params={"limit": 1}))
    assert first["pending"] == of_trees(pending["pending"], trees["wait-1"]) and "corrupt_trees" not in first
    second = problem(c.get("/pending-inputs", params={"limit": 1, "after": first["next_after"]}), 503, "store.corrupt")
    assert second["pending"] == of_trees(pending["pending"], trees["wait-2"])
    assert (second["next_after"], without_detail(second["corrupt_trees"])) == (None, corrupt_trees)

    # Questions about one tree: the healthy ones answer, the corrupt one fails as before.
    assert ok(c.get("/runs/wait-1/pending-inputs"))["pending"] == of_trees(pending["pending"], trees["wait-1"])
    assert ok(c.get("/runs/unknown-1"))["status"] == "waiting"
    alone = problem(c.get("/runs/bad"), 503, "store.corrupt")
    assert (alone["tree_id"], alone["position"], alone["rule"]) == (bad, position, "integrity.digest_chain")
    problem(c.get("/runs/bad/pending-inputs"), 503, "store.corrupt")
    assert "Traceback" not in server.logs()


@pytest.mark.parametrize("gone", ["first", "all"], ids=["first-event-gone", "every-event-gone"])
def test_a_tree_whose_first_event_is_gone_is_named_corrupt_not_taken_for_no_tree(
    durable_store_url: str, tmp_path: Path, gone: str
) -> None:
    """Found by an audit walkthrough: with position 1 of one run deleted (or all its events,
    its index row kept), ``unknown`` and ``pending`` failed as a whole, exit 2,
    engine.tree.not_found "tree ... does not exist" (the healthy runs' entries not listed), and
    ``show``, ``resolve``, ``replay`` said the same. The run is corrupt at position 1
    (integrity.missing_event), named as any other damage."""
    store = durable_store_url
    trees, bad, healthy = runs_with_one_to_damage(store, tmp_path)
    pending = ran_ok(agentfold("pending", "--json", store=store)).json()["pending"]
    sql = Sql(store)
    extra = " AND originator_version = 1" if gone == "first" else ""
    sql._run(f"DELETE FROM agentfold_events WHERE originator_id = ?{extra}", (sql._id(TreeID(bad)),))
    listed = agentfold("pending", "--json", store=store)
    assert listed.code == 1, listed.stderr
    assert listed.json()["pending"] == of_trees(pending, *healthy)
    [entry] = listed.json()["corrupt_trees"]
    assert (entry["tree_id"], entry["position"], entry["rule"]) == (bad, 1, "integrity.missing_event"), entry
    unknown = agentfold("unknown", "--json", store=store)
    assert unknown.code == 1 and [u["tree_id"] for u in unknown.json()["unknown_effects"]] == [trees["unknown-1"]]
    for argv in (("show", bad), ("replay", bad, "--at", "1")):
        shown = agentfold(*argv, store=store)
        assert shown.code == 1, (argv, shown.stdout, shown.stderr)
        assert "store.corrupt" in shown.stderr and "integrity.missing_event" in shown.stderr, shown.stderr
    again = agentfold("run", str(write(tmp_path, MIXED, "again.json")), "--start-id", "bad", "--json", store=store)
    assert again.code == 1 and "store.corrupt" in again.stderr, again.stderr  # was engine.start.in_progress

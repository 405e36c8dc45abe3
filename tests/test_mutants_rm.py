"""The read-model tables a follower keeps: behaviour the mutation audit of the tables (2026-12-05,
"rm") found undefended.

docs/read-models.md promises tables an operator may query with ``sqlite3`` (every column means
what the doc says, and agrees with the row's ``body``), rows that follow a run's changes, only
the unknown effects a host can still resolve, the Delegate starts of every Interaction of a run,
and an ``agentfold project`` that applies every event committed so far before it exits. The
existing checks compare the tables with ``project_tree`` (the same functions on both sides) and
``audit verify`` derives the expected columns with the writer's own functions, so a projection or
a column that is wrong the same way on both sides passed. These tests look from outside: the
SQLite file itself, and ``Host`` (the same ``HostQueries`` as the HTTP API), on a real SQLite
file with a real follower, in this process.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import orjson

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.follower import Follower
from agentfold.adapters.host import Host
from agentfold.adapters.read_models import ReadModels
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.scenario import scenario_input, scenario_program, validate_scenario
from agentfold.adapters.sources import default_sources
from tests.http_api.test_listing_pages import unknown_model_call, waits
from tests.interaction.tools import WAIT
from tests.test_mutants_reads import cancel, start_waiting


def project(store: EventStore) -> int:
    """What ``agentfold project`` does: every event committed so far into the tables; their position."""
    Follower(store, default_sources().catalog()).catch_up()
    return ReadModels(store).position()


def rows(db: Path, statement: str) -> list[dict[str, Any]]:
    """What an operator's ``sqlite3 agentfold.db`` shows (docs/read-models.md: plain SQL)."""
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute(statement)]


def start(runtime: Runtime, doc: dict[str, Any], start_id: str) -> str:
    checked = validate_scenario(doc)
    handle = runtime.start(scenario_program(checked), scenario_input(checked), start_id=start_id, configuration=checked)
    runtime.wait_idle(handle.tree_id, timeout=WAIT)
    return str(handle.tree_id)


def test_a_run_that_ends_after_the_tables_listed_it_waiting_is_listed_under_its_new_status(
    store: EventStore, db: Path,
) -> None:
    """Mutant RM4 (read_models.py ``_write_tree``: the run row's upsert no longer sets
    ``status``): a run first projected waiting kept ``status = 'waiting'`` in its row once it
    was canceled (its ``body`` said canceled), so ``GET /runs?status=waiting`` (the tables'
    status index) still listed the finished run and ``status=canceled`` left it out."""
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        trees = [start_waiting(runtime, 1, f"ends-{i}") for i in range(2)]
        project(store)
        cancel(runtime, trees[0])
        project(store)  # the tables are current again: every answer below is read from them
        host = Host(runtime, default_sources())

        def listed(status: str | None = None, classification: str | None = None) -> list[str]:
            page = host.runs(status=status, classification=classification)
            assert all(str(r["cursor"]).startswith("m") for r in page), "not read from the tables"
            return [str(r["tree_id"]) for r in page]

        assert listed(status="waiting") == [trees[1]]
        assert listed(status="canceled") == [trees[0]]
        assert listed(classification="terminal") == [trees[0]]
    assert rows(db, "SELECT tree_id, status, classification FROM agentfold_rm_runs ORDER BY created_position") == [
        {"tree_id": trees[0], "status": "canceled", "classification": "terminal"},
        {"tree_id": trees[1], "status": "waiting", "classification": "parked"},
    ]


def test_every_column_an_operator_queries_says_what_the_doc_and_the_rows_body_say(store: EventStore, db: Path) -> None:
    """Mutants RM30 (``_pending_columns``: the ``wait_id`` column holds the process id), RM31
    (``_round_columns``: ``entry_count`` holds the call count) and RM28 (the run row's upsert
    no longer sets ``position``). ``audit verify`` derives the expected columns with the
    writer's own functions, so a column wrong on both sides passed it; an operator's SQL
    (docs/read-models.md's own example selects ``wait_id``) answered wrongly."""
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        tree = start_waiting(runtime, 2, "columns")
        project(store)
        host = Host(runtime, default_sources())
        first, second = host.pending(tree)
        assert host.answer(first["process_id"], first["wait_id"], {"approved": True}) is True
        runtime.wait_idle(tree, timeout=WAIT)
        last = project(store)  # this batch changed the run: its row's position

    [run] = rows(db, "SELECT * FROM agentfold_rm_runs")
    body = orjson.loads(run["body"])
    assert (run["status"], run["classification"], run["version"]) == (body["status"], body["classification"],
                                                                     body["version"])
    assert run["position"] == last  # "notification id of the batch that last updated the row"
    assert run["events_projected"] == run["version"] == store.head(body["tree_id"]).version  # type: ignore[union-attr]

    pending = rows(db, "SELECT tree_id, process_id, wait_id, tool_call_ref, body FROM agentfold_rm_pending_inputs")
    assert [(p["process_id"], p["wait_id"]) for p in pending] == [(second["process_id"], second["wait_id"])]
    for p in pending:
        entry = orjson.loads(p["body"])
        assert (p["tree_id"], p["process_id"], p["wait_id"], p["tool_call_ref"]) == (
            entry["tree_id"], entry["process_id"], entry["wait_id"], entry["tool_call_ref"])
    # The answered call's round: open (one call still waits), one settled entry of two calls.
    [round_row] = rows(db, "SELECT * FROM agentfold_rm_settled_results")
    entry = orjson.loads(round_row["body"])
    assert (round_row["call_count"], round_row["entry_count"], bool(round_row["complete"])) == (2, 1, False)
    assert (round_row["call_count"], round_row["entry_count"], bool(round_row["complete"])) == (
        entry["call_count"], len(entry["entries"]), entry["complete"])
    assert (round_row["process_id"], round_row["model_call_sequence"], round_row["digest"]) == (
        entry["process_id"], entry["model_call_sequence"], entry["digest"])


def test_an_unknown_effect_of_a_canceled_run_is_no_longer_listed_for_a_host_to_resolve(
    store: EventStore, db: Path,
) -> None:
    """Mutant RM10 (projections/read_models.py ``unknown_entries``: the effects of terminal
    Processes kept): a run canceled while its model call was unknown stayed in
    ``agentfold unknown`` / ``GET /unknown-effects`` (tables and fold alike: the same
    projection), asking a host to resolve an effect that can no longer be resolved. The run
    keeps it as evidence (``unknown_effect_ids`` of its Process)."""
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        live = start(runtime, unknown_model_call(), "unknown-live")
        ended = start(runtime, unknown_model_call(), "unknown-ended")
        project(store)
        host = Host(runtime, default_sources())
        assert sorted(str(u["tree_id"]) for u in host.unknown()) == sorted([live, ended])
        [effect] = host.unknown(ended)
        cancel(runtime, ended)
        project(store)
        assert [str(u["tree_id"]) for u in host.unknown()] == [live]
        assert host.unknown(ended) == []
        # Still recorded on the ended run, for whoever investigates it.
        assert effect["effect_id"] in host.run(ended)["processes"][0]["unknown_effect_ids"]
    assert [r["tree_id"] for r in rows(db, "SELECT tree_id FROM agentfold_rm_unknown_effects")] == [live]
    counts = {r["tree_id"]: r["unknown_count"] for r in rows(db, "SELECT tree_id, unknown_count FROM agentfold_rm_runs")}
    assert counts == {live: 1, ended: 0}


def nested_delegation() -> dict[str, Any]:
    """A root Interaction that delegates to ``outer``, an Interaction that itself delegates to ``inner``."""
    def stop(text: str) -> dict[str, Any]:
        return {"finish_reason": "stop", "message": {"content": text}}

    def call(name: str, call_id: str) -> dict[str, Any]:
        return {"finish_reason": "tool_calls", "message": {"tool_calls": [
            {"id": call_id, "name": name, "arguments": "{}"}]}}

    inner = {"name": "inner", "input_schema": {"type": "object"},
             "scenario": {"name": "inner", "model": {"responses": [stop("inner done")]}}}
    outer = {"name": "outer", "input_schema": {"type": "object"},
             "scenario": {"name": "outer", "model": {"responses": [call("inner", "call_inner"), stop("outer done")]},
                          "delegates": [inner]}}
    return {"name": "nested", "input": {"messages": [{"role": "user", "content": "delegate twice"}]},
            "model": {"responses": [call("outer", "call_outer"), stop("all done")]}, "delegates": [outer]}


def test_a_delegate_started_by_a_nested_interaction_is_attributed_to_it_in_the_tables(
    store: EventStore, db: Path,
) -> None:
    """Mutant RM13 (projections/read_models.py ``delegate_entries``: only the root Interaction's
    Delegate starts projected): the Delegate a delegated Interaction started had no row, so
    ``agentfold delegates <outer>`` answered none (tables and fold alike) although it started one."""
    with Runtime(store, default_sources().catalog(), poll_interval=0) as runtime:
        tree = start(runtime, nested_delegation(), "nested")
        assert runtime.capture(tree).root.status == "completed"
        project(store)
        host = Host(runtime, default_sources())
        root = host.run(tree)["processes"][0]["process_id"]
        [outer] = host.delegates(root)["delegates"]
        assert outer["tool_call"]["name"] == "outer"
        answer = host.delegates(outer["child_process_id"])
        assert answer["found"] is True
        [inner] = answer["delegates"]
        assert inner["tool_call"]["name"] == "inner"
        assert inner["process_id"] == outer["child_process_id"]  # attributed to the Interaction that delegated
        assert inner["tool_call_ref"].startswith(str(outer["child_process_id"]))
        processes = {p["process_id"]: p for p in host.run(tree)["processes"]}
        assert processes[inner["child_process_id"]]["parent_id"] == outer["child_process_id"]
    stored = rows(db, "SELECT process_id, child_process_id FROM agentfold_rm_delegates ORDER BY ord")
    assert stored == [{"process_id": root, "child_process_id": outer["child_process_id"]},
                      {"process_id": outer["child_process_id"], "child_process_id": inner["child_process_id"]}]


def test_project_applies_every_event_committed_so_far_even_after_losing_a_turn_to_another_follower(
    store: EventStore,
) -> None:
    """Mutant RM22 (follower.py ``catch_up``: stop after any batch shorter than ``batch_size``,
    without comparing with the log's end): a follower whose batch lost its compare-and-set to
    another follower (``serve``'s, beside ``agentfold project``) applies nothing in that step;
    ``project`` then exited with runs committed before it started left out of the tables."""
    catalog = default_sources().catalog()
    with Runtime(store, catalog, poll_interval=0) as runtime:
        first = start(runtime, waits(1), "turn-1")
        late = Follower(store, catalog)  # reads its position now: 0
        Follower(store, catalog).catch_up()  # another follower commits past it meanwhile
        second = start(runtime, waits(1), "turn-2")
    late.catch_up()
    end = store.max_notification_id()
    assert late.position == ReadModels(store).position() == end
    models = ReadModels(store)
    assert [r["tree_id"] for r in models.runs()] == [first, second]
    assert models.counters()[second] == (store.head(second).version,) * 2  # type: ignore[union-attr,arg-type]

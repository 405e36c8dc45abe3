"""`audit verify` checks every column of the read-model rows, not only their entries.

The queries filter, order and count on columns written next to each entry (``body``): a
delegate attribution is looked up by ``process_id``, waits and unknown Effects are paged by
``created_position``, a run's counts are listed as they are stored. Verify compared the
entries alone: a row whose ``process_id`` column was edited (its entry untouched) made
`agentfold delegates` lose an attribution while verify said "read models equal" (found by a
review of delegates and their projections). Each damaged column is now a
``read_model.mismatch`` naming the table, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentfold.domain.ids import StartID, TreeID
from tests.audit.support import Sql
from tests.test_cli import agentfold, ok

PARENT = {
    "name": "parent",
    "model": {"responses": [
        {"finish_reason": "tool_calls", "message": {"tool_calls": [
            {"id": "c_a", "name": "worker_a", "arguments": "{\"task\": \"a\"}"},
            {"id": "c_b", "name": "worker_b", "arguments": "{\"task\": \"b\"}"},
        ]}},
        {"finish_reason": "stop", "message": {"content": "all done"}},
    ]},
    "delegates": [
        {"name": "worker_a", "input_schema": {"type": "object"},
         "scenario": {"name": "wa", "model": {"responses": [{"finish_reason": "stop", "message": {"content": "a"}}]}}},
        {"name": "worker_b", "input_schema": {"type": "object"},
         "scenario": {"name": "wb", "model": {"responses": [
             {"finish_reason": "tool_calls", "message": {"tool_calls": [{"id": "b1", "name": "ask", "arguments": "{}"}]}},
             {"finish_reason": "stop", "message": {"content": "b done"}}]},
             "tools": [{"name": "ask", "result": {"input": {"prompt": "ok?", "response_schema": {"type": "string"}},
                                                  "then": {"answer": True}}}]}},
    ],
}

DAMAGE = {
    # table, column edited (its entry left alone), what the tamperer sets
    "a delegate's process_id": ("agentfold_rm_delegates", "process_id", "'process:00000000000000000000000000000000'"),
    "a delegate's child_process_id": ("agentfold_rm_delegates", "child_process_id",
                                      "'process:11111111111111111111111111111111'"),
    "a wait's created_position": ("agentfold_rm_pending_inputs", "created_position", "created_position + 1000"),
    "a round's call_count": ("agentfold_rm_settled_results", "call_count", "call_count + 1"),
    "a run's pending_count": ("agentfold_rm_runs", "pending_count", "pending_count + 1"),
    "a run's status": ("agentfold_rm_runs", "status", "'completed'"),
    "a row's ord": ("agentfold_rm_delegates", "ord", "ord + 5"),
    "a run's created_position": ("agentfold_rm_runs", "created_position", "created_position + 100000"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_read_model_column_is_a_mismatch(durable_store_url: str, tmp_path: Path, damage: str) -> None:
    url = durable_store_url
    scenario = tmp_path / "parent.json"
    scenario.write_text(json.dumps(PARENT))
    ran = agentfold("--json", "run", str(scenario), "--start-id", "cols-1", store=url)
    assert ran.code == 0, ran.stderr
    ok(agentfold("project", store=url))
    verified = agentfold("--json", "audit", "verify", "--all", store=url)
    assert verified.code == 0, verified.stdout  # the rows as the follower wrote them verify
    table, column, value = DAMAGE[damage]
    tree_id = TreeID.for_start(StartID("cols-1"))
    where = "tree_id = ?" + (" AND ord = (SELECT MAX(ord) FROM " + table + " WHERE tree_id = ?)"
                             if table != "agentfold_rm_runs" else "")
    params = (str(tree_id),) * (1 if table == "agentfold_rm_runs" else 2)
    assert Sql(url)._run(f"SELECT COUNT(*) FROM {table} WHERE {where}", params)[0][0] == 1
    Sql(url)._run(f"UPDATE {table} SET {column} = {value} WHERE {where}", params)
    verified = agentfold("--json", "audit", "verify", "--all", store=url)
    assert verified.code == 1, verified.stdout
    (result,) = verified.json()["results"]
    problems = [p for p in result["problems"] if p["rule"] == "read_model.mismatch"]
    assert problems and any(table in p["detail"] for p in problems), result


@pytest.mark.parametrize("table", ["agentfold_rm_runs", "agentfold_rm_delegates"])
def test_rows_of_a_tree_the_store_does_not_have_are_a_failing_entry_of_verify_all(
    durable_store_url: str, tmp_path: Path, table: str,
) -> None:
    # A copy of a tree's rows under a tree id the store does not have: `agentfold delegates`
    # listed each attribution twice (the runs listing the run twice), and verify --all, which
    # reads the trees of the store, never looked at them.
    url = durable_store_url
    scenario = tmp_path / "parent.json"
    scenario.write_text(json.dumps(PARENT))
    assert agentfold("--json", "run", str(scenario), "--start-id", "cols-2", store=url).code == 0
    ok(agentfold("project", store=url))
    tree_id = TreeID.for_start(StartID("cols-2"))
    orphan = str(TreeID.for_start(StartID("never-started")))
    sql = Sql(url)
    columns = [row[0] for row in sql._run(
        "SELECT name FROM pragma_table_info(?)" if url.startswith("sqlite") else
        "SELECT column_name FROM information_schema.columns WHERE table_name = ? ORDER BY ordinal_position",
        (table,))]
    others = ", ".join(c for c in columns if c != "tree_id")
    sql._run(f"INSERT INTO {table} (tree_id, {others}) SELECT ?, {others} FROM {table} WHERE tree_id = ?",
             (orphan, str(tree_id)))
    assert ok(agentfold("--json", "audit", "verify", str(tree_id), store=url)).json()["ok"] is True  # that tree is fine
    verified = agentfold("--json", "audit", "verify", "--all", store=url)
    assert verified.code == 1, verified.stdout
    results = {r["tree"]: r for r in verified.json()["results"]}
    assert results[str(tree_id)]["ok"] is True
    (problem,) = results[orphan]["problems"]
    assert problem["rule"] == "read_model.mismatch" and "does not have" in problem["detail"], problem

"""`agentfold audit verify` against forgeries only the Interaction's own rules can see.

A forger with write access rewrites an event of a recorded trip-planner run (the bundled
demo scenario: two tool rounds, a human input wait) with plain SQL, then re-chains every
later event with the documented digest formula and rewrites the tree index's head digest,
so the digest chain and the index stay valid. The kernel rules hold too (a tool round's
contents are opaque to the kernel): verification without Programs passes. Only the fold
with the scenario Program bound (its Interaction strategy's ``evolve``) can refuse the
history, and it must name the tree, the position and the rule (``step.evolve``).

The last test tampers with the process index (``agentfold_processes``) instead.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.sources import ProgramSources
from agentfold.domain.ids import TreeID
from agentfold.domain.integrity import chain_digest, content_bytes, seal, unseal
from tests.audit.support import Sql, cli, record_chain, record_demo

Edit = Callable[[dict[str, Any]], dict[str, Any]]


def events(sql: Sql, tree_id: TreeID) -> list[tuple[int, str, dict[str, Any]]]:
    """(position, event type, stored body) of every event of the tree."""
    return [(v, topic.split(":", 1)[1], unseal(state).body) for v, topic, state in sql.rows(tree_id)]


def forge(sql: Sql, tree_id: TreeID, position: int, edit: Edit) -> None:
    """Rewrite one event's body, re-chain every event after it and re-anchor the tree index.

    Timestamps, topics and positions stay; each later digest is recomputed with the
    documented formula (docs/events.md), exactly what a forger without a secret can do.
    """
    rows = sql.rows(tree_id)
    previous: str | None = None
    for version, topic, state in rows:
        sealed = unseal(state)
        if version < position:
            previous = sealed.digest
            continue
        body = edit(orjson.loads(orjson.dumps(sealed.body))) if version == position else sealed.body
        content = content_bytes(body, sealed.timestamp)
        previous = chain_digest(previous, str(tree_id), version, topic.split(":", 1)[1], content)
        sql.set_row(tree_id, version, topic, seal(content, previous))
    assert previous is not None
    sql.set_head(tree_id, rows[-1][0], previous)  # the index's version is unchanged; its head digest follows


def model_settlement(sql: Sql, tree_id: TreeID, sequence: int) -> int:
    """The position of the settlement of the Interaction's ``sequence``-th model call."""
    declared = next(
        body["effect_id"] for _, kind, body in events(sql, tree_id)
        if kind == "EffectDeclared" and body["payload"].get("model_call", {}).get("model_call_sequence") == sequence
    )
    return next(v for v, kind, body in events(sql, tree_id) if kind == "EffectSettled" and body["effect_id"] == declared)


def step_starting_tool(sql: Sql, tree_id: TreeID, sequence: int, index: int) -> int:
    """The position of the Interaction's StepCommitted whose Step starts the Tool child of call ``index``."""
    found = events(sql, tree_id)
    declared = next(
        v for v, kind, body in found
        if kind == "EffectDeclared" and body["payload"].get("key") == f"interaction.tool.{sequence}.{index}"
    )
    return declared - 1  # a Step's StepCommitted comes right before its EffectDeclared


def tool_calls_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    return body["payload"]["model_result"]["response"]["message"]["tool_calls"]  # type: ignore[no-any-return]


def verify(capsys: pytest.CaptureFixture[str], store: str, sources: ProgramSources | None = None) -> tuple[int, Any]:
    ran = cli(capsys, "audit", "verify", "--all", "--json", "--store", store, sources=sources)
    return ran.code, ran.json()


def assert_only_the_interaction_rules_refuse(capsys: pytest.CaptureFixture[str], store: str) -> None:
    """The chain, the index and every kernel rule accept the forged history."""
    code, report = verify(capsys, store, ProgramSources())  # no Program bound: the kernel's rules only
    assert code == 0, report["first_error"]
    assert report["results"][0]["programs_bound"] is False


def test_a_model_response_rewritten_to_drop_a_tool_call_is_refused_where_the_round_starts_that_call(
    capsys: pytest.CaptureFixture[str], durable_store_url: str, tmp_path: Path
) -> None:
    store = durable_store_url
    tree_id = record_demo(tmp_path / "run", store)
    sql = Sql(store)
    code, report = verify(capsys, store)
    assert code == 0, report["first_error"]
    settled = model_settlement(sql, tree_id, 1)
    assert [c["name"] for c in tool_calls_of(events(sql, tree_id)[settled - 1][2])] == ["weather", "book_hotel"]
    booking = step_starting_tool(sql, tree_id, 1, 1)

    def drop_booking(body: dict[str, Any]) -> dict[str, Any]:
        del tool_calls_of(body)[1]  # the history now says the model only asked for the weather
        return body

    forge(sql, tree_id, settled, drop_booking)
    assert_only_the_interaction_rules_refuse(capsys, store)
    code, report = verify(capsys, store)
    assert code == 1 and report["ok"] is False
    error = report["first_error"]
    # The hotel was booked for a call the (forged) model response does not contain.
    assert (error["tree"], error["position"], error["rule"]) == (str(tree_id), booking, "step.evolve")
    assert "model call 1 asked for 1 tool call(s); there is no call at index 1" in error["detail"]


def test_a_waiting_run_whose_model_response_lost_its_tool_call_is_refused_where_the_tool_starts(
    capsys: pytest.CaptureFixture[str], durable_store_url: str, tmp_path: Path
) -> None:
    """The run waits for the human's budget approval; the forger removes the call that asked for it."""
    store = durable_store_url
    tree_id = record_demo(tmp_path / "run", store, answer=False)
    sql = Sql(store)
    settled = model_settlement(sql, tree_id, 2)
    assert [c["name"] for c in tool_calls_of(events(sql, tree_id)[settled - 1][2])] == ["approve_budget"]
    approval = step_starting_tool(sql, tree_id, 2, 0)

    def drop_approval(body: dict[str, Any]) -> dict[str, Any]:
        tool_calls_of(body).clear()
        return body

    forge(sql, tree_id, settled, drop_approval)
    assert_only_the_interaction_rules_refuse(capsys, store)
    code, report = verify(capsys, store)
    assert code == 1
    error = report["first_error"]
    assert (error["tree"], error["position"], error["rule"]) == (str(tree_id), approval, "step.evolve")
    assert "model call 2 asked for 0 tool call(s); there is no call at index 0" in error["detail"]


def test_a_round_recorded_as_finished_without_a_tool_result_is_refused_at_that_step(
    capsys: pytest.CaptureFixture[str], durable_store_url: str, tmp_path: Path
) -> None:
    store = durable_store_url
    tree_id = record_demo(tmp_path / "run", store)
    sql = Sql(store)
    # The Step that records the approval's result and finishes the second round's batch.
    found = {v: (kind, body) for v, kind, body in events(sql, tree_id)}
    (finishing,) = [
        v for v, (kind, body) in found.items()
        if kind == "StepCommitted" and body.get("facts", {}).get("ops") == [{"op": "record_outcomes"}, {"op": "finish_batch"}]
        and found[v + 1][0] == "CheckpointCommitted" and found[v + 1][1]["acknowledges"]["model_call_sequence"] == 2
    ]

    def skip_the_result(body: dict[str, Any]) -> dict[str, Any]:
        body["facts"] = {"ops": [{"op": "finish_batch"}]}
        return body

    forge(sql, tree_id, finishing, skip_the_result)
    assert_only_the_interaction_rules_refuse(capsys, store)
    code, report = verify(capsys, store)
    assert code == 1
    error = report["first_error"]
    assert (error["tree"], error["position"], error["rule"]) == (str(tree_id), finishing, "step.evolve")
    assert "a batch finished with a call without a result" in error["detail"]


@pytest.mark.parametrize("tampering", ["repoint", "delete"])
def test_a_process_index_row_moved_or_deleted_is_a_process_mismatch(
    capsys: pytest.CaptureFixture[str], durable_store_url: str, tmp_path: Path, tampering: str
) -> None:
    store = durable_store_url
    tree_id = record_demo(tmp_path / "run", store)
    other = record_chain(store, n=1, start_id="another-tree")
    sql = Sql(store)
    code, report = verify(capsys, store)
    assert code == 0 and report["trees"] == 2, report["first_error"]
    # The approval tool's Process (the Tool child that asked the human).
    (tool,) = [
        body["process_id"] for _, kind, body in events(sql, tree_id)
        if kind == "SignalAdmitted" and body.get("wait_id")
    ]
    assert sql._run("SELECT tree_id FROM agentfold_processes WHERE process_id = ?", (tool,)) == [(str(tree_id),)]
    if tampering == "repoint":
        sql._run("UPDATE agentfold_processes SET tree_id = ? WHERE process_id = ?", (str(other), tool))
    else:
        sql._run("DELETE FROM agentfold_processes WHERE process_id = ?", (tool,))
    code, report = verify(capsys, store)
    assert code == 1
    error = report["first_error"]
    last = len(sql.rows(tree_id))
    assert (error["tree"], error["position"], error["rule"]) == (str(tree_id), last, "index.process_mismatch")
    assert tool in error["detail"]
    assert (str(other) if tampering == "repoint" else "no tree") in error["detail"]
    by_tree = {r["tree"]: r for r in report["results"]}
    assert not by_tree[str(tree_id)]["ok"]
    if tampering == "delete":
        assert by_tree[str(other)]["ok"]
    else:  # the other tree now indexes a Process its history lacks
        (problem,) = by_tree[str(other)]["problems"]
        assert (problem["rule"], problem["position"]) == ("index.process_mismatch", len(sql.rows(other)))
        assert f"process {tool} is indexed under this tree, but the tree's history has no such Process" in problem["detail"]


def test_a_process_row_naming_a_process_the_history_lacks_is_a_process_mismatch(
    capsys: pytest.CaptureFixture[str], durable_store_url: str, tmp_path: Path
) -> None:
    """What a history cut back before a child was created leaves (with its tree row rewritten to
    match): a row of agentfold_processes under the tree for a Process its events never create."""
    store = durable_store_url
    tree_id = record_demo(tmp_path / "run", store)
    other = record_chain(store, n=1, start_id="another-tree")
    sql = Sql(store)
    stale = "process:" + "ab" * 16
    sql._run("INSERT INTO agentfold_processes (process_id, tree_id) VALUES (?, ?)", (stale, str(tree_id)))
    code, report = verify(capsys, store)
    assert code == 1
    error = report["first_error"]
    assert (error["tree"], error["position"], error["rule"]) == (
        str(tree_id), len(sql.rows(tree_id)), "index.process_mismatch")
    assert error["detail"] == f"process {stale} is indexed under this tree, but the tree's history has no such Process"
    assert {r["tree"]: r["ok"] for r in report["results"]} == {str(tree_id): False, str(other): True}
    sql._run("DELETE FROM agentfold_processes WHERE process_id = ?", (stale,))
    code, report = verify(capsys, store)
    assert code == 0, report["first_error"]


def test_a_process_row_an_append_wrote_while_the_tree_was_verified_is_not_called_stale(
    capsys: pytest.CaptureFixture[str], durable_store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live tree: an append that creates a Process commits its row with the tree's new index
    row, after verify read the history. The row is not the history's yet, and not stale."""
    store = durable_store_url
    tree_id = record_demo(tmp_path / "run", store)
    sql = Sql(store)
    created = "process:" + "cd" * 16
    real = EventStore.processes_of_tree

    def with_an_append_committing_first(self: EventStore, tree: TreeID) -> list[str]:
        if tree == tree_id and not sql._run("SELECT 1 FROM agentfold_processes WHERE process_id = ?", (created,)):
            # What the append's transaction writes to the index (its events are not read again).
            sql._run("INSERT INTO agentfold_processes (process_id, tree_id) VALUES (?, ?)", (created, str(tree_id)))
            sql._run("UPDATE agentfold_trees SET updated_at = ? WHERE tree_id = ?", ("2026-12-02T00:00:00Z", str(tree_id)))
        return real(self, tree)

    monkeypatch.setattr(EventStore, "processes_of_tree", with_an_append_committing_first)
    code, report = verify(capsys, store)
    assert code == 0, report["first_error"]
    monkeypatch.undo()  # the tree at rest, the row still naming a Process its history lacks
    code, report = verify(capsys, store)
    assert code == 1 and report["first_error"]["rule"] == "index.process_mismatch", report["first_error"]
    assert created in report["first_error"]["detail"]

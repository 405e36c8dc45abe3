"""Behaviour of the host surfaces that the rest of the suite did not pin down (found by mutation).

Each test runs the real ``agentfold`` CLI as a child process on a real SQLite file (the
helpers of ``tests/test_cli.py`` and ``tests/test_cli_interaction.py``) and asserts only
what an operator observes: exit statuses, the documented ``--json`` answers, and what
the store holds.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_cli import agentfold, ok, refused, sqlite_url, store_version
from tests.test_cli_interaction import approval, run_json, write


def pending(store: str) -> list[dict[str, object]]:
    return ok(agentfold("pending", "--json", store=store)).json()["pending"]  # type: ignore[no-any-return]


def test_a_wait_answered_while_its_tool_child_is_paused_is_no_longer_pending_on_either_read_path(
    tmp_path: Path,
) -> None:
    """An answer admitted while the Tool child is paused stays queued (the child consumes it
    only after resume), but the wait is answered: ``pending`` must not offer it again, neither
    by folding nor from the read-model tables, and a second answer appends nothing."""
    store = sqlite_url(tmp_path)
    run = run_json(store, write(tmp_path, approval(None)))
    assert run["status"] == "waiting"
    [wait] = pending(store)
    child = str(wait["process_id"])
    assert ok(agentfold("pause", child, "--json", store=store)).json()["recorded"] is True
    assert [w["wait_id"] for w in pending(store)] == [wait["wait_id"]]  # still pending while paused

    answered = ok(agentfold("answer", child, str(wait["wait_id"]), '{"approved": true}', "--json", store=store)).json()
    assert answered["accepted"] is True
    assert ok(agentfold("show", child, "--json", store=store)).json()["processes"][1]["status"] == "paused"

    assert pending(store) == []  # by folding (no read models yet)
    text = ok(agentfold("pending", store=store)).stdout
    assert "no tool waits for input" in text
    ok(agentfold("project", "--json", store=store))
    assert pending(store) == []  # from the read-model tables, now current

    before = store_version(store, run["tree_id"])
    again = refused(agentfold("answer", child, str(wait["wait_id"]), '{"approved": false}', "--json", store=store))
    assert again.error()["code"] == "engine.signal.rejected"
    assert store_version(store, run["tree_id"]) == before  # nothing appended for the refused answer

    ok(agentfold("resume", child, "--json", store=store))
    shown = ok(agentfold("show", run["tree_id"], "--json", store=store)).json()
    assert shown["processes"][0]["status"] == "completed"
    assert pending(store) == []


DELEGATE_LEFT_UNKNOWN = {
    "name": "delegate-left-unknown",
    "input": {"messages": [{"role": "user", "content": "Write a poem about the sea."}]},
    "model": {"responses": [
        {"finish_reason": "tool_calls", "message": {"tool_calls": [
            {"id": "call_w", "name": "writer", "arguments": '{"topic": "sea"}'}]}},
        {"finish_reason": "stop", "message": {"content": "never reached"}},
    ]},
    "delegates": [{
        "name": "writer", "description": "Writes a poem.",
        "input_schema": {"type": "object", "required": ["topic"], "properties": {"topic": {"type": "string"}}},
        # The Delegate's only model call raises: its outcome is unknown until a host settles it.
        "scenario": {"name": "writer", "model": {"responses": [{"error": "provider timeout"}]}},
    }],
}


def test_a_delegate_that_ended_with_an_unresolved_unknown_effect_has_no_settled_result(tmp_path: Path) -> None:
    """SettledResults holds a Delegate's result only once its subtree is terminal **and** has no
    unknown effect (reference 4.4, 6.1). The parent is paused, so it has not consumed the
    Delegate's end yet: ``results`` reads the Delegate child itself, which was canceled with
    its model call unknown, and must not report it as a definite "failed" result. On resume
    the parent fails naming the unresolved effect."""
    store = sqlite_url(tmp_path)
    run = run_json(store, write(tmp_path, DELEGATE_LEFT_UNKNOWN))
    [unknown] = ok(agentfold("unknown", "--json", store=store)).json()["unknown_effects"]
    delegate = str(unknown["process_id"])
    assert unknown["kind"] == "model" and delegate != run["root_process_id"]

    ok(agentfold("pause", run["root_process_id"], "--json", store=store))
    ok(agentfold("cancel", delegate, "--json", store=store))
    statuses = [p["status"] for p in ok(agentfold("show", run["tree_id"], "--json", store=store)).json()["processes"]]
    assert statuses == ["paused", "canceled"]

    results = ok(agentfold("results", run["tree_id"], "--json", store=store)).json()
    assert results == {"tree_id": run["tree_id"], "rounds": []}
    ok(agentfold("project", "--json", store=store))  # the read-model path answers the same
    assert ok(agentfold("results", run["tree_id"], "--json", store=store)).json() == results

    ok(agentfold("resume", run["root_process_id"], "--json", store=store))
    root = ok(agentfold("show", run["tree_id"], "--json", store=store)).json()["processes"][0]
    assert root["status"] == "failed"
    assert root["termination"]["failure"]["code"] == "interaction.delegate.unresolved_effects"


def test_an_answer_naming_a_wait_that_is_not_the_tool_childs_current_one_is_refused_and_appends_nothing(
    tmp_path: Path,
) -> None:
    """``answer PROCESS WAIT JSON`` answers exactly the wait it names: an answer meant for another
    wait (a stale one, or a mistyped id) must not be taken as the answer to whatever the Tool
    child waits for now. It is refused (exit 2, engine.signal.rejected), nothing is appended,
    and the real wait is still pending and still takes its own answer."""
    store = sqlite_url(tmp_path)
    run = run_json(store, write(tmp_path, approval(None)))
    [wait] = pending(store)
    child, current = str(wait["process_id"]), str(wait["wait_id"])
    other = "wait:" + "ab" * 32
    assert other != current
    before = store_version(store, run["tree_id"])

    ran = refused(agentfold("answer", child, other, '{"approved": true}', "--json", store=store))
    error = ran.error()
    assert error["code"] == "engine.signal.rejected"
    assert other in error["message"] and current in error["message"]  # says which wait is current
    assert store_version(store, run["tree_id"]) == before
    assert pending(store) == [wait]

    ok(agentfold("answer", child, current, '{"approved": true}', "--json", store=store))
    assert ok(agentfold("show", run["tree_id"], "--json", store=store)).json()["processes"][0]["status"] == "completed"

"""Host views of the projections that no other test pinned down (found by mutation, area ``proj``).

Each test drives a scenario with the real ``agentfold`` CLI in child processes on a real
SQLite file (helpers of ``tests/test_cli.py`` and ``tests/test_cli_interaction.py``) and
asserts only what an operator reads from the documented ``--json`` answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.test_cli import agentfold, ok, sqlite_url
from tests.test_cli_interaction import run_json, write

WRITER = {
    "name": "writer", "description": "Writes a poem.",
    "input_schema": {"type": "object", "required": ["topic"], "properties": {"topic": {"type": "string"}}},
    "scenario": {"name": "writer", "model": {"responses": [
        {"finish_reason": "stop", "message": {"content": "Waves on waves."}}]}},
}


def writer_call(call_id: str, topic: str) -> dict[str, str]:
    return {"id": call_id, "name": "writer", "arguments": f'{{"topic": "{topic}"}}'}


def test_delegates_lists_every_delegated_call_in_model_call_order_then_call_order(tmp_path: Path) -> None:
    """Two Delegates started by model call 1 and one by model call 2: ``delegates`` lists them
    by model call first (1/0, 1/1, 2/0), each naming its own call and child, whichever read
    path answers (folding, then the read-model tables)."""
    store = sqlite_url(tmp_path)
    doc: dict[str, Any] = {
        "name": "three-poems",
        "input": {"messages": [{"role": "user", "content": "Write three poems."}]},
        "model": {"responses": [
            {"finish_reason": "tool_calls", "message": {"tool_calls": [
                writer_call("call_sea", "sea"), writer_call("call_sky", "sky")]}},
            {"finish_reason": "tool_calls", "message": {"tool_calls": [writer_call("call_sand", "sand")]}},
            {"finish_reason": "stop", "message": {"content": "Three poems."}},
        ]},
        "delegates": [WRITER],
    }
    started = run_json(store, write(tmp_path, doc), "--start-id", "poems")
    assert started["status"] == "completed"
    root = started["root_process_id"]
    processes = {p["process_id"]: p for p in ok(agentfold("show", "poems", "--json", store=store)).json()["processes"]}

    def listed() -> list[tuple[str, str, str]]:
        answer = ok(agentfold("delegates", root, "--json", store=store)).json()["delegates"]
        for d in answer:
            child = processes[d["child_process_id"]]
            assert (child["parent_id"], child["child_key"]) == (root, d["child_key"])  # the call's own child
        return [(d["tool_call_ref"], d["tool_call"]["id"], processes[d["child_process_id"]]["status"]) for d in answer]

    expected = [(f"{root}/1/0", "call_sea", "completed"), (f"{root}/1/1", "call_sky", "completed"),
                (f"{root}/2/0", "call_sand", "completed")]
    assert listed() == expected  # by folding
    ok(agentfold("project", "--json", store=store))
    assert listed() == expected  # from the read-model tables


def test_a_host_resolution_a_paused_tool_child_has_not_taken_yet_is_already_a_settled_result(tmp_path: Path) -> None:
    """beta's call is unknown; its Tool child is paused; the host resolves the call. The child
    takes no Step until resumed, yet the outcome is definite: ``results`` lists it under its own
    call with the host's output and disposition (recovery must not run beta again)."""
    from tests.test_cli_interaction import two_call_round, unknowns

    store = sqlite_url(tmp_path)
    started = run_json(store, write(tmp_path, two_call_round(None, beta={"error": "down"})), "--start-id", "paused-1")
    root = started["root_process_id"]
    [beta] = unknowns(store, started["tree_id"])
    assert (beta["kind"], beta["tool_call_ref"]) == ("tool", f"{root}/1/1")
    child = str(beta["process_id"])
    assert ok(agentfold("pause", child, "--json", store=store)).json()["recorded"] is True
    ok(agentfold("resolve", beta["effect_id"], "--output", '"beta (from the host)"', "--disposition", "rejected",
                 store=store))
    shown = {p["process_id"]: p for p in ok(agentfold("show", "paused-1", "--json", store=store)).json()["processes"]}
    assert shown[child]["status"] == "paused"  # the child has not consumed the resolution

    [r] = ok(agentfold("results", "paused-1", "--json", store=store)).json()["rounds"]
    assert (r["process_id"], r["model_call_sequence"], r["call_count"], r["complete"]) == (root, 1, 2, True)
    assert [(e["tool_call_index"], e["disposition"], e["result"]) for e in r["entries"]] == [
        (0, "succeeded", {"id": "call_a", "name": "alpha", "output": {"content": [{"type": "text", "text": "alpha says A"}]}}),
        (1, "rejected", {"id": "call_b", "name": "beta", "is_error": True,
                         "output": {"content": [{"type": "text", "text": "beta (from the host)"}]}}),
    ]

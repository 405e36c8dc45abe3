"""The Interaction commands of the ``agentfold`` CLI, run as real subprocesses (docs/cli.md).

Every test writes a scenario file (docs/scenarios.md), drives it with ``agentfold run``
and the host commands (``recover``, ``unknown``, ``resolve``, ``pending``, ``answer``,
``steer``, ``results``, ``delegates``, ``cancel``) in child processes on a real SQLite
file (and, for part of the crash matrix, a real PostgreSQL database), and asserts only
what an operator observes: exit statuses, the documented ``--json`` output, the text
output, the scenario's side-effect log (written by the tools, outside the CLI), and the
retained request of a model call, which shows exactly the messages the model was given.

Model calls whose request a test inspects are scripted as ``{"error": ...}``: the call
raises, its outcome is unknown, and ``unknown --json`` shows its full request until the
test resolves it with ``resolve --model-response``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import make_store_url
from tests.test_cli import ROOT, Ran, agentfold, ok, refused, sqlite_url, store_version

# ---------------------------------------------------------------------------
# Scenario pieces

USER_TEXT = "Look up a and b."
CALL_A = {"id": "call_a", "name": "alpha", "arguments": '{"q": "a"}'}
CALL_B = {"id": "call_b", "name": "beta", "arguments": '{"q": "b"}'}
ROUND = {"finish_reason": "tool_calls", "message": {"content": "Looking both up.", "tool_calls": [CALL_A, CALL_B]}}
FINAL = {"finish_reason": "stop", "message": {"content": "a is A and b is B."}}
LEFT_TO_HOST = {"error": "this model call is left to the host"}
ALPHA_OUTPUT = "alpha says A"  # a string output becomes text content
BETA_OUTPUT = {"beta": "B"}  # anything else becomes details


def text(value: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": value}]


def user_message(value: str) -> dict[str, Any]:
    return {"role": "user", "content": text(value)}


def assistant_round() -> dict[str, Any]:
    """The round's assistant message as the working context holds it (canonical JSON)."""
    return {"role": "assistant", "content": text("Looking both up."), "tool_calls": [CALL_A, CALL_B]}


def tool_message(*results: dict[str, Any]) -> dict[str, Any]:
    return {"role": "tool", "tool_results": list(results)}


def alpha_result(value: str = ALPHA_OUTPUT) -> dict[str, Any]:
    return {"id": "call_a", "name": "alpha", "output": {"content": text(value)}}


def beta_result(details: Any = None) -> dict[str, Any]:
    return {"id": "call_b", "name": "beta", "output": {"details": BETA_OUTPUT if details is None else details}}


def one_tool_call(log: Path) -> dict[str, Any]:
    """A model call that asks for one tool call (``pay``), then a final answer. Every real
    execution of the tool appends a line to ``log`` (a FIFO nobody reads blocks it in open())."""
    return {
        "name": "one-call",
        "model": {"responses": [
            {"finish_reason": "tool_calls",
             "message": {"content": "", "tool_calls": [{"id": "c1", "name": "pay", "arguments": "{}"}]}},
            {"finish_reason": "stop", "message": {"content": "paid"}},
        ]},
        "tools": [{"name": "pay", "parameters": {"type": "object"}, "result": {"output": "ok"}}],
        "side_effect_log": str(log),
    }


def two_call_round(log: Path | None, *, alpha: Any = None, beta: Any = None, concurrent: bool = False,
                   final: dict[str, Any] = LEFT_TO_HOST) -> dict[str, Any]:
    """A model call that asks for alpha and beta (one round), then ``final``."""
    tools = [
        {"name": "alpha", "parameters": {"type": "object"}, "result": alpha or {"output": ALPHA_OUTPUT}},
        {"name": "beta", "parameters": {"type": "object"}, "result": beta or {"output": BETA_OUTPUT}},
    ]
    doc: dict[str, Any] = {
        "name": "two-call-round",
        "input": {"messages": [{"role": "user", "content": USER_TEXT}]},
        "model": {"responses": [ROUND, final]},
        "tools": tools,
    }
    if concurrent:
        tools[0]["concurrency"] = {"key": "alpha-api", "concurrent": True}
        tools[1]["concurrency"] = {"key": "beta-api", "concurrent": True}
        doc["limits"] = {"max_concurrent_tool_calls": 2}
    if log is not None:
        doc["side_effect_log"] = str(log)
    return doc


APPROVAL_SCHEMA = {
    "type": "object",
    "required": ["approved"],
    "properties": {"approved": {"type": "boolean"}, "note": {"type": "string"}},
    "additionalProperties": False,
}
APPROVAL_PROMPT = {"question": "Approve spending 420 EUR?"}


def approval(log: Path | None, final: dict[str, Any] = FINAL) -> dict[str, Any]:
    """One tool call that asks a human (an input wait), then returns the answer."""
    doc: dict[str, Any] = {
        "name": "approval",
        "input": {"messages": [{"role": "user", "content": "Book the hotel if it is approved."}]},
        "model": {"responses": [
            {"finish_reason": "tool_calls", "message": {"tool_calls": [
                {"id": "call_ok", "name": "approve", "arguments": '{"amount_eur": 420}'}]}},
            final,
        ]},
        "tools": [{
            "name": "approve",
            "parameters": {"type": "object", "required": ["amount_eur"]},
            "result": {"input": {"prompt": APPROVAL_PROMPT, "response_schema": APPROVAL_SCHEMA}, "then": {"answer": True}},
        }],
    }
    if log is not None:
        doc["side_effect_log"] = str(log)
    return doc


def write(tmp_path: Path, doc: dict[str, Any], name: str = "scenario.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc, indent=2))
    return path


def logged_calls(log: Path) -> list[str]:
    """The call ids of every real tool execution, in the order they happened."""
    if not log.exists():
        return []
    return [json.loads(line)["call_id"] for line in log.read_text().splitlines()]


def unknowns(store: str, tree_id: str | None = None) -> list[dict[str, Any]]:
    entries = ok(agentfold("unknown", "--json", store=store)).json()["unknown_effects"]
    return [e for e in entries if tree_id is None or e["tree_id"] == tree_id]


def model_call(entry: dict[str, Any]) -> dict[str, Any]:
    assert entry["kind"] == "model", entry
    assert entry["tool_call_ref"] is None
    return entry["request"]["model_call"]  # type: ignore[no-any-return]


def run_json(store: str, scenario: Path, *args: str) -> dict[str, Any]:
    ran = ok(agentfold("run", str(scenario), *args, "--json", store=store))
    data = ran.json()
    assert set(data) == {"tree_id", "root_process_id", "status"}
    return data  # type: ignore[no-any-return]


def root_output(store: str, tree: str) -> dict[str, Any]:
    root = ok(agentfold("show", tree, "--json", store=store)).json()["processes"][0]
    assert root["status"] == "completed", root
    return root["output"]  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------
# Acceptance 3: a crash at every point of a two-call tool round


# Dispatcher effects in commit order: 1 = model call 1, 2 = alpha, 3 = beta, 4 = model call 2.
# What a crash at each point leaves behind after `recover`: the call whose dispatch was
# recorded but whose outcome was not (it becomes unknown, engine.dispatch.interrupted),
# and whether that call's side effect happened before the process died.
# - declared:N ends before the dispatch permission is stored: the next owner dispatches N.
# - dispatched:N ends right after the permission is stored, before the call.
# - in-dispatch:N ends inside the call, after its side effect.
# - settled:N ends after the append that records N's outcome; that same append commits
#   the next Step and the dispatch permission of effect N+1, which is therefore
#   interrupted before its call (settled:4 is the last effect: nothing is interrupted).
INTERRUPTED: dict[str, tuple[str, bool] | None] = {
    "declared:1": None, "declared:2": None, "declared:3": None, "declared:4": None,
    "dispatched:1": ("model1", False), "dispatched:2": ("alpha", False),
    "dispatched:3": ("beta", False), "dispatched:4": ("model2", False),
    "in-dispatch:1": ("model1", True), "in-dispatch:2": ("alpha", True),
    "in-dispatch:3": ("beta", True), "in-dispatch:4": ("model2", True),
    "settled:1": ("alpha", False), "settled:2": ("beta", False), "settled:3": ("model2", False), "settled:4": None,
}
# PostgreSQL runs the two points that leave a tool call unknown with and without its side
# effect (the whole matrix there would double the file's running time).
PG_POINTS = ("dispatched:2", "in-dispatch:3")
HOST_ALPHA = "alpha (confirmed by the host)"
HOST_BETA = {"beta": "B", "confirmed_by": "host"}


@pytest.mark.parametrize(
    ("backend", "point"),
    [pytest.param("sqlite", p, id=f"sqlite-{p}") for p in INTERRUPTED]
    + [pytest.param("postgresql", p, id=f"postgresql-{p}") for p in PG_POINTS],
)
def test_a_crash_at_any_point_of_a_two_call_round_runs_no_tool_twice_and_leaves_only_resolvable_unknowns(
    backend: str, point: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    store = make_store_url(backend, tmp_path, request)
    log = tmp_path / "side-effects.jsonl"
    scenario = write(tmp_path, two_call_round(log))
    crashed = agentfold("run", str(scenario), "--start-id", "round-1", "--crash-after", point, "--json", store=store)
    assert crashed.code == 75, f"expected the crash exit status 75, got {crashed.code}: {crashed.stderr}"
    assert crashed.stdout == ""
    interrupted = INTERRUPTED[point]

    [tree] = ok(agentfold("recover", "--json", store=store)).json()["trees"]
    # settled:4 comes after the last settlement, which left the tree parked on the unknown
    # final model call with nothing in flight: recover leaves such a tree as it is.
    outcome = "parked" if point == "settled:4" else "recovered"
    assert (tree["outcome"], tree["start_id"], tree["classification"]) == (outcome, "round-1", "parked")
    assert len(tree["unknown_effect_ids"]) == 1
    root = tree["root_process_id"]
    [entry] = unknowns(store)
    assert entry["effect_id"] == tree["unknown_effect_ids"][0]
    host_resolved: set[str] = set()

    if interrupted is not None and interrupted[0] == "model1":
        call = model_call(entry)
        assert call["model_call_sequence"] == 1
        assert call["request"]["messages"] == [user_message(USER_TEXT)]
        assert entry["diagnostic"]["code"] == "engine.dispatch.interrupted"
        assert logged_calls(log) == []
        # The host learns what the model answered and records it; the round then runs.
        resolved = ok(agentfold("resolve", entry["effect_id"], "--model-response", json.dumps(ROUND), "--json",
                                store=store)).json()
        assert resolved["resolution"]["status"] == "succeeded"
        assert resolved["tree"]["classification"] == "parked"
        [entry] = unknowns(store)
    elif interrupted is not None and interrupted[0] in ("alpha", "beta"):
        name, ran = interrupted
        index, call_spec = (0, CALL_A) if name == "alpha" else (1, CALL_B)
        assert entry["kind"] == "tool"
        assert entry["tool_call_ref"] == f"{root}/1/{index}"
        assert entry["process_id"] != root  # the Tool child that made the call
        assert entry["request"]["tool_call"]["invocation"]["call"] == call_spec
        assert entry["diagnostic"]["code"] == "engine.dispatch.interrupted"
        assert logged_calls(log).count(call_spec["id"]) == (1 if ran else 0)
        if name == "alpha":
            assert "call_b" not in logged_calls(log)  # one call at a time: beta waits for alpha's outcome
        host_output = json.dumps(HOST_ALPHA if name == "alpha" else {"details": HOST_BETA})
        resolved = ok(agentfold("resolve", entry["effect_id"], "--output", host_output, "--json", store=store)).json()
        assert resolved["effect_id"] == entry["effect_id"]
        assert resolved["process_id"] == entry["process_id"]
        assert resolved["driven"] is True
        assert resolved["tree"]["classification"] == "parked"
        host_resolved.add(name)
        [entry] = unknowns(store)

    # The final model call is scripted to fail, so its retained request shows exactly what
    # the model was given: both results, in call order, after the assistant's tool calls.
    call = model_call(entry)
    assert call["model_call_sequence"] == 2
    assert call.get("applied_steer_signal_ids", []) == []  # omitted when empty
    # Interrupted by the crash, or (every other point) the scripted failure of the call.
    model2_interrupted = interrupted is not None and interrupted[0] == "model2"
    assert entry["diagnostic"]["code"] == (
        "engine.dispatch.interrupted" if model2_interrupted else "engine.dispatch.failed"
    )
    assert call["request"]["messages"] == [
        user_message(USER_TEXT),
        assistant_round(),
        tool_message(
            alpha_result(HOST_ALPHA if "alpha" in host_resolved else ALPHA_OUTPUT),
            beta_result(HOST_BETA if "beta" in host_resolved else None),
        ),
    ]
    done = ok(agentfold("resolve", entry["effect_id"], "--model-response", json.dumps(FINAL), "--json",
                        store=store)).json()
    assert (done["tree"]["status"], done["tree"]["classification"]) == ("completed", "terminal")
    assert done["tree"]["unknown_effect_ids"] == []

    # The outside world: no tool call ran twice; a call the host resolved without it
    # having run never ran at all.
    ran_calls = Counter(logged_calls(log))
    assert all(n == 1 for n in ran_calls.values()), ran_calls
    expected = {"call_a", "call_b"}
    if interrupted is not None and interrupted[0] in ("alpha", "beta") and not interrupted[1]:
        expected.discard("call_a" if interrupted[0] == "alpha" else "call_b")
    assert set(ran_calls) == expected


# ---------------------------------------------------------------------------
# results: SettledResults of a parked round; the model sees results in call order


def settled_results_digest(round_json: dict[str, Any]) -> str:
    """Recompute a round's digest: SHA-256 over its JSON in the seed's member order
    (process_id, root_id, parent_id?, child_key?, model_call_sequence, call_count, entries)."""
    body: dict[str, Any] = {"process_id": round_json["process_id"], "root_id": round_json["root_id"]}
    for optional in ("parent_id", "child_key"):
        if optional in round_json:
            body[optional] = round_json[optional]
    body["model_call_sequence"] = round_json["model_call_sequence"]
    body["call_count"] = round_json["call_count"]
    entries = []
    for e in round_json["entries"]:
        call = {"id": e["call"]["id"], "name": e["call"]["name"]}
        if "arguments" in e["call"]:
            call["arguments"] = e["call"]["arguments"]
        output: dict[str, Any] = {}
        if "content" in e["result"]["output"]:
            output["content"] = [{"type": p["type"], "text": p["text"]} for p in e["result"]["output"]["content"]]
        if "details" in e["result"]["output"]:
            output["details"] = e["result"]["output"]["details"]  # canonical JSON: keys already sorted
        result: dict[str, Any] = {"id": e["result"]["id"], "name": e["result"]["name"], "output": output}
        if "is_error" in e["result"]:
            result["is_error"] = e["result"]["is_error"]
        entries.append({"tool_call_index": e["tool_call_index"], "call": call, "result": result,
                        "disposition": e["disposition"]})
    body["entries"] = entries
    data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_results_shows_a_parked_rounds_settled_calls_sparsely_and_the_model_sees_them_in_call_order(
    tmp_path: Path,
) -> None:
    store = sqlite_url(tmp_path)
    # alpha's outcome is unknown (its service raises); beta, running beside it, succeeds first.
    scenario = write(tmp_path, two_call_round(None, alpha={"error": "alpha's service timed out"}, concurrent=True))
    started = run_json(store, scenario, "--start-id", "parallel-1")
    assert started["status"] == "waiting"
    root = started["root_process_id"]
    [alpha] = unknowns(store)
    assert (alpha["kind"], alpha["tool_call_ref"]) == ("tool", f"{root}/1/0")
    assert alpha["diagnostic"] == {"kind": "external", "code": "engine.dispatch.failed",
                                   "message": "RuntimeError: alpha's service timed out"}
    listed = ok(agentfold("unknown", store=store)).stdout
    assert f"{alpha['effect_id']}  (tool, tool call {root}/1/0)" in listed
    assert "resolve each with: agentfold resolve EFFECT_ID --output JSON [--disposition D]" in listed

    results = ok(agentfold("results", "parallel-1", "--json", store=store)).json()
    assert results["tree_id"] == started["tree_id"]
    [r] = results["rounds"]
    assert (r["process_id"], r["root_id"], r["model_call_sequence"], r["call_count"]) == (root, root, 1, 2)
    assert "parent_id" not in r and "child_key" not in r  # a root Interaction
    assert r["complete"] is False
    assert r["references"] == [f"{root}/1/0", f"{root}/1/1"]  # every call of the round, with or without an entry
    # Sparse: only the definite result; the unknown call has no entry.
    assert r["entries"] == [{
        "tool_call_index": 1,
        "call": CALL_B,
        "result": beta_result(),
        "disposition": "succeeded",
    }]
    assert r["digest"] == settled_results_digest(r)
    # The same projection whichever way the tree is named.
    assert ok(agentfold("results", started["tree_id"], "--json", store=store)).json() == results
    assert ok(agentfold("results", root, "--json", store=store)).json() == results
    shown = ok(agentfold("results", "parallel-1", store=store)).stdout
    assert f"process {root} model call 1: 1 of 2 result(s)  {r['digest']}" in shown
    assert '#1 beta succeeded: {"details": {"beta": "B"}}' in shown

    resolved = ok(agentfold("resolve", alpha["effect_id"], "--output", json.dumps(HOST_ALPHA), store=store)).stdout
    assert resolved.startswith(f"resolved {alpha['effect_id']} as a tool result, succeeded\n")
    # The round is closed: it is no longer an open round with results to recover.
    assert ok(agentfold("results", "parallel-1", "--json", store=store)).json() == {
        "tree_id": started["tree_id"], "rounds": []}
    assert ok(agentfold("results", "parallel-1", store=store)).stdout.strip() == "no open round has settled results"
    [final] = unknowns(store)
    # beta settled before alpha, yet the model receives the results in call order.
    assert model_call(final)["request"]["messages"][-1] == tool_message(alpha_result(HOST_ALPHA), beta_result())
    ok(agentfold("resolve", final["effect_id"], "--model-response", json.dumps(FINAL), store=store))
    assert root_output(store, "parallel-1")["model_calls"] == 2


# ---------------------------------------------------------------------------
# Acceptance 4: an input wait


def test_an_input_wait_is_pending_refuses_invalid_answers_and_completes_on_one_valid_answer(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    log = tmp_path / "side-effects.jsonl"
    started = run_json(store, write(tmp_path, approval(log)), "--start-id", "approval-1")
    assert started["status"] == "waiting"
    root, tree_id = started["root_process_id"], started["tree_id"]

    [wait] = ok(agentfold("pending", "--json", store=store)).json()["pending"]
    assert set(wait) == {"tree_id", "process_id", "wait_id", "prompt", "response_schema", "tool_call_ref"}
    assert wait["tree_id"] == tree_id
    assert wait["tool_call_ref"] == f"{root}/1/0"
    assert wait["process_id"] != root  # the answer goes to the Tool child, not the Interaction
    assert wait["prompt"] == APPROVAL_PROMPT
    assert wait["response_schema"] == APPROVAL_SCHEMA
    listed = ok(agentfold("pending", store=store)).stdout
    assert f"process {wait['process_id']}  wait {wait['wait_id']}" in listed
    assert f"tool call {root}/1/0 in tree {tree_id}" in listed
    assert "answer with: agentfold answer PROCESS_ID WAIT_ID JSON" in listed
    pid, wid = wait["process_id"], wait["wait_id"]
    before = store_version(store, tree_id)

    invalid = refused(agentfold("answer", pid, wid, '{"approved": "yes"}', "--json", store=store)).error()
    assert invalid["code"] == "engine.signal.schema"
    assert "$.approved: expected boolean" in invalid["message"]
    extra = refused(agentfold("answer", pid, wid, '{"approved": true, "tip": 5}', store=store))
    assert extra.stderr.startswith("agentfold: error: engine.signal.schema:")
    # A bad --timeout is refused before the answer is admitted (found after, it left the model
    # call that follows the answer unknown)
    for timeout in ("-5", "nan", "inf", "1e12", "soon"):
        bad = refused(agentfold("answer", pid, wid, '{"approved": true}', "--timeout", timeout, "--json", store=store))
        assert bad.error()["code"] == "cli.usage" and "--timeout" in bad.error()["message"]
    assert store_version(store, tree_id) == before
    assert ok(agentfold("pending", "--json", store=store)).json()["pending"] == [wait]  # still open, unchanged

    answered = ok(agentfold("answer", pid, wid, '{"approved": true, "note": "ok"}', "--signal-id", "approve-1",
                            "--json", store=store)).json()
    assert answered["accepted"] is True
    assert (answered["signal_id"], answered["process_id"], answered["wait_id"]) == ("approve-1", pid, wid)
    assert (answered["tree"]["status"], answered["tree"]["classification"]) == ("completed", "terminal")
    output = root_output(store, "approval-1")
    assert output["model_calls"] == 2
    # The tool ran once to ask and once, resumed, to finish with the answer.
    assert logged_calls(log) == ["call_ok", "call_ok"]
    # The log tells the two apart: the resume says so and runs under a new Effect (a replay
    # of one Effect would repeat its id).
    ask, resume = (json.loads(line) for line in log.read_text().splitlines())
    assert (ask["resumed"], resume["resumed"]) == (False, True)
    assert ask["effect_id"] != resume["effect_id"]
    assert all(re.fullmatch(r"effect:[0-9a-f]{64}", e["effect_id"]) for e in (ask, resume))
    after = store_version(store, tree_id)

    # A second answer to the same wait under a new signal id is refused ...
    second = refused(agentfold("answer", pid, wid, '{"approved": false}', "--signal-id", "approve-2", "--json",
                               store=store)).error()
    assert second["code"] == "engine.signal.rejected"
    # ... the same answer resent under the same signal id is a harmless no-op ...
    again = ok(agentfold("answer", pid, wid, '{"approved": true, "note": "ok"}', "--signal-id", "approve-1",
                         "--json", store=store)).json()
    assert again["accepted"] is False and again["tree"]["status"] == "completed"
    text_again = ok(agentfold("answer", pid, wid, '{"approved": true, "note": "ok"}', "--signal-id", "approve-1",
                              store=store)).stdout
    assert text_again.startswith(f"already answered with this signal id (nothing changed) {wid}")
    # ... and the same signal id with a different answer is a conflict.
    conflict = refused(agentfold("answer", pid, wid, '{"approved": false}', "--signal-id", "approve-1", "--json",
                                 store=store)).error()
    assert conflict["code"] == "engine.signal.conflict"
    assert store_version(store, tree_id) == after
    assert logged_calls(log) == ["call_ok", "call_ok"]
    assert ok(agentfold("pending", "--json", store=store)).json() == {"pending": []}
    assert ok(agentfold("pending", store=store)).stdout.strip() == "no tool waits for input"


# ---------------------------------------------------------------------------
# Acceptance 5: steering


def test_steering_sent_during_a_tool_round_follows_the_tool_message_in_the_next_model_request(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    started = run_json(store, write(tmp_path, approval(None, final=LEFT_TO_HOST)), "--start-id", "steer-round")
    root, tree_id = started["root_process_id"], started["tree_id"]
    [wait] = ok(agentfold("pending", "--json", store=store)).json()["pending"]

    steered = ok(agentfold("steer", root, "Also book a window seat.", "--signal-id", "steer-1", "--json",
                           store=store)).json()
    assert steered["accepted"] is True
    assert (steered["signal_id"], steered["process_id"]) == ("steer-1", root)
    assert steered["tree"]["classification"] == "parked"
    # Steering never answers an input wait: the tool still waits for its human.
    assert ok(agentfold("pending", "--json", store=store)).json()["pending"] == [wait]
    assert unknowns(store) == []  # and it did not preempt anything: no model call was made
    resent = ok(agentfold("steer", root, "Also book a window seat.", "--signal-id", "steer-1", store=store)).stdout
    assert resent.startswith("this steering was already admitted (steer-1)")
    before = store_version(store, tree_id)
    conflict = refused(agentfold("steer", root, "Something else.", "--signal-id", "steer-1", "--json",
                                 store=store)).error()
    assert conflict["code"] == "engine.signal.conflict"
    # The Tool child waits for its answer: unaddressed input to it is refused.
    to_tool = refused(agentfold("steer", wait["process_id"], "Hurry up.", "--json", store=store)).error()
    assert to_tool["code"] == "engine.signal.rejected"
    assert store_version(store, tree_id) == before  # a refusal appends nothing, not even an ownership change

    ok(agentfold("answer", wait["process_id"], wait["wait_id"], '{"approved": true}', store=store))
    [entry] = unknowns(store)
    call = model_call(entry)
    assert call["model_call_sequence"] == 2
    assert call["applied_steer_signal_ids"] == ["steer-1"]
    messages = call["request"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user"]
    assert messages[1]["tool_calls"] == [{"id": "call_ok", "name": "approve", "arguments": '{"amount_eur": 420}'}]
    assert messages[2] == tool_message({"id": "call_ok", "name": "approve", "output": {"details": {"approved": True}}})
    assert messages[3] == user_message("Also book a window seat.")  # once, although it was sent twice

    done = ok(agentfold("resolve", entry["effect_id"], "--model-response", json.dumps(FINAL), "--json",
                        store=store)).json()
    assert done["tree"]["status"] == "completed"
    assert root_output(store, "steer-round")["model_calls"] == 2


def test_steering_sent_before_a_final_answer_causes_one_more_model_call(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    doc = {
        "name": "no-tools",
        "input": {"messages": [{"role": "user", "content": "Say hello."}]},
        "model": {"responses": [LEFT_TO_HOST, LEFT_TO_HOST]},
    }
    scenario = write(tmp_path, doc)
    plain = run_json(store, scenario, "--start-id", "plain")
    steered = run_json(store, scenario, "--start-id", "steered")
    assert plain["status"] == steered["status"] == "running"  # both parked on an unknown first model call
    [plain_call] = unknowns(store, plain["tree_id"])
    [steered_call] = unknowns(store, steered["tree_id"])
    assert model_call(steered_call)["model_call_sequence"] == 1

    ok(agentfold("steer", steered["root_process_id"], "Answer in French.", "--signal-id", "french", store=store))
    # Queued, not applied: the model call in progress is not preempted.
    assert [e["effect_id"] for e in unknowns(store, steered["tree_id"])] == [steered_call["effect_id"]]

    hello = {"finish_reason": "stop", "message": {"content": "Hello."}}
    bonjour = {"finish_reason": "stop", "message": {"content": "Bonjour."}}
    ok(agentfold("resolve", plain_call["effect_id"], "--model-response", json.dumps(hello), store=store))
    assert root_output(store, "plain")["model_calls"] == 1

    # The same final answer, with steering pending: the model is called once more.
    after = ok(agentfold("resolve", steered_call["effect_id"], "--model-response", json.dumps(hello), "--json",
                         store=store)).json()
    assert after["tree"]["status"] == "running"
    [second] = unknowns(store, steered["tree_id"])
    call = model_call(second)
    assert call["model_call_sequence"] == 2
    assert call["applied_steer_signal_ids"] == ["french"]
    assert call["request"]["messages"] == [
        user_message("Say hello."),
        {"role": "assistant", "content": text("Hello.")},
        user_message("Answer in French."),
    ]
    ok(agentfold("resolve", second["effect_id"], "--model-response", json.dumps(bonjour), store=store))
    output = root_output(store, "steered")
    assert output["model_calls"] == 1 + root_output(store, "plain")["model_calls"]
    assert output["model_response"]["message"]["content"] == text("Bonjour.")


# ---------------------------------------------------------------------------
# delegates and cancel


def test_delegates_reports_the_child_process_each_delegated_call_started(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    doc = {
        "name": "with-a-delegate",
        "input": {"messages": [{"role": "user", "content": "Write a poem about the sea."}]},
        "model": {"responses": [
            {"finish_reason": "tool_calls", "message": {"tool_calls": [
                {"id": "call_w", "name": "writer", "arguments": '{"topic": "sea"}'}]}},
            {"finish_reason": "stop", "message": {"content": "Here is your poem."}},
        ]},
        "delegates": [{
            "name": "writer", "description": "Writes a poem.",
            "input_schema": {"type": "object", "required": ["topic"], "properties": {"topic": {"type": "string"}}},
            "scenario": {"name": "writer", "model": {"responses": [
                {"finish_reason": "stop", "message": {"content": "Waves on waves."}}]}},
        }],
    }
    started = run_json(store, write(tmp_path, doc), "--start-id", "poem")
    assert started["status"] == "completed"
    root = started["root_process_id"]

    listed = ok(agentfold("delegates", root, "--json", store=store)).json()
    assert (listed["process_id"], listed["found"]) == (root, True)
    [d] = listed["delegates"]
    key_hash = hashlib.sha256(b"1\x00call_w\x00writer").hexdigest()
    assert d == {
        "tree_id": started["tree_id"],
        "tool_call_ref": f"{root}/1/0",
        "process_id": root,
        "model_call_sequence": 1,
        "tool_call_index": 0,
        "tool_call": {"id": "call_w", "name": "writer", "arguments": '{"topic": "sea"}'},
        "child_key": f"interaction.delegate.child.{key_hash}",
        "child_process_id": d["child_process_id"],
    }
    processes = {p["process_id"]: p for p in ok(agentfold("show", "poem", "--json", store=store)).json()["processes"]}
    child = processes[d["child_process_id"]]
    assert (child["parent_id"], child["child_key"], child["status"]) == (root, d["child_key"], "completed")
    assert child["output"]["model_response"]["message"]["content"] == text("Waves on waves.")
    shown = ok(agentfold("delegates", root, store=store)).stdout
    assert shown.strip() == f'{root}/1/0  writer({{"topic": "sea"}}) -> {d["child_process_id"]} [completed]'
    # The Delegate is an Interaction that delegated nothing itself.
    assert ok(agentfold("delegates", d["child_process_id"], "--json", store=store)).json()["delegates"] == []
    assert ok(agentfold("delegates", d["child_process_id"], store=store)).stdout.strip() == "no delegated calls"


def test_cancel_ends_a_parked_run_and_a_finished_process_cannot_be_canceled(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    log = tmp_path / "side-effects.jsonl"
    scenario = write(tmp_path, approval(log))
    first = run_json(store, scenario, "--start-id", "cancel-root")
    second = ok(agentfold("run", str(scenario), "--start-id", "cancel-tool", store=store)).stdout
    assert second.startswith("run approval: tree:")
    assert "root waiting, tree parked" in second
    assert "1 tool input(s) wait for an answer: `agentfold pending`" in second
    assert len(ok(agentfold("pending", "--json", store=store)).json()["pending"]) == 2

    canceled = ok(agentfold("cancel", first["root_process_id"], "--reason", "the traveller gave up", "--json",
                            store=store)).json()
    assert canceled["recorded"] is True
    assert canceled["process_id"] == first["root_process_id"]
    assert (canceled["tree"]["status"], canceled["tree"]["classification"]) == ("canceled", "terminal")
    root = ok(agentfold("show", "cancel-root", "--json", store=store)).json()["processes"][0]
    assert root["termination"]["reason"] == "the traveller gave up"
    before = store_version(store, first["tree_id"])
    again = refused(agentfold("cancel", first["root_process_id"], "--json", store=store)).error()
    assert again["code"] == "engine.process.finished"
    assert store_version(store, first["tree_id"]) == before

    # Canceling the Tool child that waits for input: the ToolSet is required infrastructure,
    # so the Interaction fails rather than going on without the call's result.
    [wait] = ok(agentfold("pending", "--json", store=store)).json()["pending"]  # the other run's
    assert wait["tree_id"] != first["tree_id"]
    shown = ok(agentfold("cancel", wait["process_id"], store=store)).stdout
    assert shown.startswith("cancellation recorded\n")
    assert "root failed, tree terminal" in shown
    parent = ok(agentfold("show", "cancel-tool", "--json", store=store)).json()["processes"][0]
    assert parent["termination"]["failure"]["code"] == "interaction.tool.process_failed"
    assert ok(agentfold("pending", "--json", store=store)).json() == {"pending": []}
    assert logged_calls(log) == ["call_ok", "call_ok"]  # each run's tool asked once; nothing ran after the cancel


def test_canceling_a_run_with_an_unknown_call_says_the_unknown_can_no_longer_be_resolved(tmp_path: Path) -> None:
    # Found by a regression audit: the cancel's summary listed "unknown effects: ..." as a live
    # run's, inviting a `resolve` that is refused (engine.process.finished).
    store = sqlite_url(tmp_path)
    parked = run_json(store, write(tmp_path, two_call_round(None, alpha={"error": "down"})), "--start-id", "u")
    [unknown] = ok(agentfold("unknown", "--json", store=store)).json()["unknown_effects"]
    effect_id = unknown["effect_id"]
    canceled = ok(agentfold("cancel", parked["root_process_id"], store=store)).stdout
    assert "root canceled, tree terminal" in canceled
    assert f"; unresolved unknown effects (evidence, no longer resolvable): {effect_id}" in canceled
    assert "; unknown effects:" not in canceled
    assert refused(agentfold("resolve", effect_id, "--output", "{}", "--json", store=store)).error()["code"] == (
        "engine.process.finished"
    )


# ---------------------------------------------------------------------------
# Refused input: exit 2, one line on stderr, nothing appended


def test_bad_input_to_the_interaction_commands_exits_2_and_appends_nothing(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    waiting = run_json(store, write(tmp_path, approval(None), "approval.json"), "--start-id", "bad-wait")
    parked = run_json(store, write(tmp_path, two_call_round(None, alpha={"error": "down"}, concurrent=True),
                                   "round.json"), "--start-id", "bad-round")
    no_model = run_json(store, write(tmp_path, {"name": "m", "model": {"responses": [LEFT_TO_HOST]}}, "model.json"),
                        "--start-id", "bad-model")
    with ThreadPoolExecutor(max_workers=2) as pool:  # two reads side by side, each its own process
        listed, pending = pool.map(lambda command: ok(agentfold(command, "--json", store=store)).json(),
                                   ["unknown", "pending"])
    [tool_entry] = [e for e in listed["unknown_effects"] if e["tree_id"] == parked["tree_id"]]
    [model_entry] = [e for e in listed["unknown_effects"] if e["tree_id"] == no_model["tree_id"]]
    [wait] = pending["pending"]
    root = waiting["root_process_id"]
    trees = [waiting["tree_id"], parked["tree_id"], no_model["tree_id"]]
    before = [store_version(store, t) for t in trees]
    bad_scenario = write(tmp_path, {"name": "x", "model": {"responses": []}, "tools": [{"name": "t", "result": {
        "failure": {"kind": "exploded", "output": "no"}}}]}, "bad.json")
    tool, model = tool_entry["effect_id"], model_entry["effect_id"]

    cases: list[tuple[list[str], str]] = [
        (["answer", "process:nope", wait["wait_id"], "{}"], "engine.process.not_found"),
        (["answer", "has space", wait["wait_id"], "{}"], "identity.invalid"),
        (["answer", wait["process_id"], "wait id", "{}"], "identity.invalid"),
        (["answer", wait["process_id"], wait["wait_id"], '{"approved": '], "payload.invalid"),
        (["answer", wait["process_id"], wait["wait_id"], '{"approved": false, "approved": true}'], "payload.invalid"),
        (["resolve", tool, "--output", '{"content": "x", "content": "y"}'], "payload.invalid"),
        (["answer", root, wait["wait_id"], '{"approved": true}'], "engine.signal.rejected"),
        (["steer", "process:nope", "hi"], "engine.process.not_found"),
        (["steer", "has space", "hi"], "identity.invalid"),
        (["steer", root, "hi", "--signal-id", "has space"], "identity.invalid"),
        (["results", "no-such-start"], "engine.tree.not_found"),
        (["results", "tree:not-hex"], "identity.invalid"),
        (["delegates", "process:nope"], "engine.process.not_found"),
        (["delegates", "bad-wait"], "engine.process.not_found"),  # a start id where a process id goes
        (["pause", waiting["tree_id"]], "engine.process.not_found"),  # a tree id where a process id goes
        (["delegates", "has space"], "identity.invalid"),
        (["cancel", "process:nope"], "engine.process.not_found"),
        (["cancel", "has space"], "identity.invalid"),
        (["cancel", root, "--reason", ""], "control.invalid"),
        (["cancel", root, "--reason", "   "], "control.invalid"),
        (["resolve", tool, "--model-response", json.dumps(FINAL)], "cli.argument_invalid"),
        (["resolve", tool, "--output", "{}", "--status", "failed"], "cli.usage"),
        (["resolve", tool, "--output", '{"content": "x", "extra": 1}'], "interaction.settlement.invalid"),
        (["resolve", model, "--output", "{}"], "cli.argument_invalid"),
        (["resolve", model, "--model-response", '{"finish_reason": '], "payload.invalid"),
        (["resolve", model, "--model-response", '{"finish_reason": "Stop!", "message": {"content": "x"}}'],
         "interaction.settlement.invalid"),
        (["resolve", model, "--model-response", json.dumps(FINAL), "--output", "{}"], "cli.usage"),
        (["resolve", model, "--model-response", json.dumps({**FINAL, "finish_reason": "bogus"})],
         "interaction.settlement.invalid"),
        (["resolve", "foo", "--output", '"x"'], "identity.invalid"),
        (["resolve", "effect:XYZ", "--output", '"x"'], "identity.invalid"),
        (["resolve", "effect:" + "0" * 64, "--output", '"x"'], "engine.effect.not_pending"),
        (["run", str(bad_scenario)], "scenario.invalid"),
        (["run", str(tmp_path / "missing.json")], "scenario.unreadable"),
        (["run", str(tmp_path / "model.json"), "--crash-after", "inside:1"], "crash.point_invalid"),
    ]

    def attempt(case: tuple[list[str], str]) -> tuple[list[str], str, Ran]:
        return case[0], case[1], agentfold(*case[0], "--json", store=store)

    # Independent refusals: run them side by side (each is still its own process).
    with ThreadPoolExecutor(max_workers=4) as pool:
        in_text = pool.submit(agentfold, "answer", wait["process_id"], wait["wait_id"], "[]", store=store)
        outcomes = list(pool.map(attempt, cases))
        text_mode = refused(in_text.result())
    for argv, code, ran in outcomes:
        assert refused(ran).error()["code"] == code, (argv, ran.stderr)
    twice = next(ran for argv, _, ran in outcomes if argv[-1] == '{"approved": false, "approved": true}').error()
    assert "$ has the key 'approved' twice" in twice["message"], twice
    for argv in (["delegates", "bad-wait"], ["pause", waiting["tree_id"]]):
        named = next(ran for a, _, ran in outcomes if a == argv).error()
        assert f"names the run {waiting['tree_id']} (started as 'bad-wait'), not a process" in named["message"], named
        assert f"the run's root process is {root}" in named["hint"], named
    scenario_error = next(ran for argv, _, ran in outcomes if argv == ["run", str(bad_scenario)]).error()
    assert scenario_error["message"].startswith("$.tools[0].result.failure.kind: must be failed or rejected")
    assert text_mode.stderr.startswith("agentfold: error: engine.signal.schema:")

    assert [store_version(store, t) for t in trees] == before
    assert [t["start_id"] for t in ok(agentfold("trees", "--json", store=store)).json()["trees"]] == [
        "bad-wait", "bad-round", "bad-model"]


def test_the_interaction_commands_refuse_an_sqlite_store_that_does_not_exist(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    commands = [["pending"], ["results", "x"], ["delegates", "p"], ["cancel", "p"], ["steer", "p", "hi"],
                ["answer", "p", "wait:" + "0" * 64, "{}"]]

    def attempt(argv: list[str]) -> Ran:
        return agentfold(*argv, "--json", store=store)

    with ThreadPoolExecutor(max_workers=3) as pool:
        for ran in pool.map(attempt, commands):
            assert refused(ran).error()["code"] == "store.not_found"
    assert not (tmp_path / "agentfold.db").exists()


# ---------------------------------------------------------------------------
# Acceptance 7: the narrated demo (its text form is tests/test_cli.py::test_scripts_demo_runs_the_main_job_end_to_end)


def test_agentfold_demo_json_reports_one_booking_and_a_completed_run(tmp_path: Path) -> None:
    # The demo keeps its temporary folder for inspection: put it under this test's tmp_path.
    demo = ok(agentfold("demo", "--json", env={"TMPDIR": str(tmp_path)}, timeout=300)).json()
    assert set(demo) == {"store", "bookings", "status", "final"}
    assert demo["bookings"] == 1
    assert demo["status"] == "completed"
    assert "Hotel Alfama" in demo["final"] and "window seat" in demo["final"]
    assert demo["store"].startswith(f"sqlite:///{tmp_path}/agentfold-demo-")
    # The outside world, read from the side-effect log next to the store: one booking.
    log = Path(demo["store"].removeprefix("sqlite:///")).parent / "side-effects.jsonl"
    bookings = [json.loads(line) for line in log.read_text().splitlines() if json.loads(line)["tool"] == "book_hotel"]
    assert [b["call_id"] for b in bookings] == ["call_hotel"]


def test_recover_leaves_a_parked_tree_as_it_is_and_adopts_one_with_a_call_in_flight(tmp_path: Path) -> None:
    # A run waiting for a human answer has nothing to recover: `recover` (run by cron, say)
    # must not append a WriterActivated to it every time.
    store = sqlite_url(tmp_path)
    waiting = run_json(store, write(tmp_path, approval(None), "approval.json"), "--start-id", "parked-1")
    assert waiting["status"] == "waiting"
    before = store_version(store, waiting["tree_id"])
    for _ in range(2):
        [entry] = ok(agentfold("recover", "--json", store=store)).json()["trees"]
        assert (entry["outcome"], entry["start_id"], entry["classification"]) == ("parked", "parked-1", "parked")
        assert store_version(store, waiting["tree_id"]) == before
    text = ok(agentfold("recover", store=store)).stdout
    assert text.startswith(f"left {waiting['tree_id']} (start parked-1): parked, nothing in flight")

    # A crash right after a dispatch permission leaves a call in flight: that tree is adopted.
    log = tmp_path / "calls.jsonl"
    died = agentfold("run", str(write(tmp_path, two_call_round(log, final=FINAL), "round.json")),
                     "--start-id", "crashed-1", "--crash-after", "dispatched:2", "--json", store=store)
    assert died.code == 75, died.stderr
    outcomes = {e["start_id"]: e["outcome"] for e in ok(agentfold("recover", "--json", store=store)).json()["trees"]}
    assert outcomes == {"parked-1": "parked", "crashed-1": "recovered"}
    assert store_version(store, waiting["tree_id"]) == before


def test_json_arguments_too_large_for_a_command_line_come_from_a_file_or_standard_input(tmp_path: Path) -> None:
    """Linux holds at most 128 KiB per argument, far below the payload limits: ``@PATH`` and
    ``-`` give resolve (and answer) their JSON from a file or standard input."""
    store = sqlite_url(tmp_path)
    started = run_json(store, write(tmp_path, two_call_round(None, alpha={"error": "down"})), "--start-id", "big-1")
    [alpha] = unknowns(store)
    before = store_version(store, started["tree_id"])
    missing = refused(agentfold("resolve", alpha["effect_id"], "--output", f"@{tmp_path / 'nope.json'}", "--json",
                                store=store)).error()
    assert missing["code"] == "cli.argument_invalid" and "cannot read" in missing["message"]
    assert store_version(store, started["tree_id"]) == before

    big = "x" * 300_000
    (tmp_path / "big.json").write_text(json.dumps({"content": big}))
    ok(agentfold("resolve", alpha["effect_id"], "--output", f"@{tmp_path / 'big.json'}", store=store))
    [final] = unknowns(store)
    assert big in json.dumps(model_call(final)["request"]["messages"][-1])
    env = {k: v for k, v in os.environ.items() if k != "AGENTFOLD_STORE"}
    env["PYTHONPATH"] = str(ROOT)
    piped = subprocess.run(
        [sys.executable, "-m", "agentfold.adapters.cli", "resolve", final["effect_id"], "--model-response", "-", "--store", store],
        input=json.dumps(FINAL), capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert piped.returncode == 0, piped.stderr
    assert root_output(store, "big-1")["model_calls"] == 2


def test_resolve_says_the_disposition_a_host_gave_a_tool_call(tmp_path: Path) -> None:
    # An audit found `--disposition rejected` answered "resolved ... as succeeded" (the effect
    # settles succeeded, holding the tool result the host gave): the operator said rejected.
    store = sqlite_url(tmp_path)
    started = run_json(store, write(tmp_path, two_call_round(None, beta={"error": "down"}, final=LEFT_TO_HOST)),
                       "--start-id", "rejected-1")
    [beta] = unknowns(store, started["tree_id"])
    resolved = ok(agentfold("resolve", beta["effect_id"], "--output", '"not allowed"', "--disposition", "rejected",
                            store=store)).stdout
    assert resolved.startswith(f"resolved {beta['effect_id']} as a tool result, rejected\n"), resolved


def test_run_and_show_say_why_a_run_failed_with_its_code(tmp_path: Path) -> None:
    # A scenario author's walk: `run` printed "root failed, tree terminal" and `show` the
    # message only; the code was in --json alone.
    store = sqlite_url(tmp_path)
    doc = {**two_call_round(None), "limits": {"max_model_calls": 1}}
    ran = ok(agentfold("run", str(write(tmp_path, doc)), "--start-id", "limited", store=store)).stdout
    assert "root failed, tree terminal" in ran
    assert ("\nfailed: interaction.limit.model_calls: Interaction reached its configured model-call limit (1) "
            "before a final response") in ran
    shown = ok(agentfold("show", "limited", store=store)).stdout
    assert "before a final response [interaction.limit.model_calls]" in shown
    # The same start id again returns that run, and says so.
    again = ok(agentfold("run", str(write(tmp_path, doc)), "--start-id", "limited", store=store)).stdout
    assert again.startswith("run two-call-round: this start id's run, started before: tree:")
    assert "run two-call-round: tree:" in ran

"""The HTTP API through a real ``agentfold serve`` process and a real HTTP client (docs/http-api.md).

One server per backend (SQLite file, PostgreSQL database) serves the whole module;
every test starts its own runs under fresh start ids. Runs are scenarios
(docs/scenarios.md): a scripted model and scripted tools; a model response scripted
as ``{"error": ...}`` leaves that model call unknown, so a test can read its retained
request and resolve it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from agentfold.adapters.kernel_demo import payment_input, read_log
from tests.http_api.support import TOKEN, ApiServer, ok, problem, wait_until
from tests.test_cli_interaction import (
    APPROVAL_PROMPT,
    APPROVAL_SCHEMA,
    FINAL,
    HOST_BETA,
    LEFT_TO_HOST,
    approval,
    text,
    two_call_round,
)

HELLO = {
    "name": "hello",
    "input": {"messages": [{"role": "user", "content": "Say hello."}]},
    "model": {"responses": [{"finish_reason": "stop", "message": {"content": "Hello."}}]},
}
POEM = {
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
TREE_SUMMARY_KEYS = {"tree_id", "start_id", "root_process_id", "program", "status", "classification", "version",
                     "unknown_effect_ids"}
OPERATIONS = {
    ("get", "/health"), ("get", "/openapi.json"), ("get", "/metrics"), ("get", "/runs"), ("post", "/runs"), ("get", "/runs/{tree}"),
    ("get", "/runs/{tree}/results"), ("get", "/runs/{tree}/pending-inputs"), ("get", "/runs/{tree}/unknown-effects"),
    ("get", "/runs/{tree}/gates"),
    ("get", "/processes/{process_id}/delegates"), ("get", "/pending-inputs"), ("get", "/gates"), ("get", "/unknown-effects"),
    ("post", "/processes/{process_id}/waits/{wait_id}/answer"), ("post", "/processes/{process_id}/steer"),
    ("post", "/unknown-effects/{effect_id}/resolve"), ("post", "/processes/{process_id}/cancel"),
    ("post", "/processes/{process_id}/pause"), ("post", "/processes/{process_id}/resume"),
}


def sid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def start(c: httpx.Client, scenario: dict[str, Any], start_id: str, wait: float = 30.0, status: int = 201) -> Any:
    data = ok(c.post("/runs", json={"scenario": scenario, "start_id": start_id, "wait": wait}), status)
    assert set(data) == {"created", "tree", "idle", "position"}
    assert set(data["tree"]) == TREE_SUMMARY_KEYS
    return data


def run(c: httpx.Client, ref: str, **params: Any) -> Any:
    return ok(c.get(f"/runs/{ref}", params=params))


def written(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    """A write's answer: its own members, the tree summary, idle, and a position."""
    assert set(data) == {*keys, "tree", "idle", "position"}, data
    assert set(data["tree"]) == TREE_SUMMARY_KEYS
    assert isinstance(data["position"], int) and data["position"] > 0
    return data


def every_page(c: httpx.Client, path: str, member: str, limit: int = 500) -> list[dict[str, Any]]:
    """Every entry of a paged store-wide listing, following ``next_after``."""
    entries: list[dict[str, Any]] = []
    params: dict[str, Any] = {"limit": limit}
    while True:
        page = ok(c.get(path, params=params))
        assert set(page) == {member, "next_after"}, page
        entries += page[member]
        if page["next_after"] is None:
            return entries
        params["after"] = page["next_after"]


def pending_of(c: httpx.Client, tree_id: str) -> list[dict[str, Any]]:
    return [p for p in every_page(c, "/pending-inputs", "pending") if p["tree_id"] == tree_id]


def unknown_of(c: httpx.Client, tree_id: str) -> list[dict[str, Any]]:
    """The run's unknown effects, the same in its own listing and in the global one.

    The global listing is read between two reads of the run's own: while the run is still
    moving (an unknown being recorded between two requests), the reads are taken again;
    two requests at different moments may rightly differ."""
    for _ in range(100):
        listed = ok(c.get(f"/runs/{tree_id}/unknown-effects"))["unknown_effects"]
        everywhere = [e for e in every_page(c, "/unknown-effects", "unknown_effects") if e["tree_id"] == tree_id]
        again = ok(c.get(f"/runs/{tree_id}/unknown-effects"))["unknown_effects"]
        if listed == again:
            assert listed == everywhere
            return listed  # type: ignore[no-any-return]
        time.sleep(0.05)
    raise AssertionError(f"the unknown effects of {tree_id} kept changing")


def parked_approval(c: httpx.Client, prefix: str, final: dict[str, Any] = FINAL) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run whose tool waits for a human answer: (its tree summary, its pending input)."""
    data = start(c, approval(None, final=final), sid(prefix))
    tree = data["tree"]
    assert (data["idle"], tree["status"], tree["classification"]) == (True, "waiting", "parked")
    [wait] = pending_of(c, tree["tree_id"])
    return tree, wait


# ---------------------------------------------------------------------------
# Health, authentication, the OpenAPI document


def test_health_answers_without_a_token_with_the_store_and_read_model_positions(api: ApiServer) -> None:
    health = ok(httpx.get(api.url + "/health"))
    assert health["status"] == "ok"
    assert health["backend"] == api.store.split(":")[0]
    assert health["follower"] == "running"
    positions = health["positions"]
    assert isinstance(positions["store"], int) and isinstance(positions["read_models"], int)
    assert 0 <= positions["read_models"] <= ok(httpx.get(api.url + "/health"))["positions"]["store"]


def test_health_answers_head_probes_with_its_status_and_no_body(api: ApiServer) -> None:
    probe = httpx.head(api.url + "/health")
    assert probe.status_code == 200, probe.text
    assert probe.content == b""
    assert probe.headers["content-type"] == "application/json"
    assert api.client().head("/health/").status_code == 404  # no redirect, as GET
    # the other endpoints still answer only what the OpenAPI document lists (HEAD is not one)
    assert api.client().head("/runs").status_code == 405


def test_every_endpoint_but_health_refuses_a_missing_or_wrong_token_with_401(api: ApiServer) -> None:
    document = ok(api.client().get("/openapi.json"))
    operations = {(method, path) for path, ops in document["paths"].items() for method in ops}
    assert operations == OPERATIONS
    before = ok(httpx.get(api.url + "/health"))["positions"]["store"]
    anonymous, wrong, basic = api.client(token=None), api.client(token=TOKEN + "x"), api.client(token=None)
    basic.headers["Authorization"] = "Basic " + TOKEN
    for method, path in sorted(operations - {("get", "/health")}):
        url = path.replace("{tree}", "t").replace("{process_id}", "p").replace("{wait_id}", "w")
        url = url.replace("{effect_id}", "e")
        body = {"json": {}} if method == "post" else {}
        for client in (anonymous, basic):
            refused = client.request(method, url, **body)
            problem(refused, 401, "http.unauthorized")
            assert refused.headers["www-authenticate"] == "Bearer"
        refused = wrong.request(method, url, **body)
        problem(refused, 401, "http.unauthorized")
        assert refused.headers["www-authenticate"] == 'Bearer error="invalid_token"'
    # A refused request is refused before its body is looked at: nothing was appended.
    assert ok(httpx.get(api.url + "/health"))["positions"]["store"] == before


def test_the_served_openapi_document_is_the_committed_docs_openapi_json(api: ApiServer) -> None:
    committed = json.loads((Path(__file__).resolve().parents[2] / "docs" / "openapi.json").read_text())
    assert ok(api.client().get("/openapi.json")) == committed, "regenerate it with scripts/openapi"


def test_unknown_paths_and_methods_are_problems_too(api: ApiServer) -> None:
    c = api.client()
    problem(c.get("/nowhere"), 404, "http.not_found")
    refused = c.delete("/runs")
    problem(refused, 405, "http.method_not_allowed")
    # Allow names every method of the path (GET and POST /runs are two routes)
    assert refused.headers["allow"] == "GET, POST"
    assert c.put("/runs/tree:00000000000000000000000000000000").headers["allow"] == "GET"


# ---------------------------------------------------------------------------
# Starting runs


def test_a_start_is_idempotent_by_start_id_201_then_200_with_the_same_run(api: ApiServer) -> None:
    c = api.client()
    start_id = sid("hello")
    first = start(c, HELLO, start_id)
    tree = first["tree"]
    assert (first["created"], first["idle"]) == (True, True)
    assert (tree["start_id"], tree["status"], tree["classification"]) == (start_id, "completed", "terminal")
    again = start(c, HELLO, start_id, status=200)
    assert again["created"] is False
    assert again["tree"] == tree
    assert again["position"] >= first["position"]

    # The same start id with another scenario is a conflict; nothing changes.
    other = {**HELLO, "name": "another"}
    problem(c.post("/runs", json={"scenario": other, "start_id": start_id}), 409, "engine.start.conflict")

    # The run is found by its tree id, its start id and its root process id.
    entry = run(c, tree["tree_id"])
    assert run(c, start_id) == entry == run(c, tree["root_process_id"])
    assert (entry["tree_id"], entry["status"], entry["program"]) == (tree["tree_id"], "completed", "agentfold.scenario")
    assert entry["output"]["model_response"]["message"]["content"] == text("Hello.")
    assert entry["failure"] is None
    assert [p["status"] for p in entry["processes"]] == ["completed"]
    assert entry["version"] == tree["version"]


def test_concurrent_starts_with_one_start_id_create_one_run(api: ApiServer) -> None:
    start_id = sid("together")
    barrier = threading.Barrier(4)
    answers: list[httpx.Response] = []

    def post() -> None:
        c = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        with c:
            barrier.wait()
            answers.append(c.post("/runs", json={"scenario": HELLO, "start_id": start_id, "wait": 30}))

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status_code for r in answers) == [200, 200, 200, 201], [r.text for r in answers]
    assert sorted(r.json()["created"] for r in answers) == [False, False, False, True]
    assert len({r.json()["tree"]["tree_id"] for r in answers}) == 1


def test_a_registered_program_starts_by_name_and_runs_to_completion(api: ApiServer, tmp_path: Path) -> None:
    c = api.client()
    log = tmp_path / "side-effects.jsonl"
    data = ok(c.post("/runs", json={"program": "demo.payment", "input": payment_input("ada", 1250, log),
                                    "start_id": sid("order"), "wait": 30}), 201)
    assert (data["tree"]["program"], data["tree"]["status"]) == ("demo.payment", "completed")
    assert [line["action"] for line in read_log(log)] == ["charge", "send_receipt"]
    entry = run(c, data["tree"]["tree_id"])
    assert entry["output"]["receipt_sent"] is True


def test_results_of_a_kernel_run_are_refused_with_a_hint_naming_its_request_once(
    api: ApiServer, tmp_path: Path,
) -> None:
    # The hint named the same request twice ("look at the run itself (GET /runs/T, GET /runs/T)"):
    # the CLI's "`agentfold show T`, GET /runs/T" was translated without dropping the pair.
    c = api.client()
    data = ok(c.post("/runs", json={"program": "demo.payment",
                                    "input": payment_input("bo", 10, tmp_path / "side-effects.jsonl"),
                                    "start_id": sid("order"), "wait": 30}), 201)
    tree_id = data["tree"]["tree_id"]
    refused = problem(c.get(f"/runs/{tree_id}/results"), 404, "engine.program.unavailable")
    assert refused["hint"].count(f"GET /runs/{tree_id}") == 1, refused["hint"]
    assert "agentfold show" not in refused["hint"]


def test_refused_starts_are_problems_and_append_nothing(api: ApiServer) -> None:
    c = api.client()
    before = ok(c.get("/health"))["positions"]["store"]
    bad = {**HELLO, "tools": [{"name": "t", "result": {"failure": {"kind": "oops", "output": "x"}}}]}
    invalid = problem(c.post("/runs", json={"scenario": bad}), 422, "scenario.invalid")
    assert invalid["path"] == "$.tools[0].result.failure.kind"
    assert invalid["hint"]
    assert invalid["faults"] == [{"path": "$.tools[0].result.failure.kind", "message": "must be failed or rejected"}]
    assert invalid["fault_count"] == 1
    # Every fault of a scenario in one problem, the first as its path.
    worse = {**bad, "limits": {"max_model_calls": 0}, "tools": [*bad["tools"], {"name": "t", "result": {"echo": 1}}]}
    invalid = problem(c.post("/runs", json={"scenario": worse}), 422, "scenario.invalid")
    assert invalid["path"] == "$.tools[0].result.failure.kind"
    assert [f["path"] for f in invalid["faults"]] == [
        "$.tools[0].result.failure.kind", "$.tools[1].name", "$.limits.max_model_calls"]
    assert invalid["fault_count"] == 3
    both = c.post("/runs", json={"scenario": HELLO, "program": "demo.payment"})
    problem(both, 422, "http.request_invalid")
    problem(c.post("/runs", json={}), 422, "http.request_invalid")
    problem(c.post("/runs", json={"scenario": HELLO, "input": {}}), 422, "http.request_invalid")
    unknown_member = problem(c.post("/runs", json={"scenario": HELLO, "colour": "red"}), 422, "http.request_invalid")
    assert unknown_member["errors"][0]["location"] == ["body", "colour"]
    malformed = c.post("/runs", content=b'{"scenario": ', headers={"content-type": "application/json"})
    problem(malformed, 422, "http.request_invalid")
    problem(c.post("/runs", json={"scenario": HELLO, "wait": 301}), 422, "http.request_invalid")
    text_nan = problem(c.post("/runs", json={"scenario": HELLO, "wait": "nan"}), 422, "http.request_invalid")
    assert "valid number" in text_nan["detail"], text_nan  # a string is not converted
    bare_nan = c.post("/runs", content=b'{"scenario": ' + json.dumps(HELLO).encode() + b', "wait": NaN}',
                      headers={"content-type": "application/json"})
    not_a_number = problem(bare_nan, 422, "http.request_invalid")
    assert "finite" in not_a_number["detail"], not_a_number  # not "less than or equal to 300"
    problem(c.post("/runs", json={"scenario": HELLO, "start_id": "has space"}), 422, "identity.invalid")
    problem(c.post("/runs", json={"program": "no.such.program"}), 404, "engine.program.unavailable")
    problem(c.post("/runs", json={"program": "demo.payment", "input": {"customer": 1}}), 422, "engine.start.input_invalid")
    assert ok(c.get("/health"))["positions"]["store"] == before


# ---------------------------------------------------------------------------
# Reads


def test_runs_are_listed_in_creation_order_page_by_page_with_filters(api: ApiServer) -> None:
    c = api.client()
    mine = [start(c, HELLO, sid("page"))["tree"]["tree_id"] for _ in range(3)]
    parked, _ = parked_approval(c, "page-parked")
    seen: list[str] = []
    after = None
    while True:
        params: dict[str, Any] = {"limit": 2}
        if after is not None:
            params["after"] = after
        page = ok(c.get("/runs", params=params))
        assert len(page["runs"]) <= 2
        seen += [r["tree_id"] for r in page["runs"]]
        for r in page["runs"]:
            assert {"tree_id", "status", "classification", "processes", "cursor"} <= set(r)
        after = page["next_after"]
        if after is None:
            break
        assert after == page["runs"][-1]["cursor"]
    assert len(seen) == len(set(seen))  # no run twice
    assert [t for t in seen if t in (*mine, parked["tree_id"])] == [*mine, parked["tree_id"]]
    waiting = ok(c.get("/runs", params={"status": "waiting", "limit": 500}))["runs"]
    assert parked["tree_id"] in [r["tree_id"] for r in waiting]
    assert {r["status"] for r in waiting} == {"waiting"}
    done = ok(c.get("/runs", params={"classification": "terminal", "limit": 500}))["runs"]
    assert set(mine) <= {r["tree_id"] for r in done} and parked["tree_id"] not in {r["tree_id"] for r in done}
    problem(c.get("/runs", params={"status": "sleeping"}), 422, "http.request_invalid")
    problem(c.get("/runs", params={"limit": 501}), 422, "http.request_invalid")
    problem(c.get("/runs", params={"after": "zzz"}), 422, "http.cursor_invalid")
    problem(c.get("/runs", params={"after": "m" + "9" * 40}), 422, "http.cursor_invalid")  # beyond 64 bits
    problem(c.get("/runs", params={"after": "m01"}), 422, "http.cursor_invalid")  # not how this API spells m1
    ok(c.post(f"/processes/{parked['root_process_id']}/cancel", json={"wait": 30}))


def test_reads_of_missing_runs_and_processes_are_404_and_bad_ids_422(api: ApiServer) -> None:
    c = api.client()
    missing_tree = "tree:" + "0" * 32
    for path in ("", "/results", "/pending-inputs", "/unknown-effects"):
        problem(c.get(f"/runs/{missing_tree}{path}"), 404, "engine.tree.not_found")
    problem(c.get("/runs/no-such-start"), 404, "engine.tree.not_found")
    problem(c.get("/runs/tree:xyz"), 422, "identity.invalid")
    problem(c.get("/processes/process:nope/delegates"), 404, "engine.process.not_found")
    problem(c.get("/processes/has space/delegates"), 422, "identity.invalid")
    problem(c.get("/runs", params={"min_position": -1}), 422, "http.request_invalid")
    # Their hints name this API's listings, not the CLI's commands (found by an error-code audit).
    for answer in (c.get(f"/runs/{missing_tree}"), c.get("/runs/no-such-start")):
        hint = answer.json()["hint"]
        assert "GET /runs" in hint and "agentfold" not in hint, hint
    unknown = c.post("/unknown-effects/effect:" + "0" * 64 + "/resolve", json={"output": "x"})
    assert unknown.status_code == 404 and "agentfold" not in unknown.json().get("hint", ""), unknown.text


def test_delegate_attributions_name_the_child_each_delegated_call_started(api: ApiServer) -> None:
    c = api.client()
    start_id = sid("poem")
    tree = start(c, POEM, start_id)["tree"]
    assert tree["status"] == "completed"
    root = tree["root_process_id"]
    listed = ok(c.get(f"/processes/{root}/delegates"))
    assert (listed["process_id"], listed["found"]) == (root, True)
    [d] = listed["delegates"]
    assert (d["tree_id"], d["tool_call_ref"], d["process_id"]) == (tree["tree_id"], f"{root}/1/0", root)
    assert d["tool_call"] == {"id": "call_w", "name": "writer", "arguments": '{"topic": "sea"}'}
    child = {p["process_id"]: p for p in run(c, root)["processes"]}[d["child_process_id"]]
    assert (child["parent_id"], child["child_key"], child["status"]) == (root, d["child_key"], "completed")
    # The child is an Interaction without delegates; a finished delegate stays attributed.
    assert ok(c.get(f"/processes/{d['child_process_id']}/delegates"))["delegates"] == []
    assert ok(c.get(f"/runs/{tree['tree_id']}/results")) == {"tree_id": tree["tree_id"], "rounds": []}
    # The run's start id where the process id goes: the answer names the root process to ask for.
    named = problem(c.get(f"/processes/{start_id}/delegates"), 404, "engine.process.not_found")
    assert f"names the run {tree['tree_id']}" in named["detail"] and root in named["hint"], named


# ---------------------------------------------------------------------------
# Answers


def test_an_answer_is_validated_against_the_wait_then_drives_the_run_to_completion(api: ApiServer) -> None:
    c = api.client()
    tree, wait = parked_approval(c, "approval")
    tree_id, root = tree["tree_id"], tree["root_process_id"]
    assert set(wait) == {"tree_id", "process_id", "wait_id", "prompt", "response_schema", "tool_call_ref"}
    assert (wait["prompt"], wait["response_schema"]) == (APPROVAL_PROMPT, APPROVAL_SCHEMA)
    assert wait["tool_call_ref"] == f"{root}/1/0" and wait["process_id"] != root
    assert ok(c.get(f"/runs/{tree_id}/pending-inputs")) == {"pending": [wait]}
    pid, wid = wait["process_id"], wait["wait_id"]
    answer_url = f"/processes/{pid}/waits/{wid}/answer"
    version = run(c, tree_id)["version"]

    schema = problem(c.post(answer_url, json={"response": {"approved": "yes"}}), 422, "engine.signal.schema")
    assert "$.approved: expected boolean" in schema["detail"]
    big = {"approved": True, "note": "x" * (1 << 20)}
    problem(c.post(answer_url, json={"response": big}), 422, "payload.too_large")
    problem(c.post(answer_url, json={}), 422, "http.request_invalid")
    problem(c.post(answer_url, json={"response": {"approved": True}, "signal_id": "signal:engine:x"}), 422,
            "signal.invalid")
    malformed = problem(c.post(f"/processes/{pid}/waits/wait:nope/answer", json={"response": {"approved": True}}),
                        422, "identity.invalid")
    assert "wait:nope" in malformed["detail"] and "64 lowercase hex" in malformed["hint"], malformed
    wrong_wait = problem(c.post(f"/processes/{pid}/waits/wait:{'0' * 64}/answer",
                                json={"response": {"approved": True}}), 409, "engine.signal.rejected")
    assert wrong_wait["wait"] is None
    problem(c.post(f"/processes/process:nope/waits/{wid}/answer", json={"response": {"approved": True}}), 404,
            "engine.process.not_found")
    assert run(c, tree_id)["version"] == version  # refused answers append nothing
    assert pending_of(c, tree_id) == [wait]

    answered = written(ok(c.post(answer_url, json={"response": {"approved": True, "note": "ok"},
                                                   "signal_id": "approve-1", "wait": 30})),
                       "accepted", "signal_id", "process_id", "wait_id", "driven")
    assert (answered["accepted"], answered["signal_id"], answered["process_id"], answered["wait_id"]) == (
        True, "approve-1", pid, wid)
    assert answered["driven"] is True  # this server drives the run (a CLI beside it says false)
    assert (answered["idle"], answered["tree"]["status"], answered["tree"]["classification"]) == (
        True, "completed", "terminal")
    assert run(c, tree_id, min_position=answered["position"])["output"]["model_calls"] == 2
    assert ok(c.get("/pending-inputs", params={"min_position": answered["position"]}))["pending"] == [
        p for p in ok(c.get("/pending-inputs"))["pending"] if p["tree_id"] != tree_id]

    # The same answer under the same signal id again: accepted false, nothing changes.
    again = ok(c.post(answer_url, json={"response": {"approved": True, "note": "ok"}, "signal_id": "approve-1"}))
    assert (again["accepted"], again["tree"]["status"]) == (False, "completed")
    conflict = c.post(answer_url, json={"response": {"approved": False}, "signal_id": "approve-1"})
    problem(conflict, 409, "engine.signal.conflict")
    late = problem(c.post(answer_url, json={"response": {"approved": False}, "signal_id": "approve-2"}), 409,
                   "engine.signal.rejected")
    assert late["wait"] == {"wait_id": wid, "process_id": pid, "state": "answered", "answered_by": "approve-1"}
    # A signal id of the engine's namespace is malformed whatever the wait's state (it was a 409
    # "already answered" once the wait was answered: an operator's walk).
    problem(c.post(answer_url, json={"response": {"approved": True}, "signal_id": "signal:engine:x"}), 422,
            "signal.invalid")
    problem(c.post(answer_url, json={"response": big, "signal_id": "approve-3"}), 422, "payload.too_large")
    assert run(c, tree_id)["version"] == answered["tree"]["version"]


def test_two_answers_racing_for_one_wait_one_wins_the_other_gets_409_with_the_wait_state(api: ApiServer) -> None:
    c = api.client()
    tree, wait = parked_approval(c, "race", final=LEFT_TO_HOST)
    url = f"/processes/{wait['process_id']}/waits/{wait['wait_id']}/answer"
    answers = {"race-yes": {"approved": True, "note": "yes"}, "race-no": {"approved": False, "note": "no"}}
    barrier = threading.Barrier(len(answers))
    replies: dict[str, httpx.Response] = {}

    def post(signal_id: str) -> None:
        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as own:
            barrier.wait()
            replies[signal_id] = own.post(url, json={"response": answers[signal_id], "signal_id": signal_id})

    threads = [threading.Thread(target=post, args=(s,)) for s in answers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    [winner] = [s for s, r in replies.items() if r.status_code == 200]
    [loser] = [s for s, r in replies.items() if r.status_code != 200]
    assert ok(replies[winner])["accepted"] is True
    refused = problem(replies[loser], 409, "engine.signal.rejected")
    assert refused["wait"] == {"wait_id": wait["wait_id"], "process_id": wait["process_id"], "state": "answered",
                               "answered_by": winner}

    # The run goes on with the winning answer only: the next model call sees it as the tool result.
    [model_call] = wait_until(lambda: unknown_of(c, tree["tree_id"]))
    assert model_call["kind"] == "model"
    messages = model_call["request"]["model_call"]["request"]["messages"]
    assert messages[-1]["tool_results"][0]["output"] == {"details": answers[winner]}
    done = ok(c.post(f"/unknown-effects/{model_call['effect_id']}/resolve",
                     json={"model_response": FINAL, "wait": 30}))
    assert done["tree"]["status"] == "completed"
    assert run(c, tree["tree_id"])["output"]["model_calls"] == 2


# ---------------------------------------------------------------------------
# Resolutions


def test_unknown_tool_and_model_calls_are_resolved_and_the_run_completes(api: ApiServer) -> None:
    c = api.client()
    doc = two_call_round(None, beta={"error": "the beta API timed out"}, final=LEFT_TO_HOST)
    tree = start(c, doc, sid("round"))["tree"]
    tree_id, root = tree["tree_id"], tree["root_process_id"]
    assert tree["classification"] == "parked"
    [beta] = unknown_of(c, tree_id)
    assert (beta["kind"], beta["tool_call_ref"]) == ("tool", f"{root}/1/1")
    assert beta["process_id"] != root  # the call's Tool child holds the effect
    assert beta["request"]["tool_call"]["invocation"]["call"]["name"] == "beta"
    # SettledResults: the round is sparse, alpha is known, beta is not.
    [round_] = ok(c.get(f"/runs/{tree_id}/results"))["rounds"]
    assert (round_["call_count"], round_["complete"]) == (2, False)
    assert [e["tool_call_index"] for e in round_["entries"]] == [0]
    assert round_["references"] == [f"{root}/1/0", f"{root}/1/1"]
    assert round_["digest"].startswith("sha256:")

    url = f"/unknown-effects/{beta['effect_id']}/resolve"
    version = run(c, tree_id)["version"]
    problem(c.post(url, json={"model_response": FINAL}), 422, "http.request_invalid")
    problem(c.post(url, json={"output": "x", "status": "failed"}), 422, "http.request_invalid")
    problem(c.post(url, json={}), 422, "http.request_invalid")
    problem(c.post(url, json={"output": "x", "disposition": "maybe"}), 422, "http.request_invalid")
    problem(c.post(url, json={"output": {"beta": "B"}}), 422, "interaction.settlement.invalid")
    problem(c.post(f"/unknown-effects/effect:{'0' * 64}/resolve", json={"output": "x"}), 404,
            "engine.effect.not_pending")
    # Effect ids are derived: anything but effect:<64 hex> cannot name one.
    problem(c.post("/unknown-effects/effect:nope/resolve", json={"output": "x"}), 422, "identity.invalid")
    problem(c.post("/unknown-effects/has space/resolve", json={"output": "x"}), 422, "identity.invalid")
    assert run(c, tree_id)["version"] == version

    resolved = written(ok(c.post(url, json={"output": {"details": HOST_BETA}, "wait": 30})),
                       "effect_id", "process_id", "resolution", "driven")
    assert (resolved["effect_id"], resolved["process_id"], resolved["driven"]) == (
        beta["effect_id"], beta["process_id"], True)
    assert resolved["resolution"]["status"] == "succeeded"
    problem(c.post(url, json={"output": "again"}), 404, "engine.effect.not_pending")

    # The next model call was left to the host: it sees both results; resolve it too.
    [model] = unknown_of(c, tree_id)
    assert (model["kind"], model["tool_call_ref"]) == ("model", None)
    tool_message = model["request"]["model_call"]["request"]["messages"][-1]
    assert [r["name"] for r in tool_message["tool_results"]] == ["alpha", "beta"]
    assert tool_message["tool_results"][1]["output"] == {"details": HOST_BETA}
    model_url = f"/unknown-effects/{model['effect_id']}/resolve"
    problem(c.post(model_url, json={"output": "text"}), 422, "http.request_invalid")
    # A finish reason outside the vocabulary is a typo, not an outcome: refused, nothing appended.
    bogus = problem(c.post(model_url, json={"model_response": {**FINAL, "finish_reason": "bogus"}}), 422,
                    "interaction.settlement.invalid")
    assert "unknown finish reason 'bogus'" in bogus["detail"]
    assert [u["effect_id"] for u in unknown_of(c, tree_id)] == [model["effect_id"]]
    done = ok(c.post(model_url, json={"model_response": FINAL, "wait": 30}))
    assert (done["tree"]["status"], done["tree"]["unknown_effect_ids"]) == ("completed", [])
    entry = run(c, tree_id, min_position=done["position"])
    assert entry["output"]["model_response"]["message"]["content"] == text("a is A and b is B.")
    assert unknown_of(c, tree_id) == []


# ---------------------------------------------------------------------------
# Steering and controls


def test_steering_is_admitted_once_refused_for_a_tool_child_and_reaches_the_next_model_call(api: ApiServer) -> None:
    c = api.client()
    tree, wait = parked_approval(c, "steer", final=LEFT_TO_HOST)
    root, tree_id = tree["root_process_id"], tree["tree_id"]
    url = f"/processes/{root}/steer"
    steered = written(ok(c.post(url, json={"text": "Also book a window seat.", "signal_id": "steer-1"})),
                      "accepted", "signal_id", "process_id", "driven")
    assert (steered["accepted"], steered["signal_id"], steered["process_id"], steered["driven"]) == (
        True, "steer-1", root, True)
    again = ok(c.post(url, json={"text": "Also book a window seat.", "signal_id": "steer-1"}))
    assert again["accepted"] is False
    version = run(c, tree_id)["version"]
    problem(c.post(url, json={"text": "Something else.", "signal_id": "steer-1"}), 409, "engine.signal.conflict")
    problem(c.post(f"/processes/{wait['process_id']}/steer", json={"text": "Hurry."}), 409, "engine.signal.rejected")
    problem(c.post(url, json={"text": "a", "messages": [{"role": "user", "content": "b"}]}), 422,
            "http.request_invalid")
    problem(c.post(url, json={}), 422, "http.request_invalid")
    problem(c.post(url, json={"messages": [{"role": "assistant", "content": "b"}]}), 422, "interaction.signal.invalid")
    for blank in ({"text": ""}, {"text": "  \n"}, {"messages": [{"role": "user", "content": [{"type": "text", "text": " "}]}]}):
        assert "no text" in problem(c.post(url, json=blank), 422, "interaction.signal.invalid")["detail"]
    problem(c.post("/processes/process:nope/steer", json={"text": "hi"}), 404, "engine.process.not_found")
    assert run(c, tree_id)["version"] == version
    assert pending_of(c, tree_id) == [wait]  # steering never answers a tool's input wait

    answer = {"response": {"approved": True}, "wait": 30}
    ok(c.post(f"/processes/{wait['process_id']}/waits/{wait['wait_id']}/answer", json=answer))
    [model] = unknown_of(c, tree_id)
    call = model["request"]["model_call"]
    assert call["applied_steer_signal_ids"] == ["steer-1"]
    assert call["request"]["messages"][-1] == {"role": "user", "content": text("Also book a window seat.")}
    ok(c.post(f"/processes/{root}/cancel", json={"wait": 30}))


def test_pause_resume_and_cancel_control_a_run_and_refuse_what_its_state_forbids(api: ApiServer) -> None:
    c = api.client()
    tree, _ = parked_approval(c, "control")
    root, tree_id = tree["root_process_id"], tree["tree_id"]

    paused = written(ok(c.post(f"/processes/{root}/pause", json={"reason": "lunch", "wait": 30})),
                     "recorded", "process_id", "driven")
    assert (paused["recorded"], paused["process_id"], paused["tree"]["status"], paused["driven"]) == (
        True, root, "paused", True)
    assert run(c, tree_id, min_position=paused["position"])["status"] == "paused"
    assert ok(c.post(f"/processes/{root}/pause"))["recorded"] is False  # already paused: nothing changes
    resumed = ok(c.post(f"/processes/{root}/resume", json={"wait": 30}))
    assert (resumed["recorded"], resumed["tree"]["status"]) == (True, "waiting")
    problem(c.post(f"/processes/{root}/resume"), 409, "engine.process.control_invalid")
    problem(c.post(f"/processes/{root}/resume", json={"reason": "x"}), 422, "http.request_invalid")

    canceled = ok(c.post(f"/processes/{root}/cancel", json={"reason": "changed my mind", "wait": 30}))
    assert (canceled["recorded"], canceled["idle"], canceled["tree"]["status"]) == (True, True, "canceled")
    assert pending_of(c, tree_id) == []
    problem(c.post(f"/processes/{root}/cancel"), 409, "engine.process.finished")
    problem(c.post(f"/processes/{root}/pause"), 409, "engine.process.finished")
    problem(c.post("/processes/process:nope/cancel"), 404, "engine.process.not_found")


# ---------------------------------------------------------------------------
# Read your writes


def test_reads_with_min_position_reflect_the_callers_own_write(api: ApiServer) -> None:
    c = api.client()
    tree, wait = parked_approval(c, "ryw", final=LEFT_TO_HOST)
    tree_id = tree["tree_id"]
    # wait 0: the answer is acknowledged as soon as it is recorded.
    answered = ok(c.post(f"/processes/{wait['process_id']}/waits/{wait['wait_id']}/answer",
                         json={"response": {"approved": True}}))
    position = answered["position"]
    for _ in range(3):
        assert ok(c.get(f"/runs/{tree_id}/pending-inputs", params={"min_position": position})) == {"pending": []}
        entry = run(c, tree_id, min_position=position)
        assert entry["version"] >= answered["tree"]["version"]
    # A position the read models cannot reach in time is answered by folding, never stale.
    beyond = run(c, tree_id, min_position=position + 10**9, wait=0.2)
    assert beyond["tree_id"] == tree_id and beyond["version"] >= answered["tree"]["version"]
    # The follower catches up with every write.
    wait_until(lambda: ok(c.get("/health"))["positions"]["read_models"] >= position)
    [model] = wait_until(lambda: unknown_of(c, tree_id))
    ok(c.post(f"/unknown-effects/{model['effect_id']}/resolve", json={"model_response": FINAL, "wait": 30}))

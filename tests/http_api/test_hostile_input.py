"""Hostile input over HTTP: refused with a classified 422 before anything is appended.

Found by an audit that fed the API what no documented example sends: a lone surrogate
(valid JSON escape, not text) in a reason, an output or an answer; a reason above the 4096
bytes a reason may hold; a start id that reads as a tree id; a body nested deeper than the
JSON parser goes. Each once appended a ``WriterActivated`` before failing (503), answered 500,
was stored cut short, or was accepted and then unreachable by its start id.
"""

from __future__ import annotations

import codecs
import json
import socket
from pathlib import Path
from typing import Any

import httpx

from tests.http_api.support import ApiServer, ok, problem, start_server
from tests.http_api.test_api import HELLO, parked_approval, run, sid, start, unknown_of
from tests.test_cli_interaction import LEFT_TO_HOST, one_tool_call, two_call_round


def _post(c: httpx.Client, url: str, body: Any) -> httpx.Response:
    """JSON with ASCII escapes (a lone surrogate travels as the escape \\ud800, valid JSON)."""
    return c.post(url, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def waiting_for_an_answer(c: httpx.Client, prefix: str) -> tuple[dict[str, Any], int, str]:
    """A run parked on a tool's input wait: its tree summary, stored version and answer URL."""
    tree, wait = parked_approval(c, prefix)
    return tree, run(c, tree["tree_id"])["version"], f"/processes/{wait['process_id']}/waits/{wait['wait_id']}/answer"


def _unchanged(c: httpx.Client, tree_id: str, version: int) -> None:
    assert run(c, tree_id)["version"] == version, "a refused request appended to the run"


def test_lone_surrogates_and_oversize_reasons_are_refused_and_append_nothing(api: ApiServer) -> None:
    c = api.client()
    tree = start(c, two_call_round(None, beta={"error": "down"}, final=LEFT_TO_HOST), sid("hostile"))["tree"]
    tree_id, root = tree["tree_id"], tree["root_process_id"]
    [beta] = unknown_of(c, tree_id)
    version = run(c, tree_id)["version"]

    refusals: list[tuple[str, dict[str, Any], str]] = [
        (f"/unknown-effects/{beta['effect_id']}/resolve", {"output": "\ud800"}, "payload.invalid"),
        (f"/unknown-effects/{beta['effect_id']}/resolve", {"output": {"details": {"k": "\udcff"}}}, "payload.invalid"),
        (f"/processes/{root}/pause", {"reason": "\ud800"}, "control.invalid"),
        (f"/processes/{root}/cancel", {"reason": "\ud800"}, "control.invalid"),
        (f"/processes/{root}/cancel", {"reason": "x" * 4097}, "control.invalid"),
    ]
    for url, body, code in refusals:
        refused = problem(_post(c, url, body), 422, code)
        assert "surrogate" in refused["detail"] or "at most 4096 bytes" in refused["detail"], refused
        _unchanged(c, tree_id, version)
    ok(c.post(f"/processes/{root}/cancel", json={"reason": "x" * 4096}))  # exactly the limit is taken


def test_an_answer_holding_a_lone_surrogate_is_refused_not_a_500(api: ApiServer) -> None:
    c = api.client()
    tree, version, url = waiting_for_an_answer(c, "surrogate-answer")
    refused = problem(_post(c, url, {"response": {"approved": True, "note": "\ud800"}}), 422, "payload.invalid")
    assert "$.note" in refused["detail"] and "surrogate" in refused["detail"]
    _unchanged(c, tree["tree_id"], version)


def test_start_ids_that_read_as_tree_or_process_ids_are_refused(api: ApiServer) -> None:
    c = api.client()
    for start_id in ("tree:" + "a" * 32, "process:" + "b" * 32, "tree:abc"):
        refused = problem(c.post("/runs", json={"scenario": HELLO, "start_id": start_id}), 422,
                          "identity.invalid")
        assert "would read as a" in refused["detail"]
        problem(c.get(f"/runs/{start_id}"), 404 if start_id != "tree:abc" else 422,
                "engine.tree.not_found" if start_id != "tree:abc" else "identity.invalid")


def test_an_empty_signal_id_is_refused_by_steer_as_by_answer_and_appends_nothing(api: ApiServer) -> None:
    # A review found POST .../steer with "signal_id": "" admitted under a made-up id: every
    # resend appended one more steering message (no deduplication), while the answer
    # endpoint, `agentfold steer --signal-id ''` and Host.steer refuse "" (identity.invalid).
    c = api.client()
    tree, version, answer_url = waiting_for_an_answer(c, "empty-signal-id")
    steer_url = f"/processes/{tree['root_process_id']}/steer"
    for _ in range(2):  # a resend is refused alike
        for url, body in (
            (steer_url, {"text": "Also book a window seat.", "signal_id": ""}),
            (steer_url, {"messages": [{"role": "user", "content": "Also book a window seat."}], "signal_id": ""}),
            (answer_url, {"response": {"approved": True}, "signal_id": ""}),
        ):
            refused = problem(_post(c, url, body), 422, "identity.invalid")
            assert refused["detail"] == "invalid signal id ''", refused
    _unchanged(c, tree["tree_id"], version)
    # Without a signal_id, one is made up (the documented default).
    steered = ok(_post(c, steer_url, {"text": "Also book a window seat."}))
    assert steered["accepted"] is True and steered["signal_id"].startswith("steer:"), steered


def test_a_body_that_is_not_utf8_is_refused_whatever_the_parser_could_read_and_appends_nothing(
    api: ApiServer,
) -> None:
    # A review found UTF-16 and UTF-32 bodies answered and recorded (the JSON parser detects
    # them), and a surrogate encoded in UTF-8 bytes taken too (decoded with surrogatepass),
    # although the API takes UTF-8 only (docs/http-api.md#conventions, RFC 8259).
    c = api.client()
    tree, version, url = waiting_for_an_answer(c, "not-utf8")
    text = json.dumps({"response": {"approved": True}, "signal_id": "encoded", "wait": 5})
    surrogate = b'{"response": {"approved": true, "note": "\xed\xa0\x80"}}'
    at = surrogate.index(b"\xed")
    json_type = {"content-type": "application/json"}
    for raw, said in [
        *[(text.encode(encoding), f"it is encoded as {encoding.upper()}")
          for encoding in ("utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be")],
        (surrogate, f"invalid continuation byte at byte {at}"),
    ]:
        refused = problem(c.post(url, content=raw, headers=json_type), 422, "http.request_invalid")
        assert refused["detail"] == f"the request body is not UTF-8 JSON: {said}", refused
        assert refused["hint"] == "send one JSON object encoded as UTF-8"
        _unchanged(c, tree["tree_id"], version)
    # A body that is not JSON by its Content-Type is told so, whatever its bytes.
    refused = problem(c.post(url, content=text.encode("utf-16"), headers={"content-type": "text/plain"}), 422,
                      "http.request_invalid")
    assert refused["detail"] == "the request body was not read as JSON: its Content-Type is 'text/plain'", refused
    _unchanged(c, tree["tree_id"], version)
    # UTF-8 after a byte order mark is UTF-8: the mark is ignored (RFC 8259 allows it).
    answered = ok(c.post(url, content=codecs.BOM_UTF8 + text.encode(), headers=json_type))
    assert (answered["accepted"], answered["signal_id"]) == (True, "encoded"), answered


def test_a_body_nested_beyond_the_parser_is_a_request_problem(api: ApiServer) -> None:
    c = api.client()
    deep = b'{"scenario": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    refused = problem(c.post("/runs", content=deep, headers={"content-type": "application/json"}), 422,
                      "http.request_invalid")
    assert "could not be read" in refused["detail"]


def test_members_of_the_wrong_json_type_are_refused_not_converted(api: ApiServer) -> None:
    # pydantic's lax mode read "wait": "5" as five seconds and "wait": true as one.
    c = api.client()
    tree, version, url = waiting_for_an_answer(c, "strict-types")
    for body, member in (
        ({"response": {"approved": True}, "wait": "5"}, "wait"),
        ({"response": {"approved": True}, "wait": True}, "wait"),
        ({"response": {"approved": True}, "signal_id": 7}, "signal_id"),
    ):
        refused = problem(_post(c, url, body), 422, "http.request_invalid")
        assert [member] in [e["location"][-1:] for e in refused["errors"]], refused
        _unchanged(c, tree["tree_id"], version)
    for body in ({"scenario": HELLO, "wait": "1"}, {"scenario": HELLO, "start_id": 12}):
        problem(_post(c, "/runs", body), 422, "http.request_invalid")
    assert not [r for r in ok(c.get("/runs"))["runs"] if r["start_id"] == "12"]
    # An integer is a number of seconds.
    ok(_post(c, url, {"response": {"approved": True}, "wait": 5}))
    assert run(c, tree["tree_id"])["version"] > version


def test_a_body_with_a_key_twice_is_refused_and_appends_nothing(api: ApiServer) -> None:
    # The JSON parser kept the last one: {"response": ..., "response": ...} answered with the
    # second, and a scenario with two "tools" members ran with the second tool set only.
    c = api.client()
    tree, version, url = waiting_for_an_answer(c, "twice")
    for text, where in (
        (b'{"response": {"approved": false}, "response": {"approved": true}}', "$ has the key 'response'"),
        (b'{"response": {"approved": true, "approved": false}}', "$.response has the key 'approved'"),
    ):
        refused = problem(c.post(url, content=text, headers={"content-type": "application/json"}), 422,
                          "http.request_invalid")
        assert where in refused["detail"], refused
        _unchanged(c, tree["tree_id"], version)
    doubled = json.dumps({"scenario": HELLO, "start_id": sid("twice-start")})[:-1] + ', "start_id": "other"}'
    refused = problem(c.post("/runs", content=doubled.encode(), headers={"content-type": "application/json"}), 422,
                      "http.request_invalid")
    assert "'start_id' twice" in refused["detail"]
    assert not [r for r in ok(c.get("/runs"))["runs"] if r["start_id"] in (sid("twice-start"), "other")]
    # The token is checked first: a stranger learns nothing about the body.
    problem(httpx.post(api.url + url, content=b'{"a": 1, "a": 2}', headers={"content-type": "application/json"}),
            401, "http.unauthorized")


def test_an_empty_or_oversize_reason_is_refused_even_when_the_control_would_change_nothing(api: ApiServer) -> None:
    # An audit found {"reason": ""} recorded as "paused by host" (the docs say it is refused),
    # and an oversize reason accepted (recorded: false) when the process was already paused.
    c = api.client()
    tree, _ = parked_approval(c, "reasons")
    root = tree["root_process_id"]
    version = run(c, tree["tree_id"])["version"]
    for control in ("pause", "cancel"):
        for reason in ("", "  "):
            refused = problem(c.post(f"/processes/{root}/{control}", json={"reason": reason}), 422, "control.invalid")
            assert "non-empty" in refused["detail"], refused
    _unchanged(c, tree["tree_id"], version)
    assert ok(c.post(f"/processes/{root}/pause", json={"reason": "review"}))["recorded"] is True
    paused = run(c, tree["tree_id"])["version"]
    assert ok(c.post(f"/processes/{root}/pause", json={"reason": "again"}))["recorded"] is False
    problem(c.post(f"/processes/{root}/pause", json={"reason": "x" * 5000}), 422, "control.invalid")
    _unchanged(c, tree["tree_id"], paused)


def test_a_body_that_is_not_json_says_what_and_where(api: ApiServer) -> None:
    # It said "body.1: JSON decode error".
    c = api.client()
    refused = problem(c.post("/runs", content=b'{"scenario": {bad', headers={"content-type": "application/json"}),
                      422, "http.request_invalid")
    assert refused["detail"].startswith("the request body is not valid JSON: "), refused
    assert "at character 14" in refused["detail"], refused


def test_a_request_without_the_token_is_refused_before_its_body_is_read(api: ApiServer) -> None:
    # The token used to be checked only after FastAPI had received and parsed the body: a
    # stranger could make the server hold and parse 16 MiB bodies (~280 MB each, the event
    # loop blocked meanwhile), and learned that a body was not JSON (422) before the 401.
    host, port = api.url.removeprefix("http://").rsplit(":", 1)
    for authorization in (b"", b"Authorization: Bearer not-the-token\r\n"):
        with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as conn:
            # A large body is announced and never sent: only the headers can answer this.
            conn.sendall(b"POST /runs HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 16000000\r\n" + authorization + b"\r\n{")
            conn.settimeout(5)
            head = conn.recv(65536).split(b"\r\n", 1)[0]
        assert head.startswith(b"HTTP/1.1 401"), head
    for body in (b"not json", b"[" * 5000 + b"]" * 5000):
        for headers in ({}, {"authorization": "Bearer not-the-token"}):
            problem(httpx.post(api.url + "/runs", content=body, headers={"content-type": "application/json", **headers}),
                    401, "http.unauthorized")
    # /health stays open, and the token still opens everything else.
    assert httpx.get(api.url + "/health", timeout=10).status_code == 200
    problem(api.client().post("/runs", content=b"not json", headers={"content-type": "application/json"}), 422,
            "http.request_invalid")


def test_a_cursor_with_digits_that_are_not_ascii_is_refused_not_a_500(api: ApiServer) -> None:
    # str.isdigit() accepts '²' (then int() raised: 500 with a traceback in the log) and the
    # Arabic-Indic '٣' (taken as cursor 3): neither is a cursor this API returned.
    c = api.client()
    for after in ("m²", "f¹¹", "m٣"):
        problem(c.get("/runs", params={"after": after}), 422, "http.cursor_invalid")
    ok(c.get("/runs", params={"after": "m3"}))


def test_a_min_position_beyond_any_store_position_is_refused_not_a_500(api: ApiServer) -> None:
    # Found by generated requests: 2**63 reached SQLite as a parameter (OverflowError, 500).
    c = api.client()
    for url in ("/runs", "/pending-inputs", "/unknown-effects"):
        refused = problem(c.get(url, params={"min_position": 1 << 63, "wait": 0}), 422, "http.request_invalid")
        assert "min_position" in refused["detail"], refused
    # The largest position is a valid question (not reached yet: answered by folding at once).
    ok(c.get("/runs", params={"min_position": (1 << 63) - 1, "wait": 0}))


def test_a_path_with_a_trailing_slash_is_not_found_not_redirected_to_plain_http(api: ApiServer) -> None:
    c = api.client()
    for method, url in (("GET", "/runs/"), ("POST", "/runs/"), ("GET", "/unknown-effects/")):
        answered = c.request(method, url, json={} if method == "POST" else None)
        problem(answered, 404, "http.not_found")
        assert "location" not in answered.headers


def test_a_scenario_may_log_side_effects_only_inside_the_servers_side_effect_dir(tmp_path: Path) -> None:
    # A client's scenario named any file the server could append to (its tools write one JSON
    # line per call there, with arguments the client chose): a write primitive on the machine.
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    outside = tmp_path / "victim.txt"
    server = start_server(f"sqlite:///{tmp_path / 'agentfold.db'}", tmp_path, "--side-effect-dir", str(allowed))
    try:
        c = server.client()
        for log, sid_ in ((str(outside), "out-abs"), ("../victim.txt", "out-rel")):
            refused = problem(c.post("/runs", json={"scenario": one_tool_call(Path(log)), "start_id": sid(sid_)}),
                              422, "scenario.invalid")
            assert "outside this server's --side-effect-dir" in refused["detail"], refused
        # The same door through the bound kernel demo Program, whose input names its log.
        order = {"customer": "ada", "amount_cents": 100, "side_effect_log": str(outside)}
        refused = problem(c.post("/runs", json={"program": "demo.payment", "input": order}), 422,
                          "engine.start.input_invalid")
        assert "outside this server's --side-effect-dir" in refused["detail"], refused
        assert not outside.exists()
        ok(c.post("/runs", json={"scenario": one_tool_call(Path("calls.jsonl")), "start_id": sid("inside"),
                                 "wait": 10}), 201)
        assert (allowed / "calls.jsonl").read_text().count("\n") == 1  # relative: inside the folder
        ok(c.post("/runs", json={"program": "demo.payment", "input": {**order, "side_effect_log": "pay.jsonl"},
                                 "wait": 10}), 201)
        assert (allowed / "pay.jsonl").exists()
    finally:
        server.stop()
    # Without the option, no scenario may name a log at all.
    bare = start_server(f"sqlite:///{tmp_path / 'other.db'}", tmp_path, side_effects=False)
    try:
        refused = problem(bare.client().post("/runs", json={"scenario": one_tool_call(allowed / "x.jsonl")}),
                          422, "scenario.invalid")
        assert "started without --side-effect-dir" in refused["detail"], refused
        ok(bare.client().post("/runs", json={"scenario": HELLO, "start_id": sid("no-log")}), 201)
    finally:
        bare.stop()
    assert not (allowed / "x.jsonl").exists()

"""``agentfold serve`` as a process: refusals at startup, ``--recover``, ``--no-follow``,
runs the server does not own, and the committed OpenAPI document (SQLite store)."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentfold.adapters.http_api import openapi_text
from tests.http_api.support import (
    ROOT,
    TOKEN,
    ApiServer,
    ok,
    problem,
    serve_command,
    server_env,
    start_server,
    wait_until,
)
from tests.test_cli import agentfold
from tests.test_cli_interaction import FINAL, approval, logged_calls, two_call_round, write


def serve_once(store: str, *args: str, token: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(serve_command(store, *args), capture_output=True, text=True, cwd=ROOT,
                          env=server_env(token), timeout=60)


@pytest.mark.parametrize("token", [None, "", "   "])
def test_serve_refuses_to_start_without_a_token(tmp_path: Path, token: str | None) -> None:
    store = tmp_path / "agentfold.db"
    ran = serve_once(f"sqlite:///{store}", token=token)
    assert ran.returncode == 2, ran.stderr
    assert ran.stdout == ""
    [line] = ran.stderr.strip().splitlines()
    assert json.loads(line)["error"]["code"] == "http.token_missing"
    assert not store.exists()  # refused before anything was opened


def test_serve_reports_a_port_it_cannot_listen_on(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        ran = subprocess.run(
            [*serve_command(f"sqlite:///{tmp_path / 'a.db'}")[:-3], "--port", str(port), "--json"],
            capture_output=True, text=True, cwd=ROOT, env=server_env(), timeout=60,
        )
    assert ran.returncode == 1, ran.stderr
    assert json.loads(ran.stderr.strip().splitlines()[-1])["error"]["code"] == "http.listen_failed"


def test_the_committed_openapi_document_is_what_scripts_openapi_writes() -> None:
    assert (ROOT / "docs" / "openapi.json").read_text() == openapi_text(), "run scripts/openapi"


# ---------------------------------------------------------------------------
# A run left behind by a crashed process, adopted with --recover; reads fold (--no-follow)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiServer, Path, dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("serve")
    store = f"sqlite:///{folder / 'agentfold.db'}"
    log = folder / "side-effects.jsonl"
    scenario = write(folder, two_call_round(log, final=FINAL))
    died = agentfold("run", str(scenario), "--start-id", "crash-1", "--crash-after", "dispatched:2", "--json",
                     store=store)
    assert died.code == 75, died.stderr
    server = start_server(store, folder, "--recover", "--no-follow")
    try:
        yield server, folder, server.started
    finally:
        code, last = server.stop()
    assert code == 0, server.logs()
    assert json.loads(last) == {"stopped": True, "signal": 15, "abandoned_dispatches": 0}


def test_recover_adopts_the_crashed_run_and_its_unknown_effect_is_resolved_to_completion(
    crashed: tuple[ApiServer, Path, dict[str, Any]],
) -> None:
    server, folder, started = crashed
    c = server.client()
    tree = ok(c.get("/runs/crash-1"))
    assert started["recovered"] == [{"tree_id": tree["tree_id"], "outcome": "adopted"}]
    [alpha] = ok(c.get("/unknown-effects"))["unknown_effects"]
    assert (alpha["tree_id"], alpha["kind"], alpha["tool_call_ref"]) == (tree["tree_id"], "tool",
                                                                          f"{tree['root_process_id']}/1/0")
    assert alpha["diagnostic"]["code"] == "engine.dispatch.interrupted"
    assert logged_calls(folder / "side-effects.jsonl") == []  # the crash came before the call
    done = ok(c.post(f"/unknown-effects/{alpha['effect_id']}/resolve",
                     json={"output": "alpha (confirmed by the host)", "wait": 30}))
    assert (done["driven"], done["tree"]["status"]) == (True, "completed")
    assert logged_calls(folder / "side-effects.jsonl") == ["call_b"]  # alpha was never called again


def test_without_a_follower_reads_fold_and_health_says_so(crashed: tuple[ApiServer, Path, dict[str, Any]]) -> None:
    server, _, started = crashed
    health = ok(httpx.get(server.url + "/health"))
    assert (health["follower"], health["positions"]["read_models"]) == ("off", None)
    assert started["follower"] is False
    # Without --host it listens on 127.0.0.1 only (docs/http-api.md), and says so (a mutation
    # audit: a server bound to every interface by default went unnoticed).
    assert started["listening"] == f"http://127.0.0.1:{started['port']}" == server.url
    c = server.client()
    runs = ok(c.get("/runs", params={"limit": 1}))
    assert runs["runs"][0]["start_id"] == "crash-1"
    assert runs["runs"][0]["cursor"].startswith("f")  # a page of the folding path
    assert ok(c.get("/runs", params={"after": runs["next_after"]}))["runs"] == [
        r for r in ok(c.get("/runs"))["runs"][1:]]


def test_answers_racing_on_a_run_the_server_does_not_own_one_adopts_and_wins(
    crashed: tuple[ApiServer, Path, dict[str, Any]],
) -> None:
    server, folder, _ = crashed
    # Started and parked by another process (the CLI), which released it when it exited.
    scenario = write(folder, approval(None), "approval.json")
    parked = agentfold("run", str(scenario), "--start-id", "cli-approval", "--json", store=server.store)
    assert parked.code == 0, parked.stderr
    c = server.client()
    [wait] = [p for p in ok(c.get("/pending-inputs"))["pending"] if p["tree_id"] == parked.json()["tree_id"]]
    url = f"/processes/{wait['process_id']}/waits/{wait['wait_id']}/answer"
    barrier = threading.Barrier(3)
    replies: dict[str, httpx.Response] = {}

    def post(signal_id: str) -> None:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as own:
            barrier.wait()
            replies[signal_id] = own.post(url, json={"response": {"approved": signal_id == "a"}, "signal_id": signal_id})

    threads = [threading.Thread(target=post, args=(s,)) for s in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [s for s, r in replies.items() if r.status_code == 200]
    assert len(winners) == 1, {s: r.text for s, r in replies.items()}
    for signal_id, reply in replies.items():
        if signal_id in winners:
            continue
        refused = problem(reply, 409, "engine.signal.rejected")
        assert refused["wait"]["state"] == "answered" and refused["wait"]["answered_by"] == winners[0]
    [winner] = winners
    run = wait_until(lambda: (r := ok(c.get(f"/runs/{wait['tree_id']}")))["status"] == "completed" and r)
    assert run["output"]["model_calls"] == 2
    answer = ok(c.post(url, json={"response": {"approved": winner == "a"}, "signal_id": winner}))
    assert answer["accepted"] is False  # the winning answer, resent: a harmless no-op


def test_request_bodies_above_the_limit_are_refused_with_413_declared_or_streamed(
    crashed: tuple[ApiServer, Path, dict[str, Any]],
) -> None:
    from agentfold.adapters.http_api import MAX_BODY_BYTES

    server, _, _ = crashed
    c = server.client()
    before = ok(httpx.get(server.url + "/health"))["positions"]["store"]
    declared = c.post("/runs", content=b" " * (MAX_BODY_BYTES + 1), headers={"content-type": "application/json"})
    problem(declared, 413, "payload.too_large")

    def chunks() -> Iterator[bytes]:
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 2):
            yield b" " * (1 << 20)

    streamed = c.post("/runs", content=chunks(), headers={"content-type": "application/json"})
    problem(streamed, 413, "payload.too_large")
    assert ok(httpx.get(server.url + "/health"))["positions"]["store"] == before


def test_the_start_line_counts_recovered_runs_by_outcome() -> None:
    """``serve --recover``'s text start line once said "8 live run(s) adopted" for 1 adopted
    run and 7 parked ones left as they are (the --json line lists each run's outcome)."""
    from agentfold.adapters.cli_serve import recovered_text

    entries = [{"tree_id": f"tree:{i:032x}", "outcome": "parked"} for i in range(7)]
    entries.append({"tree_id": "tree:" + "f" * 32, "outcome": "adopted"})
    assert recovered_text(entries) == ", 1 live run(s) adopted, 7 live run(s) parked and left as they are"
    assert recovered_text([{"tree_id": "tree:" + "0" * 32, "outcome": "skipped"}]) == ", 1 live run(s) skipped"
    assert recovered_text([]) == ""

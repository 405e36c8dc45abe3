"""CLI commands on runs a live server owns, and the CLI's pause and resume (docs/cli.md).

An audit found that ``answer``, ``steer`` and ``cancel`` on a run another runtime owns did not
say so (``resolve`` did): the operator could not tell whether anything would move the run on.
They now answer ``driven`` (false: the owner drives it on) and say it in text. It also found no
CLI ``pause``/``resume``: a paused run could not be resumed without the HTTP API.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.http_api.support import ApiServer, ok, start_server, wait_until
from tests.http_api.test_api import parked_approval
from tests.test_cli import agentfold, refused, sqlite_url
from tests.test_cli import ok as cli_ok
from tests.test_cli_interaction import approval, write

OWNED_NOTE = "(another runtime owns this tree and drives it on)"


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[ApiServer]:
    server = start_server(sqlite_url(tmp_path), tmp_path)
    try:
        yield server
    finally:
        code, _ = server.stop()
        assert code == 0, server.logs()


def test_input_from_the_cli_to_a_run_the_server_owns_says_the_server_drives_it(server: ApiServer) -> None:
    c = server.client()
    tree, wait = parked_approval(c, "owned")
    root = tree["root_process_id"]
    steered = cli_ok(agentfold("steer", root, "keep it short", "--json", store=server.store)).json()
    assert (steered["accepted"], steered["driven"]) == (True, False)
    answered = agentfold("answer", wait["process_id"], wait["wait_id"], '{"approved": true}', store=server.store)
    assert answered.code == 0, answered.stderr
    # The note names the owner while the run has something left to do (the server may have
    # ended it already while the command waited a moment for a lease holder passing through).
    ended = "tree terminal" in answered.stdout
    assert answered.stdout.strip().endswith(OWNED_NOTE) != ended, answered.stdout
    # The server, the owner, drives the run to its end.
    wait_until(lambda: ok(c.get(f"/runs/{tree['tree_id']}"))["status"] == "completed", timeout=30)


def test_cancel_from_the_cli_on_a_run_the_server_owns_says_so(server: ApiServer) -> None:
    c = server.client()
    tree, _ = parked_approval(c, "owned-cancel")
    canceled = cli_ok(agentfold("cancel", tree["root_process_id"], "--json", store=server.store)).json()
    assert (canceled["recorded"], canceled["driven"]) == (True, False)
    wait_until(lambda: ok(c.get(f"/runs/{tree['tree_id']}"))["status"] == "canceled", timeout=30)


def test_pause_and_resume_from_the_cli(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    ran = agentfold("run", str(write(tmp_path, approval(None))), "--start-id", "p-1", "--json", store=store)
    assert ran.code == 0, ran.stderr
    root = ran.json()["root_process_id"]

    paused = cli_ok(agentfold("pause", root, "--reason", "operator review", "--json", store=store)).json()
    assert (paused["recorded"], paused["driven"], paused["tree"]["status"]) == (True, True, "paused")
    shown = cli_ok(agentfold("show", "p-1", "--json", store=store)).json()["processes"][0]
    assert (shown["status"], shown["pause_reason"]) == ("paused", "operator review")
    again = cli_ok(agentfold("pause", root, store=store))
    assert again.stdout.startswith("already paused\n"), again.stdout

    assert refused(agentfold("pause", root, "--reason", "", "--json", store=store)).error()["code"] == "control.invalid"
    resumed = cli_ok(agentfold("resume", root, "--json", store=store)).json()
    assert (resumed["recorded"], resumed["tree"]["status"]) == (True, "waiting")
    not_paused = refused(agentfold("resume", root, "--json", store=store)).error()
    assert not_paused["code"] == "engine.process.control_invalid", not_paused
    assert "not paused" in not_paused["message"]
    assert json.loads(agentfold("show", "p-1", "--json", store=store).stdout)["processes"][0]["status"] == "waiting"

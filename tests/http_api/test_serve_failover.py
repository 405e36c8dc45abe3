"""Two ``agentfold serve`` processes on one store: when one dies, the other drives its runs.

Before, a running server left a dead peer's runs alone (``progress`` with no owner until
someone ran ``agentfold recover``). Now each server scans for live runs nobody owns every
``--adopt-every`` seconds and adopts them as ``recover`` would: a tool call that was under
way when its server died is recorded unknown, never called again, and the run completes
once the host resolves it. A live peer's runs (its lease held) are never taken.

Real processes, real SIGKILL, a tool really blocked (it opens a FIFO nobody reads).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.domain.events import WriterActivated
from agentfold.domain.ids import TreeID
from tests.http_api.conftest import _pg_database
from tests.http_api.support import ROOT, TOKEN, ApiServer, ok, start_server, wait_until
from tests.http_api.test_serve import serve_once
from tests.http_api.test_serve_failures import FifoReader, blocked_in_the_tool
from tests.test_cli import agentfold
from tests.test_cli_interaction import approval, one_tool_call
from tests.test_shutdown_during_outage import _read_fifo

SCAN = "0.5"  # seconds between the servers' scans for runs nobody owns


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'agentfold.db'}"
        return
    databases = _pg_database()
    try:
        yield next(databases)
    finally:
        databases.close()


def activations(store: str, tree_id: str) -> int:
    """How many owners the run's history has had (its WriterActivated events)."""
    events = EventStore(store, create=False)
    try:
        return sum(isinstance(r.event, WriterActivated) for r in events.read(TreeID(tree_id)))
    finally:
        events.close()


def kill(server: ApiServer) -> None:
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(10)
    for client in server.clients:
        client.close()


def test_a_server_drives_the_run_of_a_peer_that_died_without_calling_its_tool_again(
    store: str, tmp_path: Path,
) -> None:
    fifo = tmp_path / "pay.fifo"
    os.mkfifo(fifo)
    first = start_server(store, tmp_path, "--adopt-every", SCAN)
    second = start_server(store, tmp_path, "--adopt-every", SCAN)
    reader: FifoReader | None = None
    try:
        assert second.started["adopt_every"] == float(SCAN)
        run = ok(first.client().post("/runs", json={"scenario": one_tool_call(fifo), "start_id": "pay-1", "wait": 0}),
                 201)
        tree_id = run["tree"]["tree_id"]
        wait_until(lambda: blocked_in_the_tool(first.proc.pid), timeout=30)

        # While its owner lives, the other server leaves the run alone, scan after scan.
        time.sleep(6 * float(SCAN))
        assert activations(store, tree_id) == 0
        assert ok(httpx.get(second.url + "/health"))["orphans_adopted"] == 0
        assert not blocked_in_the_tool(second.proc.pid)

        kill(first)  # the tool call it made is never answered

        c = second.client()
        unknown = wait_until(lambda: ok(c.get("/unknown-effects"))["unknown_effects"], timeout=30)
        assert [(u["tree_id"], u["kind"], u["diagnostic"]["code"]) for u in unknown] == [
            (tree_id, "tool", "engine.dispatch.interrupted")]
        assert activations(store, tree_id) == 1
        assert ok(httpx.get(second.url + "/health"))["orphans_adopted"] == 1
        assert "adopted (its owner is gone" in second.logs()

        # Had the survivor called the tool again, the call would write here.
        reader = FifoReader(fifo)
        reader.start()
        done = ok(c.post(f"/unknown-effects/{unknown[0]['effect_id']}/resolve",
                         json={"output": "paid (confirmed by the host)", "wait": 30}))
        assert (done["driven"], done["tree"]["status"]) == (True, "completed")
        time.sleep(1.0)
        assert reader.records == []
        assert activations(store, tree_id) == 1  # adopted once, by one survivor
    finally:
        if reader is not None:
            reader.stop()
        if first.proc.poll() is None:
            kill(first)
        code, _ = second.stop()
    assert code == 0, second.logs()


def test_with_adopt_every_0_a_dead_peers_run_waits_for_recover(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    fifo = tmp_path / "pay.fifo"
    os.mkfifo(fifo)
    first = start_server(store, tmp_path)
    second = start_server(store, tmp_path, "--adopt-every", "0")
    try:
        assert second.started["adopt_every"] == 0
        run = ok(first.client().post("/runs", json={"scenario": one_tool_call(fifo), "start_id": "pay-2", "wait": 0}),
                 201)
        wait_until(lambda: blocked_in_the_tool(first.proc.pid), timeout=30)
        kill(first)
        time.sleep(3.0)
        c = second.client()
        assert ok(c.get(f"/runs/{run['tree']['tree_id']}"))["classification"] == "progress"
        assert ok(c.get("/unknown-effects"))["unknown_effects"] == []
        assert activations(store, run["tree"]["tree_id"]) == 0
    finally:
        if first.proc.poll() is None:
            kill(first)
        code, _ = second.stop()
    assert code == 0, second.logs()


def test_serve_refuses_a_negative_or_non_finite_adopt_every(tmp_path: Path) -> None:
    # 1e300 was taken and the runtime refused it later in its own words (adopt_orphans_every)
    for value in ("-1", "nan", "inf", "1e300"):
        ran = serve_once(f"sqlite:///{tmp_path / 'a.db'}", "--adopt-every", value, token=TOKEN)
        assert ran.returncode == 2, ran.stderr
        assert '"cli.argument_invalid"' in ran.stderr and "--adopt-every" in ran.stderr
    assert not (tmp_path / "a.db").exists()


def test_sigterm_records_the_tool_call_that_returns_during_the_stop_and_starts_no_new_call(tmp_path: Path) -> None:
    # A rolling restart: before, every call under way at SIGTERM was abandoned and recovered
    # unknown (a host had to find out what happened), even one that returned at once.
    store = f"sqlite:///{tmp_path / 'agentfold.db'}"
    fifo = tmp_path / "pay.fifo"
    os.mkfifo(fifo)
    server = start_server(store, tmp_path)
    run = ok(server.client().post("/runs", json={"scenario": one_tool_call(fifo), "start_id": "pay-3", "wait": 0}),
             201)
    wait_until(lambda: blocked_in_the_tool(server.proc.pid), timeout=30)
    server.proc.send_signal(signal.SIGTERM)

    def closed() -> bool:  # the server has taken the signal: it stopped listening
        try:
            httpx.get(server.url + "/health", timeout=2)
        except httpx.TransportError:
            return True
        return False

    wait_until(closed, timeout=30)
    # The tool returns 1 s into the stop: inside the calls' 2 s (CALLS_GRACE), after the
    # requests ended (a mutation audit: draining with no grace left it unknown, undetected).
    time.sleep(1.0)
    calls = _read_fifo(fifo)  # now the tool returns, while the server stops
    code, last = server.stop()
    assert code == 0, server.logs()
    assert json.loads(last) == {"stopped": True, "signal": 15, "abandoned_dispatches": 0}
    assert calls == [1]
    unknown = json.loads(agentfold("unknown", "--json", store=store).stdout)["unknown_effects"]
    assert unknown == []  # the tool call's outcome was recorded
    # The final model call was declared during the stop and not started: the next owner makes it.
    [tree] = json.loads(agentfold("recover", "--json", store=store).stdout)["trees"]
    assert (tree["tree_id"], tree["status"]) == (run["tree"]["tree_id"], "completed")
    time.sleep(0.5)
    assert calls == [1]


def test_a_run_whose_owner_line_here_stopped_on_a_store_failure_is_still_adopted_once_orphaned(
    tmp_path: Path,
) -> None:
    # Found by review: one passing append failure left the run refused by this server's scan for
    # good, so once a later owner (a command) died the run stayed `progress` with nobody driving it.
    import sqlite3

    db = tmp_path / "agentfold.db"
    store = f"sqlite:///{db}"
    fifo = tmp_path / "approve.fifo"
    os.mkfifo(fifo)
    server = start_server(store, tmp_path, "--adopt-every", SCAN)
    try:
        c = server.client()
        reader = FifoReader(fifo)
        reader.start()  # the tool's first execution (it asks a human) gets through
        run = ok(c.post("/runs", json={"scenario": approval(fifo), "start_id": "t", "wait": 30}), 201)
        tree_id = run["tree"]["tree_id"]
        [wait] = ok(c.get("/pending-inputs"))["pending"]
        reader.stop()  # from now on the tool blocks in open()
        gate = sqlite3.connect(str(db), isolation_level=None, timeout=30)
        gate.execute("BEGIN IMMEDIATE")  # held past the server's lock wait: its next append fails
        answer = {"response": {"approved": True}, "signal_id": "a1"}
        refused = c.post(f"/processes/{wait['process_id']}/waits/{wait['wait_id']}/answer", json=answer)
        gate.execute("ROLLBACK")
        gate.close()
        assert refused.status_code == 503, refused.text
        # A command answers the run (it adopts it) and is killed while the tool call is under way.
        env = {k: v for k, v in os.environ.items() if k != "AGENTFOLD_STORE"}
        env["PYTHONPATH"] = str(ROOT)
        command = subprocess.Popen(
            [sys.executable, "-m", "agentfold.adapters.cli", "answer", wait["process_id"], wait["wait_id"],
             '{"approved": true}', "--signal-id", "a1", "--store", store],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: blocked_in_the_tool(command.pid), timeout=30)
        command.kill()
        command.communicate()
        unknown = wait_until(lambda: ok(c.get("/unknown-effects"))["unknown_effects"], timeout=30)
        assert [(u["tree_id"], u["diagnostic"]["code"]) for u in unknown] == [(tree_id, "engine.dispatch.interrupted")]
        assert ok(httpx.get(server.url + "/health"))["orphans_adopted"] == 1
    finally:
        code, _ = server.stop()
    assert code == 0, server.logs()

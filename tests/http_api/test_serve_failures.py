"""`agentfold serve` when things go wrong under it: a tool that never returns, a lost store session.

The tool's side-effect log is a FIFO nobody reads: the tool blocks inside ``open`` (its
thread shows ``wait_for_partner`` in /proc), i.e. a real dispatcher call in flight that
the test controls. Reading the FIFO later lets the call finish and shows how many times
the tool really ran.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.http_api.conftest import _pg_database
from tests.http_api.support import ApiServer, ok, start_server, wait_until
from tests.test_cli import agentfold
from tests.test_cli_interaction import FINAL, LEFT_TO_HOST, two_call_round


def blocked_in_the_tool(pid: int) -> bool:
    """Some thread of ``pid`` waits for a reader of a FIFO (the tool opening its log)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "wchan").read_text().strip() == "wait_for_partner":
                return True
        except OSError:
            continue
    return False


class FifoReader:
    """Reads everything written to the FIFO (each open by a writer is one tool call)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        data = b""
        try:
            while not self._stop:
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    chunk = b""
                if chunk:
                    data += chunk
                    *lines, data = data.split(b"\n")
                    self.records.extend(json.loads(line) for line in lines if line.strip())
                else:
                    time.sleep(0.02)
        finally:
            os.close(fd)

    def stop(self) -> None:
        self._stop = True
        self._thread.join(5)


def in_flight_run(server: ApiServer, folder: Path, start_id: str) -> dict[str, Any]:
    fifo = folder / f"{start_id}.fifo"
    os.mkfifo(fifo)
    c = server.client()
    data = ok(c.post("/runs", json={"scenario": two_call_round(fifo, final=FINAL), "start_id": start_id, "wait": 0}),
              201)
    wait_until(lambda: blocked_in_the_tool(server.proc.pid), timeout=30)
    return {"fifo": fifo, "tree": data["tree"]}


@pytest.fixture()
def sqlite_server(tmp_path: Path) -> Iterator[ApiServer]:
    server = start_server(f"sqlite:///{tmp_path / 'agentfold.db'}", tmp_path)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)


def test_sigterm_with_a_tool_call_in_flight_exits_and_recovery_decides_the_call(
    sqlite_server: ApiServer, tmp_path: Path,
) -> None:
    server = sqlite_server
    run = in_flight_run(server, tmp_path, "stuck-1")
    started = time.monotonic()
    code, last = server.stop()  # SIGTERM; fails the test if the process is still alive after 30 s
    assert time.monotonic() - started < 20
    assert code == 0, server.logs()
    assert json.loads(last) == {"stopped": True, "signal": 15, "abandoned_dispatches": 1}
    assert "abandoning 1 dispatcher call(s) still running" in server.logs()

    # The call was made but never answered: recovery records it as unknown, calling nothing.
    store = server.store
    recovered = agentfold("recover", "--json", store=store)
    assert recovered.code == 0, recovered.stderr
    unknown = json.loads(agentfold("unknown", "--json", store=store).stdout)["unknown_effects"]
    assert [(u["tree_id"], u["kind"]) for u in unknown] == [(run["tree"]["tree_id"], "tool")]
    reader = FifoReader(run["fifo"])
    reader.start()
    time.sleep(0.5)
    reader.stop()
    assert reader.records == []  # nobody calls the tool again


def _lease_backend(admin: str, database: str) -> int | None:
    with psycopg.connect(admin, autocommit=True) as conn:
        row = conn.execute(
            "SELECT l.pid FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
            "WHERE l.locktype = 'advisory' AND l.granted AND d.datname = %s LIMIT 1",
            (database,),
        ).fetchone()
    return int(row[0]) if row else None


def test_a_lost_lease_session_stops_the_owner_which_adopts_the_tree_again_and_keeps_serving(tmp_path: Path) -> None:
    databases = _pg_database()
    store = next(databases)
    admin = os.environ["AGENTFOLD_TEST_PG"]
    database = store.rsplit("/", 1)[1]
    server = start_server(store, tmp_path, "--no-follow")
    reader: FifoReader | None = None
    try:
        # Besides the run in flight, one that finished and one parked with nothing in flight:
        # the owner must adopt again only the run that needs driving.
        c = server.client()
        done = ok(c.post("/runs", json={"scenario": two_call_round(None, final=FINAL), "start_id": "lease-done",
                                        "wait": 30}), 201)["tree"]
        parked = ok(c.post("/runs", json={"scenario": two_call_round(None, beta={"error": "down"}, final=LEFT_TO_HOST),
                                          "start_id": "lease-parked", "wait": 30}), 201)["tree"]
        assert (done["classification"], parked["classification"]) == ("terminal", "parked"), (done, parked)
        left_alone = {t["tree_id"]: ok(c.get(f"/runs/{t['tree_id']}"))["version"] for t in (done, parked)}
        run = in_flight_run(server, tmp_path, "lease-1")
        tree_id = run["tree"]["tree_id"]
        backend = _lease_backend(admin, database)
        assert backend is not None, "the server holds no advisory lock while its tool call is in flight"
        with psycopg.connect(admin, autocommit=True) as conn:
            assert conn.execute("SELECT pg_terminate_backend(%s)", (backend,)).fetchone() == (True,)

        # The owner notices within a few polls and stops driving the tree; once its new lease
        # session is up it adopts the tree again, as a recovery would: the call that was under
        # way becomes unknown (nothing is called again).
        wait_until(lambda: "owner lease lost" in server.logs(), timeout=10)
        wait_until(lambda: "adopted again after its owner lease was lost" in server.logs(), timeout=15)
        assert ok(httpx.get(server.url + "/health", timeout=5))["leases"] == "ok"
        [unknown] = [u for u in json.loads(agentfold("unknown", "--json", store=store).stdout)["unknown_effects"]
                     if u["tree_id"] == tree_id]
        assert unknown["kind"] == "tool"
        assert _lease_backend(admin, database) not in (None, backend)  # held again, by the new session
        # The finished and the parked run were left as they were: no new owner, no event.
        assert {t: ok(c.get(f"/runs/{t}"))["version"] for t in left_alone} == left_alone
        assert server.logs().count("adopted again after its owner lease was lost") == 1
        version = json.loads(agentfold("show", tree_id, "--json", store=store).stdout)["version"]

        # Another process has nothing to adopt: the server owns the tree again.
        recovered = agentfold("recover", "--json", store=store)
        assert recovered.code == 0, recovered.stderr
        assert json.loads(agentfold("show", tree_id, "--json", store=store).stdout)["version"] == version

        # The stuck call finally returns to the stopped owner line: nothing more is appended.
        reader = FifoReader(run["fifo"])
        reader.start()
        wait_until(lambda: len(reader.records) == 1, timeout=15)
        wait_until(lambda: not blocked_in_the_tool(server.proc.pid), timeout=15)
        time.sleep(1.0)
        assert json.loads(agentfold("show", tree_id, "--json", store=store).stdout)["version"] == version
        assert [r["call_id"] for r in reader.records] == ["call_a"]  # alpha ran once, beta never

        # The server drives the adopted tree: a host resolves alpha, beta runs (its side-effect log
        # is this FIFO), then the model's final answer completes the run.
        c = server.client()
        ok(c.post(f"/unknown-effects/{unknown['effect_id']}/resolve", json={"output": "A"}))
        wait_until(lambda: len(reader.records) == 2, timeout=15)
        assert [r["call_id"] for r in reader.records] == ["call_a", "call_b"]
        wait_until(lambda: ok(c.get(f"/runs/{tree_id}"))["status"] == "completed", timeout=30)
        assert ok(c.get(f"/runs/{tree_id}/unknown-effects"))["unknown_effects"] == []
        assert len(reader.records) == 2  # nothing ran twice

        # And it still takes new work.
        log = tmp_path / "second.jsonl"
        ok(c.post("/runs", json={"scenario": two_call_round(log, final=FINAL), "start_id": "lease-2", "wait": 30}),
           201)
        wait_until(lambda: ok(c.get("/runs/lease-2"))["status"] == "completed", timeout=30)
    finally:
        if reader is not None:
            reader.stop()
        code, _ = server.stop()
        databases.close()
    assert code == 0, server.logs()


def test_a_store_error_that_reaches_the_http_layer_is_a_503_problem() -> None:
    # Unit level: the handler table maps store exceptions (eventsourcing's and psycopg's)
    # to 503 store.unavailable instead of 500 http.internal.
    import anyio
    from eventsourcing.persistence import OperationalError

    from agentfold.adapters.http_api import create_app

    app = create_app(None)

    @app.get("/boom-es")
    def boom_es() -> None:
        raise OperationalError("server closed the connection unexpectedly")

    @app.get("/boom-pg")
    def boom_pg() -> None:
        raise psycopg.OperationalError("consuming input failed")

    async def call(path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path)

    for path in ("/boom-es", "/boom-pg"):
        response = anyio.run(call, path)
        assert response.status_code == 503, response.text
        assert response.json()["code"] == "store.unavailable"

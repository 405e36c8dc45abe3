"""A follower's PostgreSQL sessions through server restarts and outages (session 26).

Found by an operations review: after each `pg_ctl restart -m fast`, `project --follow` held
more pooled sessions (6, then 7, 9, 10, 11 ... up to its pool's maximum, 12): psycopg_pool's
``check()``, which the follower called after a lost session to get rid of the idle sessions
the restart had cut, grows the pool by one each time it is called, on top of replacing the
broken ones. And `serve`'s read-model follower thread did not let go of those cut sessions
at all: while the server stayed down, its log repeated the old "terminating connection due
to administrator command" instead of saying that no connection can be had.

Both tests run real processes (the console script, `agentfold serve`) against a PostgreSQL
server of their own, which they restart or stop with `pg_ctl`. The server's store holds
runs before `serve` starts: its pool then holds several idle sessions when PostgreSQL
stops (with an empty store, the runtime's own polling used up the cut ones before the
follower's next attempt, and the old code passed).
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import psycopg

from agentfold.adapters.read_models import APPLICATION
from tests.http_api.support import start_server
from tests.test_cli import ROOT
from tests.test_feed_reconnects import Command, _runs
from tests.test_shutdown_during_outage import OwnServer, _tracked, own_pg  # noqa: F401 - a fixture


class ConsoleCommand(Command):
    """The ``agentfold`` console script of this interpreter's environment, with more
    environment variables (``extra``); its stderr read line by line, as ``Command``."""

    def __init__(self, *args: str, extra: dict[str, str]) -> None:
        env = {k: v for k, v in os.environ.items() if k != "AGENTFOLD_STORE"}
        env.update(extra)
        script = Path(sys.executable).with_name("agentfold")
        argv = [str(script), *args] if script.exists() else [sys.executable, "-m", "agentfold.adapters.cli", *args]
        self.process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
        self._lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()


def _sessions(url: str, application: str) -> int:
    """The server's sessions opened with ``application_name`` (libpq's PGAPPNAME)."""
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                           (application,)).fetchone()
    assert row is not None
    return int(row[0])


def _settled_sessions(url: str, application: str, quiet: float = 1.5, limit: float = 15.0) -> int:
    """The count of ``_sessions`` once it has not changed for ``quiet`` seconds (the pool opens
    its sessions in the background, one after another)."""
    deadline = time.monotonic() + limit
    seen = _sessions(url, application)
    since = time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, f"the session count kept changing for {limit:g} s (last {seen})"
        time.sleep(0.1)
        now = _sessions(url, application)
        if now != seen:
            seen, since = now, time.monotonic()
    return seen


def test_project_follow_holds_no_more_sessions_after_each_server_restart(own_pg: OwnServer) -> None:  # noqa: F811
    url = own_pg.url
    application = "af-s26-" + uuid.uuid4().hex[:8]
    first = _runs(url, 2)
    follower = ConsoleCommand("--store", url, "project", "--follow", extra={"PGAPPNAME": application})
    counts: list[int] = []
    try:
        follower.wait_until(lambda: _tracked(url, APPLICATION) == first, 30, "the read models held the runs")
        before = _settled_sessions(url, application)
        assert before >= 2, before  # at least a pooled session and the LISTEN session
        for _ in range(3):
            own_pg._pg_ctl("-m", "fast", "-w", "-l", str(own_pg.dir / "server.log"), "restart")
            follower.expect("following failed", 15)
            follower.expect("following again from position", 30)
            counts.append(_settled_sessions(url, application))
        later = _runs(url, 1)
        follower.wait_until(lambda: _tracked(url, APPLICATION) == later, 30, "the run written after the restarts")
        status, out = follower.stop()
    finally:
        if follower.alive():
            follower.process.kill()
            follower.process.wait(10)
    assert status == 0, follower.stderr
    assert all(count <= before for count in counts), (before, counts, follower.stderr)
    # At least one failure per restart; a loaded machine may see two (its next attempt came
    # while the server was still starting: fresh-clone CI run121 counted 4).
    retried = re.search(r"\((\d+) store failure\(s\) retried\)", out)
    assert retried is not None and int(retried.group(1)) >= 3, out


def test_serve_follower_says_there_is_no_connection_while_postgresql_stays_down(
    own_pg: OwnServer, tmp_path: Path,  # noqa: F811 - the fixture
) -> None:
    first = _runs(own_pg.url, 2)
    server = start_server(own_pg.url, tmp_path, env={"AGENTFOLD_PG_POOL_WAIT": "1"})

    def failures() -> list[str]:
        return [line for line in server.logs().splitlines() if "read-model follower failed" in line]

    try:
        deadline = time.monotonic() + 20
        while _tracked(own_pg.url, APPLICATION) != first:  # its follower caught up
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.1)
        own_pg.stop()
        deadline = time.monotonic() + 25
        while len(failures()) < 4:
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.1)
        own_pg.start()
        deadline = time.monotonic() + 20
        while True:  # back by itself once PostgreSQL is
            try:
                health = httpx.get(server.url + "/health", timeout=5)
                if health.status_code == 200 and health.json()["follower"] == "running":
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.2)
    finally:
        status, _ = server.stop()
    assert status == 0, server.logs()
    # The first says how the session was lost; the next ones what is true then.
    for line in failures()[1:4]:
        assert "administrator command" not in line and "server closed the connection" not in line, server.logs()
        assert "no PostgreSQL connection within 1 s" in line and "down or unreachable" in line, server.logs()


def test_a_call_waiting_for_a_session_while_the_broken_ones_are_dropped_gets_a_new_one(pg_database: str) -> None:
    """``drop_broken_sessions`` takes the idle sessions out of the pool to test them; a call that
    asks for one meanwhile waits (and, the pool full, cannot grow it). When every idle one was
    broken, the pool must open a new one for that call instead of leaving it to wait out its
    whole timeout (``store.unavailable`` for a request of ``serve``). A one-session pool whose
    session the server ended (``pg_terminate_backend``), and a call that starts waiting while it
    is being tested."""
    from psycopg_pool import ConnectionPool

    from agentfold.adapters.eventstore import drop_broken_sessions

    pool = ConnectionPool(pg_database, min_size=1, max_size=1, open=True, kwargs={"autocommit": True})
    try:
        pool.wait(10)
        with pool.connection() as conn:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        with psycopg.connect(pg_database, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (row[0],))
        got: list[object] = []

        def call() -> None:
            try:
                with pool.connection(timeout=20) as conn:
                    got.append(conn.execute("SELECT 1").fetchone())
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                got.append(exc)

        waiter = threading.Thread(target=call)
        real_check = pool.check_connection

        def check_once_a_call_waits(conn: object) -> None:
            waiter.start()
            deadline = time.monotonic() + 10
            while not pool._waiting:  # the call found no idle session: it waits
                assert time.monotonic() < deadline, "the call did not wait"
                time.sleep(0.01)
            real_check(conn)

        pool.check_connection = check_once_a_call_waits  # type: ignore[method-assign]
        started = time.monotonic()
        assert drop_broken_sessions(pool) == 1
        waiter.join(15)
        assert got == [(1,)], got
        assert time.monotonic() - started < 10  # served by a new session, not at its timeout
    finally:
        pool.close()

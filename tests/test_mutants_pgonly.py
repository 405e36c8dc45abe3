"""PostgreSQL-only paths: the read-model follower's LISTEN/NOTIFY wait and the owner leases'
session health. Behaviours the mutation audit of those paths (2026-12-06, s16) found undefended:
each test here failed with a planted bug that the rest of the suite let pass.

Real components only: the throwaway PostgreSQL server, the ``agentfold`` console script in a
child process, real sessions ended with ``pg_terminate_backend`` or cut with iptables.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from agentfold.adapters import leases as leases_module
from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.read_models import ReadModels
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import Fenced
from agentfold.domain.requests import Settlement
from tests.conftest import require_postgres
from tests.kernel_programs import asker_program, chain_program
from tests.streams import expect_line, read_both
from tests.test_cli import ROOT, agentfold, ok
from tests.test_pg_silent_cut import packets_dropped, require_iptables

DEMO = str(ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json")


def _wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.05)


def _listen_sessions(url: str, application: str) -> list[int]:
    """The client ports of the sessions of ``application`` (PGAPPNAME) that LISTEN."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT client_port FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = %s AND query ILIKE 'LISTEN%%'", (application,),
        ).fetchall()
    return sorted(int(r[0]) for r in rows)


def _project_follow(url: str, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    child_env = {k: v for k, v in os.environ.items() if k != "AGENTFOLD_STORE"}
    child_env["PYTHONPATH"] = str(ROOT)
    child_env.update(env)
    return subprocess.Popen(
        [sys.executable, "-m", "agentfold.adapters.cli", "--store", url, "project", "--follow", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env,
    )


def _stop(follower: subprocess.Popen[str]) -> int:
    follower.send_signal(signal.SIGTERM)
    try:
        return follower.wait(timeout=30)
    except subprocess.TimeoutExpired:
        follower.kill()
        follower.wait(10)
        raise


# ---------------------------------------------------------------------------
# The read-model follower on PostgreSQL


def test_project_follow_still_catches_up_when_its_listen_session_is_silently_cut(pg_database: str) -> None:
    """docs/read-models.md: a PostgreSQL follower LISTENs and "re-checks every 10 x the poll
    interval as a safety net". When the network drops the LISTEN session's packets without a
    reset (a firewall that forgot the connection), no notification arrives and no error either:
    the re-check, on the store's pooled sessions, must still bring the read models up to date.
    Waiting for notifications only left them behind for good, with the follower looking alive."""
    require_iptables()
    url = pg_database
    ok(agentfold("run", DEMO, "--start-id", "before", store=url))
    application = f"pgonly-{uuid.uuid4().hex[:8]}"
    # --poll-interval 0.1: a re-check every second
    follower = _project_follow(url, "--poll-interval", "0.1", env={"PGAPPNAME": application})
    out, _err = read_both(follower)
    seen: list[str] = []
    store = EventStore(url, create=False)
    try:
        expect_line(out, "following", 30, seen)
        _wait_until(lambda: len(_listen_sessions(url, application)) == 1, 30, "the follower's LISTEN session")
        [port] = _listen_sessions(url, application)
        models = ReadModels(store, create=False)
        with packets_dropped(url, [port]):
            ok(agentfold("run", DEMO, "--start-id", "after", store=url))
            position = store.max_notification_id()
            assert models.wait_for(position, timeout=10), (
                f"read models stuck at {models.position()} of {position} while the LISTEN session was cut"
            )
            assert {r["start_id"] for r in models.runs()} >= {"before", "after"}
    finally:
        store.close()
        code = _stop(follower)
    assert code == 0, seen


def test_project_follow_on_postgresql_exits_at_once_on_sigterm_while_it_listens(pg_database: str) -> None:
    """A PostgreSQL follower waits for a notification between batches, up to 10 x the poll
    interval (here 1000 s). SIGTERM must end that wait within a moment, in normal operation:
    the command exits 0 with its report, without the interruption that StopGuard keeps for
    calls stuck on a server that does not answer (`still busy ... interrupting`, 5 s later)."""
    url = pg_database
    EventStore(url).close()  # an empty store (`project` refuses a database without one)
    application = f"pgonly-{uuid.uuid4().hex[:8]}"
    follower = _project_follow(url, "--poll-interval", "100", env={"PGAPPNAME": application})
    out, err = read_both(follower)
    seen: list[str] = []
    try:
        expect_line(out, "following", 30, seen)
        _wait_until(lambda: len(_listen_sessions(url, application)) == 1, 30, "the follower's LISTEN session")
        time.sleep(0.3)  # inside the wait for a notification
        began = time.monotonic()
        follower.send_signal(signal.SIGTERM)
        code = follower.wait(timeout=30)
        took = time.monotonic() - began
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(10)
    time.sleep(0.2)  # let the reader threads drain the pipes
    while not err.empty():
        seen.append(err.get())
    assert code == 0, seen
    # Ended by its own wait, not by StopGuard's interruption of a stuck call (after a 5 s grace,
    # with a line saying so): the bound only keeps a wait of the whole 1000 s from passing.
    assert not any("interrupting" in line for line in seen), (took, seen)
    assert took < 15, (took, seen)


# ---------------------------------------------------------------------------
# The owner leases on PostgreSQL


def _lease_session_port(url: str) -> int:
    """The client port of the one session of ``url``'s database that holds advisory locks (the
    runtime's owner-lease session)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT DISTINCT a.client_port FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND a.datname = current_database()"
        ).fetchall()
    assert len(rows) == 1, rows
    return int(rows[0][0])


def test_leases_are_unhealthy_while_the_lease_session_stops_answering_though_the_store_answers(
    pg_database: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/guarantees.md: until the lease session is back, `GET /health` answers 503. A lease
    session whose packets are dropped (a firewall that forgot the connection) neither answers
    nor fails: the watcher's probe waits. Once it has waited PROBE_STALL_SECONDS the leases say
    unhealthy (GET /health 503, ``agentfold_leases_healthy`` 0, no adoption meanwhile), while
    the store itself still answers on its other sessions. Judging the session by its socket
    alone said healthy for as long as the cut lasted."""
    require_iptables()
    monkeypatch.setattr(leases_module, "PROBE_STALL_SECONDS", 1.0)  # the documented 5 s, shortened
    program = asker_program("pgonly.stall")
    store = EventStore(pg_database)
    try:
        with Runtime(store, Catalog([program]), poll_interval=0.05) as runtime:
            handle = runtime.start(program, None, start_id="stalled-lease")
            runtime.wait_idle(handle.tree_id, timeout=30)
            assert runtime.owns(handle.tree_id) and runtime.leases_healthy()
            with packets_dropped(pg_database, [_lease_session_port(pg_database)]):
                _wait_until(lambda: not runtime.leases_healthy(), 5, "the leases to say unhealthy")
                assert store.answers()  # only the lease session is cut
            _wait_until(runtime.leases_healthy, 30, "the leases to be healthy again once packets pass")
    finally:
        store.close()


def test_leases_are_unhealthy_while_taking_a_run_waits_on_a_lease_session_that_stopped_answering(
    pg_database: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A runtime that holds no lease (its watcher has nothing to probe) starts a run while its
    lease session's packets are dropped: the lock statement waits. Once it has waited
    PROBE_STALL_SECONDS the leases say unhealthy (GET /health 503), as for a stalled probe: a
    server whose every start hangs must not report itself healthy. Once packets pass again the
    start completes."""
    require_iptables()
    monkeypatch.setattr(leases_module, "PROBE_STALL_SECONDS", 1.0)  # the documented 5 s, shortened
    application = f"pgonly-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("PGAPPNAME", application)  # libpq names every session the store opens
    program = chain_program(name="pgonly.stalled-start")
    store = EventStore(pg_database)
    try:
        with Runtime(store, Catalog([program]), poll_interval=0.05) as runtime:
            first = runtime.start(program, {"n": 1}, start_id="first")
            first.result(timeout=30)
            _wait_until(lambda: not runtime._leases.holds(first.tree_id), 10, "its lease given back")
            with psycopg.connect(pg_database, autocommit=True) as admin:
                [(port,)] = admin.execute(
                    "SELECT client_port FROM pg_stat_activity WHERE application_name = %s "
                    "AND query ILIKE 'SELECT pg_advisory_unlock%%'", (application,),
                ).fetchall()  # the lease session: the last statement it ran gave the lease back
            started: list[object] = []
            with packets_dropped(pg_database, [int(port)]):
                taking = threading.Thread(target=lambda: started.append(runtime.start(program, {"n": 1},
                                                                                      start_id="second")))
                taking.start()
                _wait_until(lambda: not runtime.leases_healthy(), 5, "the leases to say unhealthy")
                assert not started and store.answers()  # the start waits; the store itself answers
            taking.join(30)
            assert started, "the start did not complete once packets passed again"
            _wait_until(runtime.leases_healthy, 10, "healthy leases again")
    finally:
        store.close()


def test_an_owner_line_stops_at_once_when_its_lease_session_ends_and_no_new_one_can_be_opened(
    pg_database: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """docs/guarantees.md: when the lease session ends, every lease is gone at once and at the
    next watcher poll the runtime stops driving those runs (`owner lease lost`; a caller waiting
    on the run gets `engine.tree.lease_lost`), also while no new session can be had (the
    database refuses connections: an outage). Failing to reconnect must not hide the loss:
    an unclassified connection error from the reconnection dropped the report, and the owner
    line went on driving the run without a lease until the database came back."""
    entered, release = threading.Event(), threading.Event()

    def held(request: Any, context: Any) -> Settlement:
        entered.set()
        release.wait(30)
        return Settlement.succeeded({"value": 1})

    program = chain_program(held, name="pgonly.outage")
    name = pg_database.rsplit("/", 1)[1]
    admin_url = require_postgres()
    store = EventStore(pg_database)
    caplog.set_level(logging.WARNING, logger="agentfold.runtime")
    try:
        with Runtime(store, Catalog([program]), poll_interval=0.05) as runtime, \
                psycopg.connect(admin_url, autocommit=True) as admin:
            handle = runtime.start(program, {"n": 1}, start_id="outage-1")
            assert entered.wait(20) and runtime.drives(handle.tree_id)
            try:
                admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')  # no new session from now on
                admin.execute("SELECT pg_terminate_backend(l.pid) FROM pg_locks l WHERE l.locktype = 'advisory' "
                              "AND l.database = (SELECT oid FROM pg_database WHERE datname = %s)", (name,))
                with pytest.raises(Fenced) as caught:
                    runtime.result(handle.tree_id, timeout=10)
                assert caught.value.code == "engine.tree.lease_lost"
                # Logged by the watcher right after it stopped the line (and so after result() woke).
                _wait_until(lambda: "owner lease lost; its owner line stopped" in caplog.text, 10, "the log line")
                assert not runtime.drives(handle.tree_id) and not runtime.leases_healthy()
            finally:
                admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
            release.set()
            _wait_until(runtime.leases_healthy, 10, "a new lease session once the database takes connections")
    finally:
        release.set()
        store.close()


def test_leases_are_healthy_again_after_a_run_finishing_on_an_ended_lease_session_gave_its_lease_back(
    pg_database: str,
) -> None:
    """The lease session ends (a failover) while a run's call is under way, and the run finishes
    before the watcher's next look: giving its lease back is the first statement to meet the
    ended session. The runtime then holds no lease, but it must still replace the session it
    knows is broken: otherwise its leases say unhealthy (GET /health 503, no adoption of
    orphans) for as long as it starts no new run, on a database that works."""
    entered, release = threading.Event(), threading.Event()

    def held(request: Any, context: Any) -> Settlement:
        entered.set()
        release.wait(30)
        return Settlement.succeeded({"value": 1})

    program = chain_program(held, name="pgonly.idle")
    store = EventStore(pg_database)
    try:
        # No watcher look before the test asks for one (``_check_leases``: what the watcher does at
        # each poll): the run finishes and gives its lease back first, on the ended session.
        with Runtime(store, Catalog([program]), poll_interval=300.0) as runtime, \
                psycopg.connect(pg_database, autocommit=True) as admin:
            handle = runtime.start(program, {"n": 1}, start_id="idle-after-failover")
            assert entered.wait(20)
            _wait_until(lambda: _lease_backends(admin) != [], 10, "the run's advisory lock")
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                          "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())")
            release.set()
            assert runtime.result(handle.tree_id, timeout=10).status == "completed"
            # Given back (its unlock met the ended session) once it is no longer held here.
            _wait_until(lambda: not runtime._leases.holds(handle.tree_id), 10, "the finished run's lease given back")
            runtime._check_leases()  # the watcher's next look finds the broken session and replaces it
            assert runtime.leases_healthy(), "leases unhealthy on a working database with nothing held"
    finally:
        release.set()
        store.close()


def _lease_backends(admin: psycopg.Connection[Any]) -> list[int]:
    rows = admin.execute("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND database = "
                         "(SELECT oid FROM pg_database WHERE datname = current_database())").fetchall()
    return [int(r[0]) for r in rows]


# ---------------------------------------------------------------------------
# The PostgreSQL pool


def test_a_runs_consecutive_appends_go_through_one_postgresql_session_not_every_pooled_one(
    pg_database: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``prefer_recent_connections``: the pool hands out its most recently used idle session, so
    a run's appends, one after another, are served by one server process with warm caches
    (psycopg_pool's own order rotated them through every pooled session: ~0.12 ms more per
    append). What the server shows: one of the store's sessions ran the append function."""
    application = f"pgonly-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("PGAPPNAME", application)  # libpq names every session the store opens
    program = chain_program(name="pgonly.appends")
    store = EventStore(pg_database)
    try:
        with Runtime(store, Catalog([program]), poll_interval=0) as runtime:
            runtime.start(program, {"n": 30}, start_id="many-appends").result(timeout=60)
            with psycopg.connect(pg_database, autocommit=True) as admin:
                rows = admin.execute(
                    "SELECT pid, query FROM pg_stat_activity WHERE application_name = %s", (application,),
                ).fetchall()
        appending = [pid for pid, query in rows if "agentfold_append" in query]
        assert len(rows) >= 5, rows  # the pool holds several sessions (and the lease session)
        # One (two if a read held it at the moment of an append): never every pooled session.
        assert len(appending) <= 2, rows
    finally:
        store.close()

"""A PostgreSQL database that accepts no writes: a standby (a host name that leads to it after a
failover), or ``default_transaction_read_only`` set for the database or role.

Read commands answer there as on the primary; every write is refused as ``store.read_only``
(exit 1, one classified line naming the cause and what to do), with nothing written, instead of
``store.unavailable`` "check that the server answers" or ``store.append_failed`` with the
server's CONTEXT lines. A runtime whose sessions land on such a server mid-run gets the same
code from the append it tried.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime, RuntimeStopped
from agentfold.domain.errors import StoreFailure
from agentfold.domain.program import Replay
from agentfold.domain.requests import Settlement
from tests.conftest import create_pg_database, require_postgres
from tests.kernel_programs import chain_program
from tests.test_cli import ROOT, agentfold, ok
from tests.test_cli_interaction import two_call_round, write
from tests.test_read_only_store import READ_COMMANDS, answers, read_only_refusal

DEMO = str(ROOT / "agentfold" / "adapters" / "scenarios" / "demo.json")


def switch(url: str, read_only: bool, *, end_sessions: bool) -> None:
    """Set the database's default_transaction_read_only; optionally end its sessions, except the
    owner-lease sessions (they hold advisory locks; ending them is a lost lease, another test)."""
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(require_postgres(), autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = {"on" if read_only else "off"}')
        if end_sessions:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> "
                         "pg_backend_pid() AND pid NOT IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory')",
                         (name,))


def events_in(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM agentfold_events").fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def database(request: pytest.FixtureRequest) -> str:
    url, drop = create_pg_database()
    request.addfinalizer(drop)
    return url


def test_read_commands_answer_on_a_read_only_database_and_writes_are_refused_as_such(
    tmp_path: Path, database: str
) -> None:
    store = database
    scenario = write(tmp_path, two_call_round(tmp_path / "side-effects.jsonl"))
    crashed = agentfold("run", str(scenario), "--start-id", "round-1", "--crash-after", "in-dispatch:2", store=store)
    assert crashed.code == 75, crashed.stderr
    ok(agentfold("recover", store=store))
    expected, _ = answers(store)
    [unknown] = json.loads(expected["unknown"])["unknown_effects"]
    stored = events_in(store)

    switch(store, True, end_sessions=True)
    answered, refusals = answers(  # the reads and the refused writes side by side, each its own process
        store,
        ("resolve", unknown["effect_id"], "--output", '"done"', "--json"),
        ("cancel", unknown["process_id"], "--json"),
        ("run", DEMO, "--json"),
        ("project", "--json"),
    )
    for command in READ_COMMANDS:
        got = json.loads(answered[" ".join(command)])
        if command[0] == "audit":  # its timing differs; the verdict must not
            assert got["ok"] is True
            continue
        assert got == json.loads(expected[" ".join(command)]), command

    assert len(refusals) == 4
    for ran in refusals:
        read_only_refusal(ran)
        error = json.loads(ran.stderr)["error"]
        assert "accepts no writes" in error["message"], error
        assert "primary" in error["hint"], error
    switch(store, False, end_sessions=True)
    assert events_in(store) == stored


def test_a_runtime_whose_sessions_reach_a_read_only_database_gets_store_read_only(database: str) -> None:
    program = chain_program(lambda request, context: Settlement.succeeded({"value": 1}), name="standby.chain")
    store = EventStore(database)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            assert runtime.start(program, {"n": 2}, start_id="before").result(timeout=60).status == "completed"
            stored = events_in(database)
            switch(database, True, end_sessions=True)
            with pytest.raises(StoreFailure) as refused:
                runtime.start(program, {"n": 2}, start_id="after")
            assert refused.value.code == "store.read_only", refused.value
            assert "accepts no writes" in refused.value.message
            switch(database, False, end_sessions=True)
            assert events_in(database) == stored
    finally:
        store.close()


def test_a_write_after_the_database_takes_writes_again_is_not_refused_by_a_session_opened_before(database: str) -> None:
    # Found by CI (run143): /health said 200 once a probe renewed the sessions, but the pool had
    # opened their replacements while the database was still read-only, and POST /runs got
    # store.read_only. A session keeps default_transaction_read_only for its life: an append
    # refused as read-only renews the sessions and is tried once more (nothing was stored).
    program = chain_program(lambda request, context: Settlement.succeeded({"value": 1}), name="standby.renewed")
    store = EventStore(database)
    try:
        with Runtime(store, Catalog([program])) as runtime:
            switch(database, True, end_sessions=True)
            store.check_sessions()  # lets go of the sessions the switch ended
            assert store.refuses_writes_now()  # renews the sessions: their replacements open read-only
            pool = store.factory.datastore.pool
            deadline = time.monotonic() + 30
            while pool.get_stats()["pool_available"] < pool.min_size and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pool.get_stats()["pool_available"] >= pool.min_size, pool.get_stats()
            switch(database, False, end_sessions=False)
            handle = runtime.start(program, {"n": 2}, start_id="after")
            assert handle.result(timeout=60).status == "completed"
    finally:
        store.close()


def slow_chain() -> Any:
    def call(request: Any, context: Any) -> Settlement:
        time.sleep(0.1)
        return Settlement.succeeded({"value": 1})

    return chain_program(call, name="standby.slow", replay=Replay.SAME_IDENTITY)


def test_a_run_stalled_by_a_read_only_database_continues_once_it_takes_writes_again(database: str) -> None:
    # Found by a review: the pooled sessions opened while the database was read-only kept
    # default_transaction_read_only for their life (an hour): the run stayed stalled after the
    # database took writes again, until someone ended those sessions.
    program = slow_chain()
    store = EventStore(database)
    try:
        with Runtime(store, Catalog([program]), poll_interval=0.2) as runtime:
            handle = runtime.start(program, {"n": 30}, start_id="stalled")
            time.sleep(0.8)
            switch(database, True, end_sessions=True)
            deadline = time.monotonic() + 30
            while not runtime.stalled_trees() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert runtime.stalled_trees() == [handle.tree_id]
            assert runtime.last_stall is not None and runtime.last_stall.code == "store.read_only"
            switch(database, False, end_sessions=False)  # the sessions open now stay as they are
            deadline = time.monotonic() + 60
            status = None
            while status is None and time.monotonic() < deadline:
                try:
                    status = handle.result(1).status  # the stopped owner line raises until adopted again
                except (RuntimeStopped, TimeoutError):
                    time.sleep(0.2)
            assert status == "completed", runtime.stalled_trees()
    finally:
        store.close()


def healthy_within(client: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if client.get("/health").status_code == 200:
            return True
        time.sleep(0.2)
    return False


def test_health_says_store_read_only_while_the_database_accepts_no_writes(database: str) -> None:
    from fastapi.testclient import TestClient

    from agentfold.adapters.http_api import ApiService, create_app
    from agentfold.adapters.sources import ProgramSources

    program = slow_chain()
    token = "t" * 40
    headers = {"Authorization": f"Bearer {token}"}
    store = EventStore(database)
    service = ApiService.open(store, ProgramSources(programs=(program,)), token, follow=False)
    try:
        with TestClient(create_app(service)) as client:
            assert client.get("/health").status_code == 200
            switch(database, True, end_sessions=True)
            answer = client.get("/health")  # no run has stalled: the probe itself finds out
            assert answer.status_code == 503 and answer.json()["code"] == "store.read_only", answer.text
            switch(database, False, end_sessions=False)
            # Each probe that finds the sessions read-only renews them: 200 within seconds.
            assert healthy_within(client, 15)

            started = client.post("/runs", json={"program": "standby.slow", "input": {"n": 30}, "start_id": "h-1"},
                                  headers=headers)
            assert started.status_code in (200, 201), started.text
            time.sleep(0.8)
            switch(database, True, end_sessions=True)
            deadline = time.monotonic() + 30
            while not service.runtime.stalled_trees() and time.monotonic() < deadline:
                time.sleep(0.1)
            answer = client.get("/health")
            assert answer.status_code == 503 and answer.json()["code"] == "store.read_only", answer.text
            switch(database, False, end_sessions=False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                run = client.get("/runs/h-1", headers=headers).json()
                if run.get("status") == "completed":
                    break
                time.sleep(0.3)
            assert run.get("status") == "completed", run
            assert healthy_within(client, 15)
    finally:
        service.close()
        store.close()


def test_the_transcript_consumer_on_a_read_only_database_says_store_read_only(database: str, kafka_bootstrap: str) -> None:
    # Found by a review: cli.internal "ReadOnlySqlTransaction: cannot execute CREATE TABLE ...".
    switch(database, True, end_sessions=True)
    ran = agentfold("transcripts", "--bootstrap", kafka_bootstrap, "--topic", "t-read-only", "--group", "g",
                    "--db", database, "--once", "--json")
    switch(database, False, end_sessions=True)
    read_only_refusal(ran)


def test_a_following_projection_waits_out_a_read_only_database_and_goes_on(database: str) -> None:
    # A standby or a database switched read-only for maintenance is an outage like any other
    # for a command that follows: it used to stop with exit 1; it now retries (one line each)
    # and renews its sessions, and goes on once the database takes writes again.
    import os
    import signal
    import subprocess
    import sys

    from tests.test_cli import ROOT

    ok(agentfold("run", DEMO, "--start-id", "first", "--json", store=database))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("AGENTFOLD_STORE", None)
    follower = subprocess.Popen([sys.executable, "-m", "agentfold.adapters.cli", "project", "--follow", "--json",
                                 "--store", database], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=ROOT)

    def projected() -> int:
        """Runs in the read-model table (0 before the follower made it)."""
        with psycopg.connect(database, autocommit=True) as conn:
            exists = conn.execute("SELECT to_regclass('agentfold_rm_runs') IS NOT NULL").fetchone()
            if not (exists and exists[0]):
                return 0
            row = conn.execute("SELECT count(*) FROM agentfold_rm_runs").fetchone()
        return int(row[0]) if row else 0

    def within(seconds: float, check: Any) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if check():
                return True
            time.sleep(0.2)
        return False

    try:
        assert within(30, lambda: projected() == 1)
        switch(database, True, end_sessions=True)
        time.sleep(3)  # its sessions were ended: each attempt meets the read-only database
        assert follower.poll() is None, follower.communicate(timeout=10)
        switch(database, False, end_sessions=False)
        ok(agentfold("run", DEMO, "--start-id", "second", "--json", store=database))
        assert within(60, lambda: projected() == 2), "the follower did not go on"
        assert follower.poll() is None
    finally:
        follower.send_signal(signal.SIGTERM)
        _, err = follower.communicate(timeout=30)
    assert follower.returncode == 0, err
    assert "following failed" in err and "read-only transaction" in err, err

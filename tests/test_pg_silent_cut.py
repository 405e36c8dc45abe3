"""PostgreSQL connections cut on the way without a word (PostgreSQL, real packets dropped).

A host that loses power or its network, or a firewall or NAT that forgets a connection,
sends no reset: each end of the connection goes on waiting for the other. Linux sends the
first keepalive after 2 hours and resends unacknowledged data for ~15 minutes, so without
``AGENTFOLD_PG_TCP_TIMEOUT`` (``agentfold.adapters.eventstore.pg_tcp_params``):

* the server kept a vanished owner's lease session, with its advisory locks, for hours:
  no other runtime could adopt that owner's runs (its orphan scan saw the leases held);
* a call on a pooled connection that was cut waited for the data to be resent for
  ~15 minutes, and the statement watchdog left it alone (the server answers a new session).

Here the packets of chosen connections are really dropped (iptables on the loopback
interface: the tests need root and iptables, which ``scripts/test`` installs when it can;
under CI=true their absence fails the run).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.transcripts import TranscriptStore
from tests.kernel_programs import chain_program

ROOT = Path(__file__).resolve().parent.parent

OWNER = r"""
import sys, threading
from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.adapters.transcripts import TranscriptStore
from tests.kernel_programs import chain_program

def call(request, context):
    sys.stdout.write("calling\n")  # one write: lines of two threads never mix
    sys.stdout.flush()
    threading.Event().wait()  # the call under way when the host vanishes

program = chain_program(call, name="cut.chain")
runtime = Runtime(EventStore(sys.argv[1]), Catalog([program]), poll_interval=0)
handle = runtime.start(program, {"n": 2}, start_id="cut-1")
sys.stdout.write(f"{handle.tree_id}\n")
sys.stdout.flush()
threading.Event().wait()
"""


def require_iptables() -> None:
    ok = shutil.which("iptables") is not None and os.geteuid() == 0
    if ok:
        ok = subprocess.run(["iptables", "-L", "INPUT", "-n"], capture_output=True, check=False).returncode == 0
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail("iptables (and root) are needed to cut a connection and CI=true: scripts/test installs it")
    pytest.skip("dropping a connection's packets needs root and iptables (scripts/test installs it)")


def client_ports(url: str) -> list[int]:
    """The client ports of every other session on ``url``'s database."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT client_port FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND client_port IS NOT NULL"
        ).fetchall()
    return sorted(int(r[0]) for r in rows)


# scripts/test removes the rules tagged with its run that a killed test left behind
TAG = "agentfold-test-" + os.environ.get("AGENTFOLD_TEST_RUN", "manual")


@contextlib.contextmanager
def packets_dropped(url: str, ports: list[int] | None) -> Iterator[None]:
    """Drop every packet of the loopback TCP connections between the server of ``url`` and
    the client ports ``ports``, both ways, without a reset: what a vanished host or a
    forgetful firewall does. ``None``: every packet to or from the server's port, new
    connections included (a network partition). Inserted first in INPUT (before any ACCEPT
    of loopback)."""
    assert ports is None or ports
    server = str(conninfo_to_dict(url)["port"])
    pairs = (
        [["--dport", server], ["--sport", server]] if ports is None
        else [["--sport", a, "--dport", b] for port in ports for a, b in ((str(port), server), (server, str(port)))]
    )
    rules = [["INPUT", "-i", "lo", "-p", "tcp", *pair, "-m", "comment", "--comment", TAG, "-j", "DROP"]
             for pair in pairs]
    added: list[list[str]] = []
    try:
        for rule in rules:
            subprocess.run(["iptables", "-w", "10", "-I", rule[0], "1", *rule[1:]], check=True)
            added.append(rule)
        yield
    finally:
        left = [r for r in added
                if subprocess.run(["iptables", "-w", "10", "-D", *r], capture_output=True, check=False).returncode]
        assert not left, f"iptables rules not removed: {left}"


def test_the_runs_of_an_owner_whose_host_vanished_are_adopted_within_the_tcp_timeout(pg_database: str) -> None:
    require_iptables()
    url = pg_database
    EventStore(url).close()
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, url], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "AGENTFOLD_PG_TCP_TIMEOUT": "3"},
    )
    try:
        assert owner.stdout is not None
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(owner.stdout.readline().strip() for _ in range(2)),
                                  daemon=True)
        reader.start()
        reader.join(60)
        said = sorted(lines)  # its tree id, and that it calls
        assert said[0] == "calling", said
        tree_id = said[1]
        ports = client_ports(url)
        # The host is gone: its process runs no more, and its connections carry nothing.
        owner.send_signal(signal.SIGSTOP)
        with packets_dropped(url, ports):
            program = chain_program(name="cut.chain")
            with Runtime(EventStore(url), Catalog([program]), poll_interval=0) as survivor:
                began = time.monotonic()
                adopted: list[str] = []
                while time.monotonic() - began < 60 and not adopted:
                    adopted = [str(t) for t in survivor.adopt_orphans()]
                    if not adopted:
                        time.sleep(0.5)
                took = time.monotonic() - began
                # The server ended the vanished owner's lease session by itself (3 s of silence,
                # then 3 keepalives 1 s apart); with the system's defaults: about 2 hours.
                assert adopted == [tree_id], f"not adopted within {took:.0f} s: the lease is still held"
                assert took < 40, took
                tree = survivor.wait_idle(tree_id, timeout=30)  # type: ignore[arg-type]
                # Adopted by the rules: the call that was under way is unknown, never guessed.
                assert [e.effect_id for p in tree.processes.values() for e in p.unknown_effects()]
    finally:
        owner.kill()
        owner.communicate(timeout=30)


def _local_port(conn: Any) -> int:
    """The client port of a psycopg connection's socket."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        return int(sock.getsockname()[1])


def read_heads_through_a_cut(url: str) -> float:
    """Open a store on ``url``, cut every one of its pooled connections, then read the tree
    index: the seconds the read took, once it answered what it answered before the cut."""
    store = EventStore(url)
    try:
        want = [h.tree_id for h in store.heads()]
        pool = store.factory.datastore.pool
        pool.wait(30)  # every pooled connection open: all of them are cut
        # ... and every one back in the pool (a connection being returned or opened is in no
        # list below: the read once answered at once on such a connection, nobody had cut it).
        deadline = time.monotonic() + 10
        while (stats := pool.get_stats())["pool_available"] < stats["pool_size"] and time.monotonic() < deadline:
            time.sleep(0.01)
        # The server's list, and the pool's own idle connections (the server's view once missed
        # one under load: the read then answered at once on a connection nobody cut).
        ports = sorted(set(client_ports(url)) | {_local_port(conn) for conn in list(pool._pool)})
        answered: list[list[str]] = []
        failed: list[BaseException] = []

        def read() -> None:
            try:
                answered.append([h.tree_id for h in store.heads()])
            except BaseException as exc:  # noqa: BLE001 - reported below
                failed.append(exc)

        with packets_dropped(url, ports):
            began = time.monotonic()
            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            reader.join(60)
            took = time.monotonic() - began
            # Without a fix the call waited ~15 minutes for its data to be resent.
            assert not reader.is_alive(), "the call still waits on the cut connection after 60 s"
        assert not failed, failed
        assert answered == [want]
        return took
    finally:
        store.close()


def test_a_call_on_a_pooled_connection_cut_on_the_way_is_answered_on_a_new_one(
    pg_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_iptables()
    monkeypatch.setenv("AGENTFOLD_PG_TCP_TIMEOUT", "2")
    took = read_heads_through_a_cut(pg_database)
    assert 2 <= took < 30, took  # it did wait on a cut connection, for about the TCP timeout


def test_the_statement_watchdog_ends_a_cut_session_the_server_reports_idle(
    pg_database: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without the TCP timeout (0: the system's defaults), the statement watchdog is what
    notices: the server answers a new session, so it used to leave the call waiting (`a lock
    wait or a slow statement, left to finish`) for the ~15 minutes TCP took; the server lists
    the waiting session as idle (it never got the statement), so that session is ended and
    the call retried on a new one."""
    require_iptables()
    monkeypatch.setenv("AGENTFOLD_PG_TCP_TIMEOUT", "0")
    monkeypatch.setenv("AGENTFOLD_PG_STATEMENT_WAIT", "2")
    caplog.set_level(logging.WARNING, logger="agentfold.store")
    took = read_heads_through_a_cut(pg_database)
    assert 2 <= took < 30, took  # the statement wait, at least
    said = [r.getMessage() for r in caplog.records]
    assert any("the connection was lost on the way" in m for m in said), said
    assert not any("left to finish" in m for m in said), said


def _show(conn: Any, *names: str) -> list[str]:
    rows = [conn.execute(f"SHOW {name}").fetchone() for name in names]
    return [str(next(iter(r.values())) if isinstance(r, dict) else r[0]) for r in rows]


def test_each_kind_of_session_carries_the_tcp_timeout_it_documents(
    pg_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/cli.md, "Noticing a peer that vanished": pooled and owner-lease sessions get the
    server's keepalives and user timeout, a LISTEN session the keepalives only, a transcript
    store's session both unless its URL says otherwise; 0 leaves the server's settings."""
    monkeypatch.setenv("AGENTFOLD_PG_TCP_TIMEOUT", "12")
    names = ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count", "tcp_user_timeout")
    store = EventStore(pg_database)
    try:
        with store.factory.datastore.pool.connection() as pooled:
            assert _show(pooled, *names) == ["12", "4", "3", "12000"]
            assert pooled.info.get_parameters()["keepalives_idle"] == "12"
        lease = store.session()
        listen = store.session(listen=True)
        try:
            assert _show(lease, *names) == ["12", "4", "3", "12000"]
            assert _show(listen, *names) == ["12", "4", "3", "0"]
        finally:
            lease.close()
            listen.close()
    finally:
        store.close()
    transcripts = TranscriptStore(pg_database + "?keepalives_idle=7")
    try:
        conn = transcripts._conn
        assert conn.info.get_parameters()["keepalives_idle"] == "7"  # the URL's own wins
        assert _show(conn, *names) == ["12", "4", "3", "12000"]
    finally:
        transcripts.close()
    monkeypatch.setenv("AGENTFOLD_PG_TCP_TIMEOUT", "0")
    store = EventStore(pg_database)
    try:
        with store.factory.datastore.pool.connection() as pooled:
            idle, user_timeout = _show(pooled, "tcp_keepalives_idle", "tcp_user_timeout")
            assert idle != "12" and user_timeout == "0"  # the server's own (idle: the system's, 7200 here)
    finally:
        store.close()

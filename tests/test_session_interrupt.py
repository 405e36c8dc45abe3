"""Ending a PostgreSQL session from another thread (``end_session``, ``EventStore.interrupt``)
ends that session and nothing else, whatever its owner does with it meanwhile.

Real server, real sockets. The race the interruption must survive: the thread that owns a
connection closes it while another thread is ending it, and the descriptor number it had is
taken at once by an unrelated socket (a descriptor number is reused by the next one opened).
An interruption must never shut down that unrelated socket.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import psycopg
import pytest

from agentfold.adapters.eventstore import EventStore, end_session


@pytest.fixture
def pg_store(pg_database: str) -> Iterator[EventStore]:
    store = EventStore(pg_database)
    try:
        yield store
    finally:
        store.close()


def _open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def _works(pair: tuple[socket.socket, socket.socket]) -> bool:
    """Whether bytes still go through both ends of a socket pair."""
    a, b = pair
    try:
        a.sendall(b"ping")
        b.settimeout(2)
        if b.recv(4) != b"ping":
            return False
        b.sendall(b"pong")
        a.settimeout(2)
        return a.recv(4) == b"pong"
    except OSError:
        return False


def test_interrupting_a_session_ends_a_query_blocked_on_the_server(pg_store: EventStore) -> None:
    conn = pg_store.session()
    failed: list[BaseException] = []

    def blocked() -> None:
        try:
            conn.execute("SELECT pg_sleep(60)")
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            failed.append(exc)

    thread = threading.Thread(target=blocked, daemon=True)
    thread.start()
    time.sleep(0.5)  # in pg_sleep on the server
    started = time.monotonic()
    pg_store.interrupt()
    thread.join(10)
    assert not thread.is_alive(), "the query still waits 10 s after the interruption"
    assert time.monotonic() - started < 5
    assert len(failed) == 1 and isinstance(failed[0], psycopg.OperationalError), failed
    conn.close()
    with pytest.raises(Exception, match="interrupted"):
        pg_store.session()  # and no new session once interrupted


def test_a_session_owner_closing_it_while_it_is_interrupted_leaves_the_socket_that_reuses_its_number_alone(
    pg_store: EventStore,
) -> None:
    """The interrupting thread is held inside ``end_session`` (at its first call into C code:
    in the former code, right between reading the connection's descriptor number and
    duplicating it) while the owner closes the connection and an unrelated socket takes its
    descriptor number. The unrelated socket must still work afterwards."""
    conn = pg_store.session()
    number = conn.pgconn.socket
    paused, resume = threading.Event(), threading.Event()
    code = end_session.__code__

    def hold(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and frame.f_code is code and not paused.is_set():
            paused.set()
            resume.wait(5)  # the owner closes the connection meanwhile

    def interrupting() -> None:
        sys.setprofile(hold)
        try:
            end_session(conn)
        finally:
            sys.setprofile(None)

    thread = threading.Thread(target=interrupting, daemon=True)
    thread.start()
    paused.wait(5)  # held inside end_session (or it already returned: nothing to race)
    conn.close()
    others: list[tuple[socket.socket, socket.socket]] = []
    try:
        # The next sockets opened take the lowest free numbers: the one the connection had.
        while len(others) < 50 and not any(number in (a.fileno(), b.fileno()) for a, b in others):
            others.append(socket.socketpair())
        assert any(number in (a.fileno(), b.fileno()) for a, b in others), "its number was not reused"
        resume.set()
        thread.join(10)
        assert not thread.is_alive()
        broken = [pair for pair in others if not _works(pair)]
        assert broken == [], "the interruption shut down a socket that is not the session's"
    finally:
        resume.set()
        for a, b in others:
            a.close()
            b.close()


def test_a_session_closed_before_the_interruption_leaves_every_other_socket_alone(pg_store: EventStore) -> None:
    conn = pg_store.session()
    conn.close()
    pair = socket.socketpair()
    try:
        pg_store.interrupt()
        assert _works(pair)
    finally:
        pair[0].close()
        pair[1].close()


def test_sessions_hold_no_descriptor_once_closed(pg_store: EventStore) -> None:
    before = _open_fds()
    for _ in range(5):
        conn = pg_store.session()
        conn.execute("SELECT 1")
        conn.close()
    # Pooled sessions too: the pool closes them when the store closes.
    pg_store.max_notification_id()
    pg_store.close()
    time.sleep(0.2)
    assert _open_fds() - before == set()


def test_a_session_the_server_ended_is_still_ended_without_error(pg_store: EventStore, pg_database: str) -> None:
    conn = pg_store.session()
    pid = conn.info.backend_pid
    with psycopg.connect(pg_database, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(psycopg.OperationalError):
        conn.execute("SELECT 1")
    end_session(conn)  # broken already: nothing to end, no error
    conn.close()


def test_lease_sessions_are_ended_by_the_store_interruption(pg_store: EventStore) -> None:
    """The owner-lease session (agentfold.adapters.leases) is a session of the store: interrupting the
    store ends a lease statement waiting on the server, and no new lease session is opened."""
    leases = pg_store.leases()
    try:
        conn = leases._conn  # the lease session
        pg_store.interrupt()
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
        assert not leases.healthy()
        assert leases.check() == set()  # cannot connect again: refused at once, not after a timeout
        assert leases._conn is None
    finally:
        leases.close()

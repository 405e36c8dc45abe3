"""A takeover statement a killed server left waiting commits after its death (PostgreSQL).

PostgreSQL runs a statement to its end even when its client is gone: nothing reads the
socket of a session waiting for a lock. A server killed while its takeover (the append
of ``WriterActivated``) waited for the events table's lock has that activation committed
later, possibly just before the activation of the runtime that takes the run over next.
That runtime holds the run's lease (the dead server's lease session ended with its
process), so no live writer can have made that activation: it activates again on top of
it instead of stopping with ``engine.tree.incarnation_conflict`` (which had left the run
to a dead owner until an orphan scan adopted it, and answered the survivor's request 409).

Here, with real process death: a child process recovers a parked run while the test holds
the events table's lock; the child is SIGKILLed while its append waits; the survivor's
recovery queues behind the dead child's statement; the lock is released.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import Fenced
from agentfold.domain.events import WriterActivated
from agentfold.domain.ids import SignalID
from agentfold.domain.program import SignalRequest
from tests.kernel_programs import asker_program

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import sys
from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from tests.kernel_programs import asker_program
program = asker_program("zombie.asker")
runtime = Runtime(EventStore(sys.argv[1], create=False), Catalog([program]), poll_interval=0)
print("recovering", flush=True)
runtime.recover(sys.argv[2])  # waits for the events table's lock until the test kills it
print("recovered", flush=True)
"""


def wait_until(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def count(url: str, sql: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(sql).fetchone()
        assert row is not None
        return int(row[0])


WAITING_APPENDS = (  # appends waiting for the events table's lock
    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
    "WHERE l.relation = 'agentfold_events'::regclass AND NOT l.granted AND a.query LIKE '%agentfold_append%'"
)
ADVISORY_LOCKS = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def activations(url: str, tree_id: Any) -> list[str]:
    store = EventStore(url, create=False)
    try:
        return [str(r.event.incarnation_id) for r in store.read(tree_id) if isinstance(r.event, WriterActivated)]
    finally:
        store.close()


def test_an_activation_committed_after_its_writer_was_killed_does_not_fence_the_next_owner(
    pg_database: str,
) -> None:
    url = pg_database
    program = asker_program("zombie.asker")
    with Runtime(EventStore(url), Catalog([program]), poll_interval=0) as first:
        handle = first.start(program, {}, start_id="zombie-1")
        parked = first.wait_idle(handle.tree_id, timeout=30)
    tree_id = handle.tree_id
    wait_id = parked.root.current_wait
    assert wait_id is not None
    assert activations(url, tree_id) == []  # a start activates its tree in TreeStarted

    blocker = psycopg.connect(url)  # a transaction: the lock is held until rollback
    blocker.execute("LOCK TABLE agentfold_events IN EXCLUSIVE MODE")
    survivor: Runtime | None = None
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, url, str(tree_id)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
        )
        try:
            wait_until(lambda: count(url, WAITING_APPENDS) == 1, "the child's takeover to wait for the lock")
        finally:
            child.kill()
            child.wait(10)
        assert child.stdout is not None and "recovered" not in child.stdout.read()
        # The child's lease session ended with it; its takeover statement still waits.
        wait_until(lambda: count(url, ADVISORY_LOCKS) == 0, "the dead child's lease to be released")
        assert count(url, WAITING_APPENDS) == 1

        survivor = Runtime(EventStore(url, create=False), Catalog([program]), poll_interval=0)
        outcome: dict[str, Any] = {}

        def recover() -> None:
            assert survivor is not None
            try:
                outcome["handles"] = survivor.recover(str(tree_id))
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                outcome["error"] = exc

        thread = threading.Thread(target=recover, daemon=True)
        thread.start()
        wait_until(lambda: count(url, WAITING_APPENDS) == 2, "the survivor's takeover to queue behind the dead one")
    finally:
        blocker.rollback()  # the dead child's statement goes first, then the survivor's
        blocker.close()
    try:
        thread.join(30)
        assert not thread.is_alive()
        error = outcome.get("error")
        assert not isinstance(error, Fenced), f"the survivor was fenced by a dead writer's activation: {error}"
        assert error is None, repr(error)
        assert [h.tree_id for h in outcome["handles"]] == [tree_id]
        assert survivor.owns(tree_id)
        # Two activations: the dead child's (committed after its death), and the survivor's
        # on top of it: the survivor drives the run.
        stored = activations(url, tree_id)
        assert len(stored) == 2
        assert survivor.capture(tree_id).incarnation is not None
        assert str(survivor.capture(tree_id).incarnation) == stored[-1]
        assert survivor.deliver_signals(
            parked.root.process_id, [SignalRequest(SignalID("zombie-answer"), {"name": "ada"}, wait_id)]
        )
        result = survivor.result(tree_id, timeout=30)
        assert (result.status, result.output) == ("completed", {"hello": "ada"})
    finally:
        survivor.close()
        survivor.store.close()

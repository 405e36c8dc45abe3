"""SIGTERM ends every mode of the store commands cleanly: bounded, exit status 0, a final report.

Every test runs the real command as a child process and looks at what a user sees: the
exit status, how long it took, the final report, and what a later run does (it goes on
from the committed position: nothing applied or published twice, nothing skipped).

* ``serve`` owning a run, its PostgreSQL server frozen (SIGSTOP, a server of the test's own:
  ``tests.test_shutdown_during_outage.OwnServer``): the interruption after the grace must
  also end the owner-lease session, or closing the runtime waits for it until the last resort;
* ``project`` (without ``--follow``, and before ``--follow`` follows) and ``publish --once``
  stopped in the middle of their catch-up: before, SIGTERM killed them (status -15, no report);
* the last resort (a call nothing can interrupt: an SQLite write waiting for the lock another
  process holds, up to 30 s): the command still prints its report of what it committed.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import httpx

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.feed import APPLICATION_PREFIX
from agentfold.adapters.read_models import APPLICATION, ReadModels
from tests.http_api.support import TOKEN, ok, start_server
from tests.test_cli import ROOT, agentfold
from tests.test_cli import ok as ran_ok
from tests.test_cli_interaction import approval
from tests.test_feed_reconnects import Command, _runs
from tests.test_shutdown_during_outage import KILL_AFTER, OwnServer, own_pg, publish_the_rest_once  # noqa: F401 - a fixture
from tests.test_store_opening import assert_rows_equal_folding

#: A command stopped between two healthy batches exits at once; this leaves room for a slow machine.
SOON = 4.0
#: The last resort comes 12 s after the signal.
LAST_RESORT_BOUND = 20.0

#: ``serve``'s grace is 5 s, then the store is probed (at most 2 s) and interrupted: about 7 s.
#: Its last resort is 15 s after the signal; under this bound, the interruption ended it.
SERVE_INTERRUPTED_BOUND = 11.5


def test_serve_owning_a_run_exits_0_after_the_interruption_not_at_the_last_resort_when_its_postgresql_server_hangs(
    own_pg: OwnServer, tmp_path: Path,  # noqa: F811 - the fixture
) -> None:
    """A run it owns keeps its owner-lease session busy with probes; with the server frozen one
    probe never returns, and closing the runtime waits for it. The interruption must end the
    lease session too (not only the store's pool and LISTEN session)."""
    url = own_pg.url
    server = start_server(url, tmp_path)
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c:
            created = ok(c.post("/runs", json={"scenario": approval(None), "start_id": f"frozen-{_unique()}", "wait": 30}), 201)
        assert created["tree"]["classification"] == "parked"  # owned by this server, its lease held
        own_pg.freeze()
        time.sleep(1.5)  # the lease watcher's next probe waits for the frozen server
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(KILL_AFTER)
        seconds = time.monotonic() - started
        assert server.proc.stdout is not None
        last = server.proc.stdout.read().strip().splitlines()[-1]
    finally:
        own_pg.thaw()
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)
    logs = server.logs()
    assert server.proc.returncode == 0, logs
    assert "interrupting what it waits for" in logs
    assert "still not stopped" not in logs, logs
    assert seconds < SERVE_INTERRUPTED_BOUND, f"exited {seconds:.1f} s after SIGTERM: {logs}"
    assert json.loads(last) == {"stopped": True, "signal": 15, "abandoned_dispatches": 0}


def _unique() -> str:
    return uuid.uuid4().hex[:12]


def takes_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has taken SIGTERM over (blocked for its signal thread, or caught by a
    handler), as /proc shows it; before that, SIGTERM kills it with its default action."""
    bit = 1 << (signal.SIGTERM - 1)
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    except OSError:
        return False
    return any(int(fields.get(name, "0").strip(), 16) & bit for name in ("SigBlk", "SigCgt"))


# ---------------------------------------------------------------------------
# Stopped in the middle of a catch-up: after the batch in progress, exit 0, a report


def _sqlite_tracked(db: Path, application: str) -> int:
    """A tracked position, read on a connection of the test's own (0 before the table exists)."""
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
            row = conn.execute("SELECT max(notification_id) FROM agentfold_tracking WHERE application_name = ?",
                               (application,)).fetchone()
    except sqlite3.OperationalError:  # no table yet
        return 0
    return int(row[0] or 0) if row else 0


def _backlog(tmp_path: Path, runs: int) -> tuple[str, Path, int]:
    """An SQLite store holding ``runs`` complete runs: (its URL, its file, its last notification id)."""
    db = tmp_path / "store.db"
    url = f"sqlite:///{db}"
    return url, db, _runs(url, runs)


def _sigterm_once_started(command: Command, db: Path, application: str) -> tuple[int, str, float]:
    """SIGTERM once the command committed its first batch; (exit status, stdout, seconds to exit)."""
    command.wait_until(lambda: _sqlite_tracked(db, application) > 0, 60, "the first batch was committed")
    started = time.monotonic()
    command.process.send_signal(signal.SIGTERM)
    status, out = command.finish(KILL_AFTER)
    return status, out, time.monotonic() - started


def test_project_stopped_in_its_catch_up_commits_the_batch_in_progress_reports_and_exits_0(tmp_path: Path) -> None:
    url, db, total = _backlog(tmp_path, 200)
    project = Command("--store", url, "project", "--batch", "1", "--json")
    status, out, seconds = _sigterm_once_started(project, db, APPLICATION)
    assert status == 0, project.stderr
    assert seconds < SOON, project.stderr
    report = json.loads(out)
    tracked = _sqlite_tracked(db, APPLICATION)
    assert report["stopped"] is True
    assert report["position"] == report["events"] == tracked  # what it reports is what it committed
    assert 0 < tracked < total  # stopped in the middle, not at the end
    assert project.stderr == []

    again = ran_ok(agentfold("project", "--json", store=url)).json()
    assert (again["events"], again["position"]) == (total - tracked, total)
    assert "stopped" not in again
    store = EventStore(url, create=False)
    try:
        assert_rows_equal_folding(store, ReadModels(store), [str(h.tree_id) for h in store.heads()])
    finally:
        store.close()


def test_project_follow_stopped_before_it_follows_reports_like_a_stopped_follower_and_exits_0(tmp_path: Path) -> None:
    url, db, total = _backlog(tmp_path, 200)
    project = Command("--store", url, "project", "--follow", "--batch", "1", "--json")
    status, out, seconds = _sigterm_once_started(project, db, APPLICATION)
    assert status == 0, project.stderr
    assert seconds < SOON, project.stderr
    report = json.loads(out)
    tracked = _sqlite_tracked(db, APPLICATION)
    assert (report["position"], report["events"], report["failures"]) == (tracked, tracked, 0)
    assert 0 < tracked < total


def test_publish_once_stopped_in_its_drain_stores_the_batch_in_progress_reports_and_exits_0(
    tmp_path: Path, kafka_bootstrap: str,
) -> None:
    url, db, total = _backlog(tmp_path, 40)
    topic = f"stop-once-{_unique()}"
    publish = Command("--store", url, "publish", "--bootstrap", kafka_bootstrap, "--topic", topic, "--once",
                      "--batch-size", "1", "--json")
    status, out, seconds = _sigterm_once_started(publish, db, APPLICATION_PREFIX + topic)
    assert status == 0, publish.stderr
    assert seconds < SOON, publish.stderr
    report = json.loads(out)
    tracked = _sqlite_tracked(db, APPLICATION_PREFIX + topic)
    assert report["stopped"] is True
    assert (report["from_position"], report["position"], report["events"]) == (0, tracked, tracked)
    assert 0 < tracked < total

    publish_the_rest_once(url, kafka_bootstrap, topic, tracked, total)


# ---------------------------------------------------------------------------
# The last resort prints the report too


@contextmanager
def _write_lock_held(db: Path) -> Iterator[None]:
    """Another process's write transaction on the SQLite store: writers wait for it (up to the
    store's 30 s lock timeout), and nothing can interrupt that wait from another thread."""
    conn = sqlite3.connect(str(db), timeout=30, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def test_project_follow_at_the_last_resort_prints_its_report_of_what_it_committed(tmp_path: Path) -> None:
    url, db, total = _backlog(tmp_path, 200)
    project = Command("--store", url, "project", "--follow", "--batch", "1", "--json")
    try:
        project.wait_until(lambda: _sqlite_tracked(db, APPLICATION) > 0, 60, "the first batch was committed")
        _stopped_at_the_last_resort_with_its_report(project, db, total, settle=0.5)
    finally:
        if project.alive():
            project.process.kill()


def _stopped_at_the_last_resort_with_its_report(project: Command, db: Path, total: int, settle: float) -> None:
    """With another process's write lock held (its next batch waits for it), ``settle`` s,
    then SIGTERM: ``project`` exits 0 at the last resort and prints the report of what it
    committed; the batch it waited in was not committed."""
    with _write_lock_held(db):
        tracked = _sqlite_tracked(db, APPLICATION)
        assert tracked < total
        time.sleep(settle)
        started = time.monotonic()
        project.process.send_signal(signal.SIGTERM)
        status, out = project.finish(KILL_AFTER)
        seconds = time.monotonic() - started
    assert status == 0, project.stderr
    assert seconds < LAST_RESORT_BOUND, project.stderr
    assert any("still not stopped 12 s after the stop: exiting now" in line for line in project.stderr), project.stderr
    report: dict[str, Any] = json.loads(out)
    assert (report["position"], report["events"], report["failures"]) == (tracked, tracked, 0)
    assert _sqlite_tracked(db, APPLICATION) == tracked


def test_project_follow_at_the_last_resort_while_following_prints_its_report_of_what_it_committed(
    tmp_path: Path,
) -> None:
    url, db, first = _backlog(tmp_path, 3)
    # It looks for new events every 2 s: the test appends, then takes the lock before it looks.
    project = Command("--store", url, "project", "--follow", "--poll-interval", "2", "--json")
    try:
        project.wait_until(lambda: _sqlite_tracked(db, APPLICATION) == first, 60, "it caught up")
        # its next look (within 3 s) finds the new events, and its batch waits for the lock
        _stopped_at_the_last_resort_with_its_report(project, db, _runs(url, 5), settle=3.0)
    finally:
        if project.alive():
            project.process.kill()


# ---------------------------------------------------------------------------
# The last resort before anything was reached, and a signal while the command ends


def test_publish_and_transcripts_stopped_before_reaching_the_broker_still_report_and_exit_0(tmp_path: Path) -> None:
    """A broker that cannot be reached: the commands wait in the Kafka client (not
    interruptible), so SIGTERM ends them at the last resort, with a report saying nothing
    was done (``stopped``: true), not with an empty stdout."""
    url, _, _ = _backlog(tmp_path, 1)
    nowhere = "127.0.0.1:1"
    publish = Command("--store", url, "publish", "--bootstrap", nowhere, "--topic", "t", "--once", "--json")
    transcripts = Command("transcripts", "--bootstrap", nowhere, "--topic", "t", "--group", "g",
                          "--db", f"sqlite:///{tmp_path / 'transcripts.db'}", "--once", "--json")
    commands = (publish, transcripts)
    try:
        # A signal before the command takes SIGTERM over kills it (-15): that is Python's start-up
        # (seconds on a loaded machine), not what this test is about. Then 2 s to reach the client.
        for command in commands:
            command.wait_until(lambda c=command: takes_sigterm(c.process.pid), 60,  # type: ignore[misc]
                               "the command took SIGTERM over")
        time.sleep(2.0)
        started = time.monotonic()
        for command in commands:
            command.process.send_signal(signal.SIGTERM)
        ended = [command.finish(KILL_AFTER) for command in commands]
        seconds = time.monotonic() - started
    finally:
        for command in commands:
            if command.alive():
                command.process.kill()
    assert seconds < LAST_RESORT_BOUND
    (published_status, published), (read_status, read) = ended
    assert published_status == 0, publish.stderr
    assert json.loads(published) == {"topic": "t", "events": 0, "batches": 0, "from_position": None, "position": None,
                                     "failures": 0, "stopped": True}
    assert read_status == 0, transcripts.stderr
    report = json.loads(read)
    assert (report["topic"], report["group"], report["stopped"], report["envelopes"], report["batches"]) == (
        "t", "g", True, 0, 0)


def test_a_signal_while_publish_once_prints_its_report_and_exits_does_not_kill_it(
    tmp_path: Path, kafka_bootstrap: str,
) -> None:
    """SIGTERM right after the report is on stdout (the process is ending: closing the
    producer, the store): it is noted, not fatal (exit 0, not 143)."""
    url, _, total = _backlog(tmp_path, 3)
    env = {k: v for k, v in os.environ.items() if k != "AGENTFOLD_STORE"}
    env["PYTHONPATH"] = str(ROOT)
    topic = f"late-{uuid.uuid4().hex[:8]}"
    process = subprocess.Popen(
        [sys.executable, "-m", "agentfold.adapters.cli", "--store", url, "publish", "--bootstrap", kafka_bootstrap,
         "--topic", topic, "--once", "--json"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert status == 0, process.stderr.read() if process.stderr else ""
    assert json.loads(line)["position"] == total

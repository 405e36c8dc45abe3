"""Commands that stop waiting, on a run whose only work left is a Deadline's timer (docs/team.md,
"Commands that wait"; docs/cli.md).

A console script's ``recover`` (or any command that drives a run until it parks) owns the run
only while it waits. A Deadline an hour away will not fire while it waits, and the next owner
waits for the same instant (replay policy ``same_identity``), so the command returns at once
with the run left waiting for its timer (exit 0, the timer listed in its summary) instead of
waiting its whole ``--timeout`` and failing with ``cli.timeout``. A timer due within the
command's time is waited for, and the run goes on to its end. The HTTP API's writes answer the
same way after their ``wait``. Real stores (SQLite, PostgreSQL), the console script in its own
process (``python -m tests.team.competition_programs cli``), its ``serve`` for the HTTP API.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.domain.events import EffectDispatched, EffectSettled, WriterActivated
from agentfold.domain.ids import TreeID
from tests.interaction.support import open_runtime, recover
from tests.interaction.tools import wait_until
from tests.team import competition_programs as C

ROOT = Path(__file__).resolve().parent.parent.parent
#: The --timeout the commands get: a command that waits for a far timer takes all of it (and more).
TIMEOUT = 40.0
HOUR = 3600.0


def console(url: str, *argv: str, timeout: float = TIMEOUT) -> tuple[int, str, str, float]:
    """The deployment's console script in its own process: exit status, stdout, stderr, seconds taken."""
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "tests.team.competition_programs", "cli", *argv, "--store", url,
         "--timeout", f"{timeout:g}"],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT * 3,
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - began


def orphan_deadline(url: str, start_id: str, seconds: float) -> TreeID:
    """A Deadline ``seconds`` away, started by a runtime that closed while its timer waited (it
    records nothing for the timer: the run is left for the next owner)."""
    with open_runtime(url, C.deadline()) as runtime:
        handle = runtime.start(C.deadline(), C.instant_in(seconds), start_id=start_id)
        wait_until(lambda: runtime.timers_waiting() == 1, "the timer to wait")
    return handle.tree_id


def orphan_deadline_root(url: str, start_id: str) -> tuple[TreeID, str]:
    """``orphan_deadline`` an hour away: its tree id and its root process id."""
    tree_id = orphan_deadline(url, start_id, HOUR)
    store = EventStore(url)
    try:
        head = store.head(tree_id)
        assert head is not None
        return tree_id, str(head.root_process_id)
    finally:
        store.close()


def at_once(url: str, command: str, process_id: str) -> Any:
    """``agentfold COMMAND PROCESS_ID --json`` that answers at once (exit 0): its tree summary."""
    status, out, err, took = console(url, command, process_id, "--json")
    assert status == 0, err
    assert took < TIMEOUT / 2, f"{command} took {took:.1f} s: it waited for the timer"
    return json.loads(out)["tree"]


def head_version(url: str, tree_id: TreeID) -> int:
    store = EventStore(url)
    try:
        head = store.head(tree_id)
    finally:
        store.close()
    assert head is not None
    return head.version


def timer_records(url: str, tree_id: TreeID) -> tuple[list[Any], list[Any], int]:
    """(the timer's dispatch permissions, its settlements, the owners activated) as stored."""
    store = EventStore(url)
    try:
        events = [r.event for r in store.read(tree_id)]
    finally:
        store.close()
    return ([e for e in events if isinstance(e, EffectDispatched)], [e for e in events if isinstance(e, EffectSettled)],
            sum(1 for e in events if isinstance(e, WriterActivated)))


@pytest.mark.parametrize("timeout", [TIMEOUT, 0.0])
def test_recover_leaves_a_run_waiting_only_for_a_far_timer_as_it_is_and_appends_nothing(
    durable_store_url: str, timeout: float,
) -> None:
    """Adopting it would append a WriterActivated and a new dispatch permission of the same timer,
    and the command would give it up again before the instant: every periodic ``recover`` would
    grow the history by two events. It is listed, with its timer, and left (exit 0)."""
    url = durable_store_url
    tree_id = orphan_deadline(url, "far-1", HOUR)
    before = timer_records(url, tree_id)
    [first], settled, _ = before
    assert settled == []
    version = head_version(url, tree_id)

    status, out, err, took = console(url, "recover", "--json", timeout=timeout)
    assert status == 0, err
    assert took < TIMEOUT / 2, f"recover took {took:.1f} s: it waited for the timer"
    [entry] = json.loads(out)["trees"]
    assert entry["tree_id"] == tree_id and entry["outcome"] == "waiting_for_timer"
    assert entry["status"] == "running" and entry["classification"] == "progress"
    assert entry["version"] == version and entry["unknown_effect_ids"] == []
    [timer] = entry["timers"]
    assert timer["effect_id"] == first.effect_id
    assert HOUR - 120 < timer["due_in_seconds"] <= HOUR
    assert head_version(url, tree_id) == version and timer_records(url, tree_id) == before

    status, out, err, took = console(url, "recover")
    assert status == 0, err
    assert took < TIMEOUT / 2
    assert f"left {tree_id} (start far-1): nothing to do before its timers; waiting for 1 timer(s), the first due in" \
        in out, out
    assert "unknown" not in out
    assert head_version(url, tree_id) == version

    # A run another live runtime drives (its owner fires the timer) is reported owned, as before.
    with open_runtime(url, C.deadline()) as runtime:
        recover(runtime, tree_id)
        wait_until(lambda: runtime.timers_waiting() == 1, "the new owner's timer to wait")
        status, out, err, _ = console(url, "recover", "--json")
        assert status == 0, err
        assert [e["outcome"] for e in json.loads(out)["trees"]] == ["owned"]


def test_recover_waits_for_a_timer_due_within_its_time_and_the_deadline_completes(durable_store_url: str) -> None:
    url = durable_store_url
    tree_id = orphan_deadline(url, "near-1", 4.0)
    status, out, err, _ = console(url, "recover", "--json")
    assert status == 0, err
    [entry] = json.loads(out)["trees"]
    assert entry["tree_id"] == tree_id and entry["outcome"] == "recovered"
    assert entry["status"] == "completed" and entry["classification"] == "terminal"
    assert "timers" not in entry
    [settled] = timer_records(url, tree_id)[1]
    assert settled.status == "succeeded"


def test_resume_drives_a_paused_deadline_and_returns_with_its_far_timer_waiting(durable_store_url: str) -> None:
    """``pause`` and ``resume`` drive the run through the path every input command takes
    (``cancel``, ``answer``, ``resolve``, ...): each returns at once, the timer left waiting."""
    url = durable_store_url
    tree_id, root = orphan_deadline_root(url, "paused-1")
    paused = at_once(url, "pause", root)
    # Paused: parked; the pause does not stop the timer, which the command left waiting.
    assert paused["status"] == "paused" and paused["classification"] == "parked"
    assert [t["effect_id"] for t in paused["timers"]] == [timer_records(url, tree_id)[0][0].effect_id]
    # Left by `pause` with its timer waiting: `recover` leaves it so (nothing appended).
    version = head_version(url, tree_id)
    status, out, err, _ = console(url, "recover", "--json")
    assert status == 0, err
    [entry] = json.loads(out)["trees"]
    assert entry["outcome"] == "waiting_for_timer" and entry["status"] == "paused"
    assert [t["effect_id"] for t in entry["timers"]] == [t["effect_id"] for t in paused["timers"]]
    assert head_version(url, tree_id) == version

    tree = at_once(url, "resume", root)
    assert tree["status"] == "running" and tree["classification"] == "progress"
    [(dispatched, _, _)] = [timer_records(url, tree_id)]
    [timer] = tree["timers"]
    assert timer["effect_id"] == dispatched[0].effect_id and HOUR - 120 < timer["due_in_seconds"] <= HOUR
    assert timer_records(url, tree_id)[1] == []



def test_cancel_of_a_run_waiting_for_a_far_timer_stops_the_timer_failed_never_unknown(durable_store_url: str) -> None:
    """docs/team.md, "Cancellation": a canceled Deadline's timer settles failed, with no unknown
    Effect. The console script's ``cancel`` of a Deadline left waiting by an earlier command
    recorded the cancel first and took the run over after it, finding the timer in flight for a
    Process already ending: unknown (engine.dispatch.interrupted), which `agentfold unknown`
    listed and no host could resolve. Found by a docs walkthrough."""
    url = durable_store_url
    tree_id, root = orphan_deadline_root(url, "canceled-1")
    tree = at_once(url, "cancel", root)
    assert tree["status"] == "canceled" and tree["unknown_effect_ids"] == []
    dispatched, settled, _ = timer_records(url, tree_id)
    assert [s.status for s in settled] == ["failed"] and settled[0].effect_id == dispatched[0].effect_id
    done = subprocess.run([sys.executable, "-m", "tests.team.competition_programs", "cli", "unknown", "--json",
                           "--store", url], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert str(tree_id) not in done.stdout


def test_an_http_write_answers_at_once_when_the_run_is_left_only_waiting_for_a_far_timer(
    durable_store_url: str, tmp_path: Path,
) -> None:
    """The server owns the run and fires the timer at its instant; a write's ``wait`` does not
    wait for an instant after it (before: the whole wait, then ``idle`` false)."""
    from tests.http_api.support import ok, start_server

    server = start_server(durable_store_url, tmp_path, entry=("tests.team.competition_programs", "cli"))
    try:
        client = server.client()
        began = time.monotonic()
        far = ok(client.post("/runs", json={"program": "test.deadline", "input": C.instant_in(HOUR),
                                            "start_id": "http-far", "wait": TIMEOUT}), 201)
        assert time.monotonic() - began < TIMEOUT / 2, "the write waited for the timer"
        assert far["idle"] is True
        assert far["tree"]["status"] == "running" and far["tree"]["classification"] == "progress"
        [timer] = far["timers"]
        [dispatched], settled, _ = timer_records(durable_store_url, TreeID(far["tree"]["tree_id"]))
        assert timer["effect_id"] == dispatched.effect_id and HOUR - 120 < timer["due_in_seconds"] <= HOUR
        assert settled == []

        near = ok(client.post("/runs", json={"program": "test.deadline", "input": C.instant_in(4.0),
                                             "start_id": "http-near", "wait": TIMEOUT}), 201)
        assert near["idle"] is True and near["tree"]["status"] == "completed" and "timers" not in near
    finally:
        status, _ = server.stop()
    assert status == 0, server.log.read_text()

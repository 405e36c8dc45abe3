"""The retry policy of the following commands, and their one-line failure messages.

``retry_until_stopped`` (``agentfold project --follow``, ``agentfold publish``) waits 0.5, 1,
2, 4 ... up to 30 s between attempts during an outage, and goes back to 0.5 s only after an
attempt that made progress: not merely after an attempt that took long to fail (during a
PostgreSQL outage each attempt waits ~30 s for a pool connection, which used to reset the
wait to 0.5 s every time). Pure logic: fake attempts that fail slowly, small timings.

Failure lines are one line each: libpq's messages span several (``server closed the
connection unexpectedly\\n\\tThis probably means ...``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

from agentfold.adapters.follower import corrupt_tree_line, follow_until_stopped, one_line, retry_until_stopped
from agentfold.adapters.read_models import CorruptTree
from agentfold.domain.errors import StoreFailure

ROOT = Path(__file__).resolve().parents[2]
LIBPQ = ("server closed the connection unexpectedly\n\tThis probably means the server terminated abnormally\n"
         "\tbefore or while processing the request.")

BACKOFF, MAX_BACKOFF, SLOW = 0.01, 0.08, 0.12  # each failing attempt takes longer than MAX_BACKOFF


def waits(lines: list[str]) -> list[float]:
    return [float(m.group(1)) for line in lines if (m := re.search(r"retrying in ([0-9.e-]+) s", line))]


def run_attempts(outcomes: str, *, with_progress: bool = True) -> tuple[list[str], int]:
    """One attempt per letter: ``f`` fails slowly without progress, ``p`` makes progress (a
    step that ended well) then fails slowly; the attempt after the last one stops the loop."""
    said: list[str] = []
    stop = threading.Event()
    steps = 0
    plan = list(outcomes)

    def attempt() -> None:
        nonlocal steps
        if not plan:
            stop.set()
            return
        kind = plan.pop(0)
        if kind == "p":
            steps += 1
        time.sleep(SLOW)
        raise psycopg.OperationalError(LIBPQ)

    failures = retry_until_stopped(attempt, stop, said.append, backoff=BACKOFF, max_backoff=MAX_BACKOFF,
                                   progress=(lambda: steps) if with_progress else None)
    return said, failures


def test_the_wait_grows_during_an_outage_whose_attempts_fail_slowly() -> None:
    said, failures = run_attempts("ffffff")
    assert failures == 6
    assert waits(said) == [0.01, 0.02, 0.04, 0.08, 0.08, 0.08]


def test_the_wait_is_short_again_after_an_attempt_that_made_progress() -> None:
    said, _ = run_attempts("fffpff")
    assert waits(said) == [0.01, 0.02, 0.04, 0.01, 0.02, 0.04]


def test_without_a_progress_count_an_attempt_that_lasted_counts_as_progress() -> None:
    # The rule for callers with no count of their own (the transcript consumer).
    said, _ = run_attempts("fff", with_progress=False)
    assert waits(said) == [0.01, 0.01, 0.01]


def test_follow_until_stopped_backs_off_while_no_follower_can_be_made() -> None:
    # The store cannot be reached: every attempt fails (slowly) in ``make``, before any step.
    said: list[str] = []
    stop = threading.Event()
    attempts = 0

    def make() -> object:
        nonlocal attempts
        attempts += 1
        if attempts > 5:
            stop.set()
        time.sleep(SLOW)
        raise StoreFailure("store.unavailable", "cannot open store postgresql://db/agentfold: " + LIBPQ)

    report = follow_until_stopped(make, stop, said.append, backoff=BACKOFF, max_backoff=MAX_BACKOFF)  # type: ignore[arg-type]
    assert report.failures == 5
    assert waits(said) == [0.01, 0.02, 0.04, 0.08, 0.08]


def test_failure_lines_are_one_line() -> None:
    said, _ = run_attempts("f")
    assert said[0] == ("following failed: OperationalError: server closed the connection unexpectedly This probably "
                       "means the server terminated abnormally before or while processing the request.; "
                       "retrying in 0.01 s")
    assert one_line(StoreFailure("store.unavailable", "cannot open store: " + LIBPQ)).count("\n") == 0
    found = CorruptTree("tree:" + "0" * 32, None, 1, 3, "integrity.format", "bad\n\tstate", 7)
    assert "\n" not in corrupt_tree_line(found) and "integrity.format: bad state;" in corrupt_tree_line(found)


def test_the_feed_commands_print_one_line_per_message() -> None:
    code = ("from agentfold.adapters.cli_feed import _say; "
            f"_say('publish')('following failed: OperationalError: ' + {LIBPQ!r} + '; retrying in 0.5 s')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("agentfold: publish: following failed: OperationalError: server closed the "
                                  "connection unexpectedly This probably means")

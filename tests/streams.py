"""Reading a child process's output line by line, with a deadline (tests that follow)."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Iterable


def lines_into(stream: Iterable[str], into: queue.Queue[str]) -> None:
    """Put every line of ``stream`` on ``into`` (run it in a daemon thread)."""
    for line in stream:
        into.put(line)


def expect_line(lines: queue.Queue[str], needle: str, timeout: float, seen: list[str]) -> str:
    """The first line holding ``needle`` within ``timeout`` seconds; every line read goes to ``seen``."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no line with {needle!r} within {timeout} s: {seen}")


def read_both(process: subprocess.Popen[str]) -> tuple[queue.Queue[str], queue.Queue[str]]:
    """Queues that receive the process's stdout and stderr lines as they come."""
    out: queue.Queue[str] = queue.Queue()
    err: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lines_into, args=(process.stdout, out), daemon=True).start()
    threading.Thread(target=lines_into, args=(process.stderr, err), daemon=True).start()
    return out, err

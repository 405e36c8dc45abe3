"""Helpers shared by the crash tests: run the worker, recover in this process, read the stream."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import Fenced
from agentfold.domain.events import EffectDeclared, TreeEvent
from agentfold.domain.ids import EffectID, TreeID
from tests.crash import programs

ROOT = Path(__file__).resolve().parents[2]
CRASH_EXIT = 75


def worker(store_url: str, log: Path, action: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``python -m tests.crash.worker`` in a fresh process and wait for it to end."""
    return subprocess.run(
        [sys.executable, "-m", "tests.crash.worker", store_url, str(log), action, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )


def crash(store_url: str, log: Path, action: str, *args: str) -> None:
    """Run the worker and require that it died at its crash point (exit code 75)."""
    done = worker(store_url, log, action, *args)
    assert done.returncode == CRASH_EXIT, (
        f"worker {action} {args} exited {done.returncode}, not {CRASH_EXIT}\n"
        f"stdout: {done.stdout}\nstderr: {done.stderr}"
    )


def tree_of(start_id: str) -> TreeID:
    return TreeID.for_start(start_id)  # type: ignore[arg-type]


@contextmanager
def runtime_for(store_url: str, kind: str, log: Path) -> Iterator[tuple[EventStore, Runtime]]:
    """A fresh store connection and Runtime in this process, bound to the Program ``kind``."""
    store = EventStore(store_url)
    runtime = Runtime(store, programs.catalog(kind, log))
    try:
        yield store, runtime
    finally:
        runtime.close()
        store.close()


def recover(runtime: Runtime, tree_id: TreeID, timeout: float = 10.0) -> None:
    """Recover a crashed tree; wait while the server still holds the dead process's lease.

    SQLite's OFD lock disappears with the process; a PostgreSQL advisory lock goes
    when the server notices the closed session, which can take a moment.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            handles = runtime.recover(str(tree_id))
        except Fenced as exc:
            if exc.code != "engine.tree.owned" or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
            continue
        assert [h.tree_id for h in handles] == [tree_id]
        return


def wait_lease_free(store_url: str, tree_id: TreeID, timeout: float = 10.0) -> None:
    """Wait until no live process holds ``tree_id``'s owner lease (a dead one's is freed by the OS/server)."""
    store = EventStore(store_url)
    leases = store.leases()
    try:
        deadline = time.monotonic() + timeout
        while not leases.acquire(tree_id):
            assert time.monotonic() < deadline, f"the lease of {tree_id} is still held"
            time.sleep(0.02)
        leases.release(tree_id)
    finally:
        leases.close()
        store.close()


def events(store: EventStore, tree_id: TreeID) -> list[TreeEvent]:
    return [record.event for record in store.read(tree_id)]


def count(stream: list[TreeEvent], kind: type) -> int:
    return sum(1 for event in stream if isinstance(event, kind))


def dispatcher_effects(stream: list[TreeEvent]) -> list[EffectID]:
    """Dispatcher Effect ids in the order their declarations were committed."""
    return [e.effect_id for e in stream if isinstance(e, EffectDeclared) and e.target == "dispatcher"]


def unknown_ids(runtime: Runtime, tree_id: TreeID) -> list[EffectID]:
    """Unknown Effects of the captured tree, in process creation order."""
    tree = runtime.capture(tree_id)
    return [record.effect_id for process in tree.processes.values() for record in process.unknown_effects()]


def indexed_unknown(store: EventStore, tree_id: TreeID) -> set[str]:
    head = store.head(tree_id)
    assert head is not None
    return set(head.unknown_effect_ids)

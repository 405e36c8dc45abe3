"""Runtime helpers for the Interaction tests: real stores, restarts, lost acknowledgements."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import Fenced, StoreFailure
from agentfold.domain.events import EffectSettled, TreeEvent
from agentfold.domain.ids import EffectID, ProcessID, TreeID
from agentfold.domain.program import Program
from agentfold.domain.requests import EffectRequest, effect_request
from agentfold.domain.tree import TreeState
from agentfold.projections.host_views import unknown_effects

ROOT = Path(__file__).resolve().parents[2]
CRASH_EXIT = 75


@contextmanager
def open_runtime(
    url_or_store: str | EventStore, *programs: Program, catalog: Catalog | None = None, **options: Any
) -> Iterator[Runtime]:
    """A Runtime over a real store; a URL opens (and closes) a fresh store connection."""
    own = isinstance(url_or_store, str)
    store = EventStore(url_or_store) if isinstance(url_or_store, str) else url_or_store
    runtime = Runtime(store, catalog or Catalog(programs), **options)
    try:
        yield runtime
    finally:
        runtime.close()
        if own:
            store.close()


def recover(runtime: Runtime, tree: str | TreeID, timeout: float = 10.0) -> None:
    """A new owner takes the tree (``WriterActivated``); a dead owner's lease may take a moment to go."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            handles = runtime.recover(str(tree))
        except Fenced as exc:
            if exc.code != "engine.tree.owned" or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
            continue
        assert len(handles) == 1
        return


def lose_acknowledgement(store: EventStore, predicate: Callable[[Sequence[TreeEvent]], bool]) -> threading.Event:
    """After the first append whose events match ``predicate`` commits, raise as if its ack were lost.

    The events are durable; the writer believes the append failed and stops driving the
    tree, exactly as when a connection dies between COMMIT and its reply.
    """
    original = store.append
    fired = threading.Event()

    def append(tree_id: TreeID, expected: int, events: Sequence[TreeEvent], **kw: Any) -> Any:
        result = original(tree_id, expected, events, **kw)
        if not fired.is_set() and predicate(events):
            fired.set()
            raise StoreFailure("store.ack_lost", "the append committed but its acknowledgement was lost")
        return result

    store.append = append  # type: ignore[method-assign]
    return fired


def observe_appends(store: EventStore, on_append: Callable[[Sequence[TreeEvent]], None]) -> None:
    """Call ``on_append`` with the events of every append after it committed."""
    original = store.append

    def append(tree_id: TreeID, expected: int, events: Sequence[TreeEvent], **kw: Any) -> Any:
        result = original(tree_id, expected, events, **kw)
        on_append(events)
        return result

    store.append = append  # type: ignore[method-assign]


def settles_unknown(events: Sequence[TreeEvent]) -> bool:
    return any(isinstance(e, EffectSettled) and e.status == "unknown" for e in events)


def unknown_of(runtime: Runtime, tree: TreeState) -> list[dict[str, Any]]:
    return unknown_effects(tree, runtime.catalog.resolve)


def request_of(runtime: Runtime, tree: TreeState, process_id: ProcessID | str, effect_id: EffectID | str) -> EffectRequest:
    """The retained request of an Effect, rebuilt from the folded tree with its exact Program."""
    process = tree.processes[ProcessID(process_id)]
    return effect_request(tree, process.process_id, EffectID(effect_id), runtime.catalog.resolve(process.program))


def child_by_key(tree: TreeState, key: str) -> Any:
    for process in tree.processes.values():
        if process.child_key == key:
            return process
    raise AssertionError(f"no child with key {key}")


def worker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``python -m tests.interaction.worker`` in a fresh process and wait for it to end."""
    return subprocess.run(
        [sys.executable, "-m", "tests.interaction.worker", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )

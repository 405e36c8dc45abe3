"""A child process for the crash tests: open a store, drive one tree, maybe die on purpose.

Run from the project root::

    python -m tests.crash.worker STORE_URL CALL_LOG ACTION --program KIND --start-id ID [options]

Actions:

* ``start``    start the Program (``--input`` JSON) and wait for its result;
* ``answer``   answer the root's current wait of a parked tree (``--name``, ``--signal-id``)
               and wait for the result (this process adopts the tree to admit the answer);
* ``resolve``  recover the tree, resolve its only unknown Effect with ``{"value": --value}``
               and wait for the result;
* ``race``     recover the tree in a race with another worker (see ``--barrier``).

``--crash POINT`` passes ``CrashPlan.parse(POINT)`` to the Runtime: the process then ends
with ``os._exit(75)`` at that point. Exit codes: 0 the action finished (a JSON summary on
stdout), 75 the crash plan fired, 3 a fencing error (``{"fenced": code}`` on stdout),
4 any other error (traceback on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import CrashPlan, Runtime
from agentfold.domain.errors import Fenced
from agentfold.domain.ids import SignalID, TreeID
from agentfold.domain.program import SignalRequest
from agentfold.domain.requests import Settlement
from tests.crash import programs

FENCED_EXIT = 3
ERROR_EXIT = 4


class GrantAllLeases:
    """A lease manager that never refuses: ownership is then decided by version fencing alone."""

    exclusive = False  # two live holders race: the version fence decides (Runtime._activated_by_the_dead)

    def __init__(self) -> None:
        self._held: set[TreeID] = set()

    def acquire(self, tree_id: TreeID) -> bool:
        self._held.add(tree_id)
        return True

    def release(self, tree_id: TreeID) -> None:
        self._held.discard(tree_id)

    def holds(self, tree_id: TreeID) -> bool:
        return tree_id in self._held

    def check(self) -> set[TreeID]:
        return set()

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        self._held.clear()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.005)


def recover_when_free(runtime: Runtime, tree_id: TreeID, timeout: float = 10.0) -> None:
    """Recover ``tree_id``, waiting while a dead owner's lease is still being released.

    The operating system (SQLite lock file) or the server (PostgreSQL session) frees a
    dead process's lease; the server may notice the closed connection a moment later.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            runtime.recover(str(tree_id))
            return
        except Fenced as exc:
            if exc.code != "engine.tree.owned" or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def emit(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data, sort_keys=True) + "\n")
    sys.stdout.flush()


def hold_first_append(store: EventStore, barrier: Path, name: str, parties: int) -> None:
    """Make this process's first append wait until every racer has reached its first append.

    Every racer has then loaded the same version before anyone appends, so the race
    is decided by the store's version check, not by timing.
    """
    original = store.append
    state = {"first": True}

    def append(*args: Any, **kwargs: Any) -> Any:
        if state["first"]:
            state["first"] = False
            (barrier / f"append-{name}").touch()
            wait_for(lambda: len(list(barrier.glob("append-*"))) >= parties, 20, "every racer to reach its append")
        return original(*args, **kwargs)

    store.append = append  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.crash.worker")
    parser.add_argument("store_url")
    parser.add_argument("call_log")
    parser.add_argument("action", choices=["start", "answer", "resolve", "race"])
    parser.add_argument("--program", required=True, choices=programs.PROGRAMS)
    parser.add_argument("--start-id", required=True)
    parser.add_argument("--input", default="null", help="JSON input for start")
    parser.add_argument("--crash", default=None, help="a CrashPlan point")
    parser.add_argument("--name", default="ada", help="the answer for `answer`")
    parser.add_argument("--signal-id", default="answer-1")
    parser.add_argument("--value", type=int, default=10, help="the resolution value for `resolve`")
    parser.add_argument("--barrier", default=None, help="race: directory of ready/go/stop files")
    parser.add_argument("--racer", default="a", help="race: this racer's name")
    parser.add_argument("--no-lease", action="store_true", help="race: grant every lease (version fencing decides)")
    args = parser.parse_args(argv)

    store = EventStore(args.store_url)
    plan = CrashPlan.parse(args.crash) if args.crash else None
    runtime = Runtime(store, programs.catalog(args.program, args.call_log), crash=plan, poll_interval=0.05)
    tree_id = TreeID.for_start(args.start_id)  # type: ignore[arg-type]
    try:
        if args.action == "start":
            program = programs.build(args.program, args.call_log)
            handle = runtime.start(program, json.loads(args.input), start_id=args.start_id)
            result = handle.result(timeout=30)
            emit({"status": result.status, "output": result.output})
        elif args.action == "answer":
            tree = runtime.capture(tree_id)
            root = tree.root
            accepted = runtime.deliver_signals(
                root.process_id, [SignalRequest(SignalID(args.signal_id), {"name": args.name}, root.current_wait)]
            )
            result = runtime.result(tree_id, timeout=30)
            emit({"accepted": accepted, "status": result.status, "output": result.output})
        elif args.action == "resolve":
            recover_when_free(runtime, tree_id)
            tree = runtime.wait_idle(tree_id)
            unknown = [r.effect_id for p in tree.processes.values() for r in p.unknown_effects()]
            if len(unknown) != 1:
                raise AssertionError(f"expected exactly one unknown effect, found {unknown}")
            runtime.resolve_unknown_effect(unknown[0], Settlement.succeeded({"value": args.value}))
            result = runtime.result(tree_id, timeout=30)
            emit({"resolved": unknown[0], "status": result.status, "output": result.output})
        else:
            return race(runtime, store, tree_id, args)
    except Fenced as exc:
        emit({"fenced": exc.code, "message": exc.message})
        return FENCED_EXIT
    except BaseException:  # noqa: BLE001 - report every other failure to the test
        traceback.print_exc()
        return ERROR_EXIT
    finally:
        # Only reached when the crash plan did not fire (os._exit skips it).
        runtime.close()
        store.close()
    return 0


def race(runtime: Runtime, store: EventStore, tree_id: TreeID, args: argparse.Namespace) -> int:
    """Recover ``tree_id`` at the same moment as another racer; the winner holds on until told to stop."""
    assert args.barrier, "race needs --barrier"
    barrier = Path(args.barrier)
    if args.no_lease:
        runtime._leases = GrantAllLeases()  # type: ignore[assignment]
        hold_first_append(store, barrier, args.racer, parties=2)
    made: list[Any] = []  # the incarnation ids this runtime drew (its activation's is the last)
    draw = runtime.ids.incarnation_id

    def incarnation_id() -> Any:
        made.append(draw())
        return made[-1]

    runtime.ids.incarnation_id = incarnation_id  # type: ignore[method-assign]
    (barrier / f"ready-{args.racer}").touch()
    wait_for(lambda: (barrier / "go").exists(), 20, "the go signal")
    runtime.recover(str(tree_id))  # raises Fenced for the loser
    if runtime.appends == 0:
        # The winner adopted the tree, finished it and gave up its lease before this racer
        # looked: recover found a terminal tree and adopted nothing. Lost all the same.
        emit({"fenced": "finished", "message": "the tree was already finished by the winner"})
        return FENCED_EXIT
    # Won: its activation was appended. (Its owner line may already have finished the
    # two-effect tree and let it go, so the incarnation is not read from a driver.)
    emit({"won": args.racer, "incarnation": str(made[-1])})
    result = runtime.result(tree_id, timeout=30)
    emit({"status": result.status, "output": result.output})
    # Keep the lease until the test has seen the loser stop: a winner that left early
    # would let the loser adopt the tree afterwards (a sequential recovery, not a race).
    wait_for(lambda: (barrier / "stop").exists(), 30, "the stop signal")
    return 0


if __name__ == "__main__":
    sys.exit(main())

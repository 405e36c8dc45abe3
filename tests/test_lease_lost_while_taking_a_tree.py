"""An owner lease lost while its tree is being taken (started or adopted) on PostgreSQL.

The lease is a session advisory lock; here its session really ends (``pg_terminate_backend``)
inside the window between acquiring the lease and registering the tree's owner line, after
the runtime's watcher noticed the loss (it then found no owner line to stop). The runtime
must not drive the tree without a lease: no dispatcher call happens while the lease is not
held, and the tree is adopted again (a new ``WriterActivated``) once a new session works,
then runs to completion.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.leases import _advisory_key
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import EngineCode
from agentfold.domain.events import WriterActivated
from agentfold.domain.ids import TreeID
from agentfold.domain.program import Program, Replay
from agentfold.domain.requests import Settlement
from tests.kernel_programs import chain_program

EFFECTS = 3


class LeaseWitness:
    """A dispatcher that records, at each call, whether its runtime holds the tree's lease."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay  # seconds each call takes
        self.runtime: Runtime | None = None
        self.calls: list[bool] = []
        self.effects: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, request: Any, context: Any) -> Settlement:
        assert self.runtime is not None
        with self.lock:
            self.calls.append(self.runtime._leases.holds(request.tree_id))
            self.effects.append(str(request.effect_id))
        time.sleep(self.delay)
        return Settlement.succeeded({"value": 1})


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _terminate_lease_session(runtime: Runtime, url: str) -> None:
    """End the runtime's owner-lease session on the server, as a failover or an administrator does."""
    pid = runtime._leases._conn.info.backend_pid  # type: ignore[attr-defined]
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


def _end_lease_session(
    runtime: Runtime, url: str, tree_id: Callable[[], TreeID], real: Callable[..., Any], *, after: bool,
    hold: Callable[[], None] | None = None,
) -> Callable[..., Any]:
    """``real``, wrapped: once, before it (``after=False``) or after it returned, the lease
    session is terminated and the caller is held up by ``hold``: by default until the watcher
    saw the loss, and then for many more watcher polls (as a lost commit reply and its retry
    would hold it up)."""
    done = threading.Event()

    def end_it() -> None:
        leases = runtime._leases
        target = tree_id()
        assert leases.holds(target)
        _terminate_lease_session(runtime, url)
        if hold is not None:
            hold()
            return
        _wait(lambda: not leases.holds(target), 10, "the watcher to notice the ended lease session")
        time.sleep(0.5)  # the watcher must not adopt the tree meanwhile

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        first = not done.is_set()
        done.set()
        if first and not after:
            end_it()
        result = real(*args, **kwargs)
        if first and after:
            end_it()
        return result

    return wrapped


def _finished(store: EventStore, tree_id: TreeID) -> bool:
    head = store.head(tree_id)
    return head is not None and head.status == "completed"


def _activations(store: EventStore, tree_id: TreeID) -> int:
    return sum(isinstance(r.event, WriterActivated) for r in store.read(tree_id))


def _running_watcher(runtime: Runtime, program: Program, witness: LeaseWitness) -> None:
    """Start (and finish) one tree so that the runtime's watcher thread runs; ``witness``
    then watches ``runtime``'s calls, from none."""
    witness.runtime = runtime
    runtime.start(program, {"n": 1}, start_id="warm-up").result(timeout=30)
    witness.calls.clear()
    witness.effects.clear()


def test_a_lease_lost_while_a_tree_starts_stops_it_until_it_is_adopted_again(pg_database: str) -> None:
    witness = LeaseWitness()
    # same_identity: the permission committed at the start is called once the tree is adopted
    # again (with ``never`` it would settle unknown: nothing can tell it was never called).
    program = chain_program(witness, replay=Replay.SAME_IDENTITY, name="test.lease.chain")
    store = EventStore(pg_database)
    with Runtime(store, Catalog([program]), poll_interval=0.02) as runtime:
        _running_watcher(runtime, program, witness)
        target = TreeID.for_start("lease-lost-at-start")  # type: ignore[arg-type]
        # after the append committed, before the owner line is registered
        store.append = _end_lease_session(runtime, pg_database, lambda: target, store.append, after=True)  # type: ignore[method-assign]
        handle = runtime.start(program, {"n": EFFECTS}, start_id="lease-lost-at-start")
        assert handle.tree_id == target
        _wait(lambda: _finished(store, target), 30, "the tree to be adopted again and finish")
    assert witness.calls == [True] * EFFECTS, "a dispatcher was called while the lease was not held"
    assert len(set(witness.effects)) == EFFECTS, "an Effect was called twice"
    assert _activations(store, target) == 1  # adopted again by the same runtime, under a new lease
    store.close()


def test_a_never_effect_permitted_by_a_start_whose_lease_was_lost_is_never_called_and_becomes_unknown(
    pg_database: str,
) -> None:
    """The same loss with replay ``never``: the permission the start committed is decided as
    after a crash when the tree is adopted again: unknown (``engine.dispatch.interrupted``),
    not called; the host's resolution then lets the run finish."""
    witness = LeaseWitness()
    program = chain_program(witness, replay=Replay.NEVER, name="test.lease.chain.never")
    store = EventStore(pg_database)
    with Runtime(store, Catalog([program]), poll_interval=0.02) as runtime:
        _running_watcher(runtime, program, witness)
        target = TreeID.for_start("lease-lost-at-start-never")  # type: ignore[arg-type]
        store.append = _end_lease_session(runtime, pg_database, lambda: target, store.append, after=True)  # type: ignore[method-assign]
        handle = runtime.start(program, {"n": EFFECTS}, start_id="lease-lost-at-start-never")
        _wait(lambda: _activations(store, target) == 1, 30, "the tree to be adopted again")
        # The activation is stored before its owner line is registered; until then wait_idle
        # reports the line that lost its lease (a CI run under load met that window).
        _wait(lambda: target in runtime._drivers, 30, "the new owner line")
        tree = runtime.wait_idle(target, timeout=30)
        unknown = [e for p in tree.processes.values() for e in p.unknown_effects()]
        assert len(unknown) == 1 and unknown[0].diagnostic is not None, unknown
        assert unknown[0].diagnostic.code == EngineCode.DISPATCH_INTERRUPTED
        assert witness.calls == [], "the permission committed without a lease was called"
        runtime.resolve_unknown_effect(unknown[0].effect_id, Settlement.succeeded({"value": 1}))
        assert handle.result(timeout=30).status == "completed"
    assert witness.calls == [True] * (EFFECTS - 1), "a dispatcher was called while the lease was not held"
    assert unknown[0].effect_id not in witness.effects
    assert _activations(store, target) == 1
    store.close()


def test_the_watcher_does_not_adopt_a_tree_whose_start_is_still_registering_its_owner_line(
    pg_database: str,
) -> None:
    """The same window, with every chance for the watcher to adopt the tree before the start
    registers its owner line: the start is held up until the watcher's owner line, if there
    is one, is inside its first call (each call takes a while), at most 2 s. The watcher must
    wait for the start (it takes the tree's adoption lock, as the start does); had it adopted
    the tree, the start's owner line would call the first Effect a second time."""
    witness = LeaseWitness(delay=0.3)
    program = chain_program(witness, replay=Replay.SAME_IDENTITY, name="test.lease.chain.slow")
    store = EventStore(pg_database)
    with Runtime(store, Catalog([program]), poll_interval=0.02) as runtime:
        _running_watcher(runtime, program, witness)
        target = TreeID.for_start("lease-lost-while-registering")  # type: ignore[arg-type]

        def until_called_or_2_s() -> None:
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and not witness.effects:
                time.sleep(0.005)

        store.append = _end_lease_session(  # type: ignore[method-assign]
            runtime, pg_database, lambda: target, store.append, after=True, hold=until_called_or_2_s
        )
        runtime.start(program, {"n": EFFECTS}, start_id="lease-lost-while-registering")
        _wait(lambda: _finished(store, target), 30, "the tree to be adopted again and finish")
        time.sleep(1)  # a second owner line's calls would come meanwhile
    assert len(witness.effects) == len(set(witness.effects)) == EFFECTS, "an Effect was called twice"
    assert witness.calls == [True] * EFFECTS, "a dispatcher was called while the lease was not held"
    assert _activations(store, target) == 1
    store.close()


def test_a_lease_lost_while_a_tree_is_adopted_stops_it_until_it_is_adopted_again(pg_database: str) -> None:
    store = EventStore(pg_database)
    # A tree with an Effect in flight and no owner: its owner let it go during the call.
    gate, calling = threading.Event(), threading.Event()

    def blocked(request: Any, context: Any) -> Settlement:
        calling.set()
        gate.wait(30)
        return Settlement.succeeded({"value": 1})

    name = "test.lease.replayed"
    with Runtime(store, Catalog([chain_program(blocked, replay=Replay.SAME_IDENTITY, name=name)])) as first:
        handle = first.start(chain_program(blocked, replay=Replay.SAME_IDENTITY, name=name), {"n": EFFECTS},
                             start_id="lease-lost-at-adoption")
        assert calling.wait(30)
        first.release(handle.tree_id)
        gate.set()
    target = handle.tree_id
    witness = LeaseWitness()
    program = chain_program(witness, replay=Replay.SAME_IDENTITY, name=name)
    with Runtime(store, Catalog([program]), poll_interval=0.02) as runtime:
        _running_watcher(runtime, program, witness)
        runtime._load = _end_lease_session(runtime, pg_database, lambda: target, runtime._load, after=False)  # type: ignore[method-assign]
        runtime.recover(str(target))
        _wait(lambda: _finished(store, target), 30, "the tree to be adopted again and finish")
    # The in-flight Effect is called again (same_identity) only once the tree is adopted again.
    assert witness.calls == [True] * EFFECTS, "a dispatcher was called while the lease was not held"
    assert _activations(store, target) == 2
    store.close()


def test_two_starts_of_one_start_id_at_once_make_one_owner_line(tmp_path: Any) -> None:
    """A start id started again (a retried request) while its first start is between its append
    and registering its owner line: the second start waits for it and returns the same run; the
    tree is never adopted (no WriterActivated), and no call is recorded unknown."""
    store = EventStore(f"sqlite:///{tmp_path / 'starts.db'}")
    witness = LeaseWitness()
    program = chain_program(witness, name="test.lease.same-start")
    target = TreeID.for_start("same-start")  # type: ignore[arg-type]
    committed = threading.Event()
    real = store.append

    def append(tree_id: TreeID, *args: Any, **kwargs: Any) -> Any:
        result = real(tree_id, *args, **kwargs)
        if tree_id == target and not committed.is_set():
            committed.set()
            time.sleep(0.5)  # the first start is held up right after its commit
        return result

    store.append = append  # type: ignore[method-assign]
    with Runtime(store, Catalog([program]), poll_interval=0.02) as runtime:
        witness.runtime = runtime
        handles: list[Any] = []
        first = threading.Thread(target=lambda: handles.append(runtime.start(program, {"n": EFFECTS}, start_id="same-start")))
        first.start()
        assert committed.wait(10)
        second = runtime.start(program, {"n": EFFECTS}, start_id="same-start")
        first.join(10)
        assert second.tree_id == handles[0].tree_id == target
        assert second.result(timeout=30).status == "completed"
    assert _activations(store, target) == 0
    assert len(witness.effects) == len(set(witness.effects)) == EFFECTS
    assert not any(getattr(r.event, "status", None) == "unknown" for r in store.read(target))
    store.close()


def test_a_lease_lost_again_while_the_tree_is_adopted_again_is_adopted_once_more(pg_database: str) -> None:
    """The lease is lost while the tree runs; the watcher adopts it again, and the new lease
    session ends too, right after that adoption's ``WriterActivated`` committed (another run's
    start meets the dead session first), while the ended backend's lock still blocks a new
    session for a moment. The tree must be adopted once more and finish: the activation it
    finds after its first owner line's end is its own, not a peer's take-over."""
    witness = LeaseWitness(delay=0.2)
    program = chain_program(witness, replay=Replay.SAME_IDENTITY, name="test.lease.lost.twice")
    store = EventStore(pg_database)
    with Runtime(store, Catalog([program]), poll_interval=0.02) as runtime:
        _running_watcher(runtime, program, witness)
        target = TreeID.for_start("lease-lost-twice")  # type: ignore[arg-type]
        leases = runtime._leases
        blocker = psycopg.connect(pg_database, autocommit=True)
        held_for_a_while = threading.Event()
        real = store.append

        def append(tree_id: TreeID, expected: int, events: Any, **kwargs: Any) -> Any:
            result = real(tree_id, expected, events, **kwargs)
            if tree_id == target and not held_for_a_while.is_set() and any(isinstance(e, WriterActivated) for e in events):
                held_for_a_while.set()
                _terminate_lease_session(runtime, pg_database)
                # Another run starts meanwhile: its lease meets the dead session (the loss is
                # noticed) and opens a new one.
                # (a start id whose tree does not share the target's adoption lock, held here)
                locks = runtime._adopt_locks
                meanwhile = next(f"meanwhile-{i}" for i in range(100) if hash(TreeID.for_start(f"meanwhile-{i}")) % len(locks)  # type: ignore[arg-type]
                                 != hash(target) % len(locks))
                other = threading.Thread(target=lambda: runtime.start(program, {"n": 1}, start_id=meanwhile))
                other.start()
                _wait(lambda: not leases.holds(target), 10, "the loss to be noticed")
                # The ended backend's lock, as the server may keep it a moment longer.
                blocker.execute("SELECT pg_advisory_lock(%s)", (_advisory_key(target),))
                threading.Timer(1.0, lambda: blocker.execute("SELECT pg_advisory_unlock(%s)", (_advisory_key(target),))).start()
                other.join(10)
            return result

        store.append = append  # type: ignore[method-assign]
        runtime.start(program, {"n": EFFECTS}, start_id="lease-lost-twice")
        _wait(lambda: bool(witness.effects), 10, "the first call")
        _terminate_lease_session(runtime, pg_database)
        _wait(lambda: _finished(store, target), 30, "the tree to be adopted once more and finish")
        blocker.close()
    assert held_for_a_while.is_set()
    assert _activations(store, target) == 2
    assert all(witness.calls), "a dispatcher was called while the lease was not held"
    store.close()

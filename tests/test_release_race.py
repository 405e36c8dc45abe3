"""A tree given up by its owner line while the same runtime takes it again keeps an owner.

A runtime's owner leases are re-entrant: asking for a lease it holds, it gets it. When an
owner line stops (``Runtime.release``, a store failure, a lost race), it leaves the
runtime's owner lines and then gives its lease back. Another thread of the same runtime
taking the tree meanwhile (input admitted for it, ``recover``, an orphan scan) must end
with an owner line of its own holding a lease of its own:

- taken between the line's leaving and the lease's release, it was handed the lease about
  to be given back, and drove the run without one (another runtime could take the same
  run over: two owners);
- taken after the line stopped but before it left, ``recover`` reported the stopping line
  as the tree's owner (nobody drove it afterwards) and input was refused as "released".

Real stores (a SQLite file's lock-file leases, PostgreSQL advisory locks), two runtimes in
one process with their own stores (their own leases); each interleaving is forced by a
hook that runs the other thread at that moment and lets it finish, or waits for it up to
a second when it waits for the giving up to end. Also: a lease this runtime was left
holding by a failed adoption is taken up again by the next orphan scan.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import Fenced, StoreFailure
from agentfold.domain.ids import SignalID
from agentfold.domain.program import SignalRequest
from tests.kernel_programs import CallLog, GatedCall, asker_program, chain_program


@contextmanager
def two_runtimes(url: str, name: str) -> Iterator[tuple[Runtime, Runtime, Any]]:
    """An owner driving a parked asker run, a peer runtime on the same store, the run's handle."""
    program = asker_program(name)
    owner = Runtime(EventStore(url), Catalog([program]), poll_interval=0)
    peer = Runtime(EventStore(url), Catalog([program]), poll_interval=0)
    try:
        handle = owner.start(program, {}, start_id=name)
        assert owner.wait_idle(handle.tree_id, timeout=30).classification() == "parked"
        yield owner, peer, handle
    finally:
        owner.close()
        peer.close()
        owner.store.close()
        peer.store.close()


def run_inside(target: Callable[[], Any], outcome: list[Any], threads: list[threading.Thread]) -> None:
    """Run ``target`` on another thread now; its value or exception goes to ``outcome``. Waits
    for it up to a second (it may wait for the caller's own giving up to end)."""

    def call() -> None:
        try:
            outcome.append(target())
        except Exception as exc:  # noqa: BLE001 - reported by the assertions
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    threads.append(thread)
    thread.start()
    thread.join(1.0)


def release_with(owner: Runtime, tree_id: Any, hook_point: str, target: Callable[[], Any]) -> Any:
    """``owner.release(tree_id)`` with ``target`` run on another thread at ``hook_point``:
    ``"stopped"`` (the owner line has stopped and has not left yet) or ``"lease"`` (it has left
    and its lease is being given back). ``target``'s outcome."""
    outcome: list[Any] = []
    threads: list[threading.Thread] = []
    if hook_point == "lease":
        real_release = owner._leases.release

        def release(tree: Any) -> None:
            if tree == tree_id and not threads:
                run_inside(target, outcome, threads)
            real_release(tree)

        owner._leases.release = release  # type: ignore[method-assign]
    else:
        real_give_back = owner._slots.give_back_reserved

        def give_back(driver: Any, *, leave: bool = False) -> None:
            # The first thing a stopping owner line does after it is marked stopped.
            if driver.tree_id == tree_id and driver.stopped is not None and not threads:
                run_inside(target, outcome, threads)
            real_give_back(driver, leave=leave)

        owner._slots.give_back_reserved = give_back  # type: ignore[method-assign]
    owner.release(tree_id)
    assert threads, f"the hook at {hook_point!r} never ran"
    threads[0].join(30)
    assert not threads[0].is_alive()
    [value] = outcome
    assert not isinstance(value, BaseException), repr(value)
    return value


def answer(runtime: Runtime, handle: Any, signal: str, wait: Any = None) -> bool:
    if wait is None:
        wait = runtime.capture(handle.tree_id).processes[handle.root_process_id].current_wait
    return runtime.deliver_signals(handle.root_process_id, [SignalRequest(SignalID(signal), {"name": "n"}, wait)])


def assert_driven_here_only(owner: Runtime, peer: Runtime, handle: Any) -> None:
    """The owner drives the run with its own lease: another runtime cannot take it over."""
    tree_id = handle.tree_id
    assert owner.owns(tree_id)
    with pytest.raises(Fenced) as refused:
        peer.recover(str(tree_id))
    assert refused.value.code == "engine.tree.owned"
    assert not peer.owns(tree_id)


@pytest.mark.parametrize("hook_point", ["lease", "stopped"])
def test_recover_while_the_owner_line_gives_the_tree_up_ends_with_an_owner_holding_its_lease(
    durable_store_url: str, hook_point: str,
) -> None:
    with two_runtimes(durable_store_url, f"release.recover.{hook_point}") as (owner, peer, handle):
        handles = release_with(owner, handle.tree_id, hook_point, lambda: owner.recover(str(handle.tree_id)))
        assert [h.tree_id for h in handles] == [handle.tree_id]
        assert_driven_here_only(owner, peer, handle)
        assert answer(owner, handle, "answer")
        assert owner.result(handle.tree_id, timeout=30).output == {"hello": "n"}


@pytest.mark.parametrize("hook_point", ["lease", "stopped"])
def test_input_while_the_owner_line_gives_the_tree_up_is_admitted_and_driven(
    durable_store_url: str, hook_point: str,
) -> None:
    with two_runtimes(durable_store_url, f"release.input.{hook_point}") as (owner, peer, handle):
        # The wait is read first: a capture during the release would wait for the release to end.
        wait = owner.capture(handle.tree_id).processes[handle.root_process_id].current_wait
        assert release_with(owner, handle.tree_id, hook_point, lambda: answer(owner, handle, "answer", wait)) is True
        assert owner.result(handle.tree_id, timeout=30).output == {"hello": "n"}
        assert not peer.owns(handle.tree_id)


def test_a_lease_left_held_by_a_failed_adoption_is_taken_up_by_the_next_orphan_scan(
    durable_store_url: str, tmp_path: Any,
) -> None:
    """The scan keeps the lease of a parked tree with a call in flight to adopt it; the store
    fails right then (an outage): the lease is given back, and the next scan adopts the tree."""
    gate = GatedCall(CallLog(tmp_path / "calls.jsonl"))
    program = chain_program(gate, name="release.leak")
    owner = Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0)
    try:
        handle = owner.start(program, {"n": 2}, start_id="release-leak")
        assert gate.entered.wait(30)
        owner.pause(handle.root_process_id)
    finally:
        owner.close()
        owner.store.close()
    gate.release.set()
    tree_id = handle.tree_id
    survivor = Runtime(EventStore(durable_store_url), Catalog([program]), poll_interval=0)
    try:
        assert survivor.store.head(tree_id).classification == "parked"  # type: ignore[union-attr]
        real_head = survivor.store.head
        failed: list[bool] = []

        def head(tid: Any) -> Any:
            # Once: the adoption's own read of the index row, right after it took the lease.
            if not failed and sys._getframe(1).f_code.co_name == "_try_adopt":
                failed.append(True)
                raise StoreFailure("store.unavailable", "the store failed for a moment")
            return real_head(tid)

        survivor.store.head = head  # type: ignore[method-assign]
        assert survivor.adopt_orphans() == []  # the store failed inside the adoption
        assert failed
        assert not survivor._leases.holds(tree_id)
        assert survivor.adopt_orphans() == [tree_id]
        assert survivor.owns(tree_id)
    finally:
        survivor.close()
        survivor.store.close()


def test_a_line_stopped_by_a_failure_and_replaced_at_once_leaves_no_stale_failure(durable_store_url: str) -> None:
    """An owner line that stops on a failed append records the failure for ``result()``; a
    ``recover`` at that very moment replaces the line. The failure must not outlive the new
    line's registration (which clears it): ``result()`` reports the run as it ends."""
    with two_runtimes(durable_store_url, "release.failed") as (owner, _peer, handle):
        tree_id = handle.tree_id
        wait = owner.capture(tree_id).processes[handle.root_process_id].current_wait
        line = owner._drivers[tree_id]
        outcome: list[Any] = []
        threads: list[threading.Thread] = []

        class Failures(collections.OrderedDict[Any, Any]):  # as Runtime._failed
            def __setitem__(self, key: Any, value: Any) -> None:
                if key == tree_id and not threads:
                    run_inside(lambda: owner.recover(str(tree_id)), outcome, threads)
                super().__setitem__(key, value)

        owner._failed = Failures()  # type: ignore[assignment]
        line._stop(StoreFailure("store.unavailable", "an append failed for a moment"))  # as a failed append does
        assert threads and not threads[0].is_alive()
        assert answer(owner, handle, "answer", wait)
        assert owner.result(tree_id, timeout=30).output == {"hello": "n"}
        assert owner.wait_idle(tree_id, timeout=30).classification() == "terminal"

"""Two writers for one tree: exactly one owner; the other is fenced and appends nothing.

* Two OS processes recover the same crashed tree at the same moment. With real leases
  the lease decides (``engine.tree.owned``); with leases that grant everything, both
  load the same version and the store's version check decides
  (``engine.tree.incarnation_conflict``).
* In one process, a live owner whose tree is activated behind its back (its lease
  lost) is fenced by the stream version on its next append, independent of the lease.

Only ``WriterActivated`` and ``EffectDispatched`` carry an incarnation id, so "the
loser appended nothing after the winner's activation" is checked on those, together
with exact event counts and the call log.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import Runtime
from agentfold.domain.errors import Fenced
from agentfold.domain.events import EffectDispatched, EffectSettled, SignalAdmitted, TreeEvent, WriterActivated
from agentfold.domain.ids import SignalID
from agentfold.domain.program import SignalRequest
from agentfold.domain.requests import EffectRequest, Settlement
from tests.crash import programs
from tests.crash.support import ROOT, crash, dispatcher_effects, events, tree_of, wait_lease_free
from tests.kernel_programs import CallLog, chain_program


def spawn_racer(store_url: str, log: Path, start_id: str, barrier: Path, name: str, no_lease: bool) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "tests.crash.worker", store_url, str(log), "race", "--program", "chain-same",
            "--start-id", start_id, "--barrier", str(barrier), "--racer", name]
    if no_lease:
        args.append("--no-lease")
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def after_activation(stream: list[TreeEvent]) -> tuple[WriterActivated, list[TreeEvent]]:
    positions = [i for i, e in enumerate(stream) if isinstance(e, WriterActivated)]
    assert len(positions) == 1, f"expected exactly one WriterActivated, found {len(positions)}"
    activation = stream[positions[0]]
    assert isinstance(activation, WriterActivated)
    return activation, stream[positions[0] + 1 :]


@pytest.mark.parametrize("fence", ["lease", "version"])
def test_two_processes_racing_to_recover_one_tree_exactly_one_wins(
    durable_store_url: str, tmp_path: Path, fence: str
) -> None:
    log = tmp_path / "calls.jsonl"
    start_id = "start:race"
    tree_id = tree_of(start_id)
    # A same_identity chain dies right after Effect 1's dispatch permission: whoever
    # recovers it dispatches Effect 1 again, so a second winner would show as a second call.
    crash(durable_store_url, log, "start", "--program", "chain-same", "--start-id", start_id,
          "--input", '{"n": 2}', "--crash", "dispatched:1")
    assert CallLog(log).calls() == []
    wait_lease_free(durable_store_url, tree_id)  # the racers must race each other, not the dead owner
    barrier = tmp_path / "barrier"
    barrier.mkdir()

    racers: dict[str, subprocess.Popen[str]] = {}
    try:
        def ready() -> bool:
            for name, process in racers.items():
                if process.poll() is not None and not (barrier / f"ready-{name}").exists():
                    out, err = process.communicate()
                    raise AssertionError(f"racer {name} ended ({process.returncode}) before the race: {out} {err}")
            return all((barrier / f"ready-{n}").exists() for n in racers)

        # Start the racers one after the other: opening the same PostgreSQL store from two
        # processes at once can fail in schema creation (reported separately); the race
        # under test starts at the go signal, after both are ready.
        for name in "ab":
            racers[name] = spawn_racer(durable_store_url, log, start_id, barrier, name, fence == "version")
            wait_until(ready, 30, f"racer {name} to be ready")
        (barrier / "go").touch()
        # The loser stops on its own; the winner holds its ownership until told to stop.
        wait_until(lambda: any(p.poll() is not None for p in racers.values()), 30, "the loser to stop")
        (loser_name,) = [n for n, p in racers.items() if p.poll() is not None]
        (winner_name,) = [n for n in racers if n != loser_name]
        loser_out, loser_err = racers[loser_name].communicate(timeout=10)
        (barrier / "stop").touch()
        winner_out, winner_err = racers[winner_name].communicate(timeout=30)
    finally:
        for process in racers.values():
            if process.poll() is None:
                process.kill()
                process.wait()

    assert racers[winner_name].returncode == 0, winner_err
    assert racers[loser_name].returncode == 3, f"loser: {loser_out} {loser_err}"
    # With leases the loser meets the winner's lease, or (when it looks only after the
    # winner finished the two-effect tree and let its lease go) a finished tree: either way
    # it adopts nothing, which the stream below shows.
    expected = {"engine.tree.owned", "finished"} if fence == "lease" else {"engine.tree.incarnation_conflict"}
    assert json.loads(loser_out.splitlines()[-1])["fenced"] in expected
    won, finished = (json.loads(line) for line in winner_out.splitlines())
    assert won["won"] == winner_name
    assert finished == {"status": "completed", "output": {"total": 2, "effects": 2}}

    store = EventStore(durable_store_url)
    try:
        stream = events(store, tree_id)
    finally:
        store.close()
    activation, later = after_activation(stream)
    assert str(activation.incarnation_id) == won["incarnation"]
    dispatched_later = [e for e in later if isinstance(e, EffectDispatched)]
    assert len(dispatched_later) == 2  # Effect 1 again, then Effect 2: all by the winner
    assert {str(e.incarnation_id) for e in dispatched_later} == {won["incarnation"]}
    first, second = dispatcher_effects(stream)
    # Effect 1 was called once in all (by the winner), Effect 2 once: the loser called nothing.
    assert [c["effect_id"] for c in CallLog(log).calls()] == [first, second]


def test_an_owner_whose_tree_was_activated_behind_its_back_is_fenced_on_its_next_append(
    store_url: str, tmp_path: Path
) -> None:
    """Version fencing works without the lease: A's lease is dropped, B activates, A's admission fails."""
    log = tmp_path / "calls.jsonl"
    store_a = EventStore(store_url)
    # The memory store lives in one object; durable stores get a connection of their own.
    store_b = store_a if store_url == "memory:" else EventStore(store_url)
    # No watcher on A: A learns about B only through its own next append.
    a = Runtime(store_a, programs.catalog("ask-call", log), poll_interval=0)
    b = Runtime(store_b, programs.catalog("ask-call", log))
    try:
        handle = a.start(programs.build("ask-call", log), None, start_id="start:fence")
        tree_id = handle.tree_id
        parked = a.wait_idle(tree_id)
        assert a.owns(tree_id)
        a._leases.release(tree_id)  # A's lease is lost (say its session dropped); A does not know

        b.recover(str(tree_id))
        version = len(events(store_a, tree_id))
        answer = [SignalRequest(SignalID("answer-1"), {"name": "ada"}, parked.root.current_wait)]
        with pytest.raises(Fenced) as fenced:
            a.deliver_signals(parked.root.process_id, answer)
        assert fenced.value.code == "engine.tree.incarnation_conflict"
        assert not a.owns(tree_id)
        stream = events(store_a, tree_id)
        assert len(stream) == version  # A appended nothing
        assert not any(isinstance(e, SignalAdmitted) for e in stream)

        # The new owner still serves the tree.
        assert b.deliver_signals(parked.root.process_id, answer) is True
        result = b.result(tree_id, timeout=30)
        assert result.output == {"hello": "ada", "value": 7}
        activation, later = after_activation(events(store_a, tree_id))
        assert {e.incarnation_id for e in later if isinstance(e, EffectDispatched)} == {activation.incarnation_id}
        assert sum(isinstance(e, SignalAdmitted) for e in later) == 1
    finally:
        a.close()
        b.close()
        store_a.close()
        if store_b is not store_a:
            store_b.close()


def test_a_fenced_owner_does_not_record_the_late_outcome_of_its_dispatch(store_url: str, tmp_path: Path) -> None:
    """A's dispatch is in flight when B activates the tree; A's late success is never appended."""
    log = CallLog(tmp_path / "calls.jsonl")
    gate = threading.Event()
    entered = threading.Event()

    def gated(request: EffectRequest, context: object) -> Settlement:
        log.record(effect_id=request.effect_id, attempt_id=request.attempt_id, payload=request.payload)
        entered.set()
        gate.wait(30)
        return Settlement.succeeded({"value": 1})

    # Same ProgramRef as programs.build("chain"): the dispatcher is not part of the identity.
    slow_chain = chain_program(gated, name="crash.chain")
    assert slow_chain.ref == programs.build("chain", log.path).ref
    store_a = EventStore(store_url)
    store_b = store_a if store_url == "memory:" else EventStore(store_url)
    a = Runtime(store_a, poll_interval=0)
    b = Runtime(store_b, programs.catalog("chain", log.path))
    try:
        handle = a.start(slow_chain, {"n": 2}, start_id="start:late")
        tree_id = handle.tree_id
        assert entered.wait(10)
        a._leases.release(tree_id)
        b.recover(str(tree_id))
        unknown = b.wait_idle(tree_id).root.unknown_effects()
        assert [r.effect_id for r in unknown] == dispatcher_effects(events(store_a, tree_id))
        version = len(events(store_a, tree_id))
        appends = a.appends

        gate.set()  # A's dispatcher now returns a success A can no longer record
        wait_until(lambda: not a.owns(tree_id), 10, "A to stop driving the tree")
        stream = events(store_a, tree_id)
        assert len(stream) == version
        assert a.appends == appends
        assert not any(isinstance(e, EffectSettled) and e.status == "succeeded" for e in stream)

        b.resolve_unknown_effect(unknown[0].effect_id, Settlement.succeeded({"value": 10}))
        result = b.result(tree_id, timeout=30)
        assert result.output == {"total": 11, "effects": 2}
        assert log.count() == 2  # A's call of Effect 1 (outcome lost to the fence), B's call of Effect 2
        activation, later = after_activation(events(store_a, tree_id))
        assert {e.incarnation_id for e in later if isinstance(e, EffectDispatched)} == {activation.incarnation_id}
    finally:
        gate.set()
        a.close()
        b.close()
        store_a.close()
        if store_b is not store_a:
            store_b.close()


def test_an_owner_that_sees_another_activation_stops_without_appending(store_url: str, tmp_path: Path) -> None:
    """A's watcher folds B's WriterActivated and A stops; A's later input is admitted, not owned, by A."""
    log = tmp_path / "calls.jsonl"
    store_a = EventStore(store_url)
    store_b = store_a if store_url == "memory:" else EventStore(store_url)
    a = Runtime(store_a, programs.catalog("ask-call", log), poll_interval=0.02)
    b = Runtime(store_b, programs.catalog("ask-call", log))
    try:
        handle = a.start(programs.build("ask-call", log), None, start_id="start:watch")
        tree_id = handle.tree_id
        parked = a.wait_idle(tree_id)
        a._leases.release(tree_id)
        b.recover(str(tree_id))
        wait_until(lambda: not a.owns(tree_id), 10, "A to notice the new incarnation and stop")
        activation, later = after_activation(events(store_a, tree_id))
        assert later == []  # A appended nothing after B's activation

        # A may still admit input (any process may), but it does not take the tree back.
        answer = [SignalRequest(SignalID("answer-1"), {"name": "ada"}, parked.root.current_wait)]
        assert a.deliver_signals(parked.root.process_id, answer) is True
        assert not a.owns(tree_id)
        result = b.result(tree_id, timeout=30)
        assert result.output == {"hello": "ada", "value": 7}
        activation_again, later = after_activation(events(store_a, tree_id))
        assert activation_again == activation
        assert {e.incarnation_id for e in later if isinstance(e, EffectDispatched)} == {activation.incarnation_id}
    finally:
        a.close()
        b.close()
        store_a.close()
        if store_b is not store_a:
            store_b.close()

"""The runtime's limit on calls in flight (``Runtime(dispatch_workers=N)``, ``serve
--dispatch-workers N``) is applied where a dispatch permission is granted.

Before, the permission of every declared Effect was committed at once and its call queued
behind the N dispatch threads. An audit of many live runs in one process (200 runs, model
calls of seconds) found what that queue did:

- a run canceled or killed while its call waited in the queue still had the call made
  after it ended (a card charged after ``result()`` said "canceled"), and the call was
  recorded unknown "did not return within the cancellation grace period" before it started;
- a server on SIGTERM started queued calls after the signal, and left the rest unknown
  (a host had to resolve calls that were never made);
- runs were served in waves of N, each to its end (a run keeps its thread for its next call);
- N calls that hang stalled every run of the process for good, canceled or not.

Now an Effect whose call finds no free slot stays declared (no ``EffectDispatched``) and its
run waits in line; slots go to the runs in line in order of arrival.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.dispatch import DispatchContext
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.runtime import RunHandle, Runtime
from agentfold.domain.ids import StartID, TreeID
from agentfold.domain.program import Program
from agentfold.domain.requests import EffectRequest, Settlement
from tests.kernel_programs import CallLog, chain_program


class Calls:
    """A chain dispatcher that logs every call (tree, index) to a file, and holds the calls
    of the trees in ``hold`` until ``release`` is set (``entered`` once one is held)."""

    def __init__(self, path: Path, hold: set[str] | None = None, *, ignore_cancel: bool = False) -> None:
        self.log = CallLog(path)
        self.hold = hold or set()
        self.ignore_cancel = ignore_cancel
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, request: EffectRequest, context: DispatchContext) -> Settlement:
        self.log.record(tree=str(request.tree_id), index=request.payload["index"])
        if str(request.tree_id) in self.hold:
            self.entered.set()
            deadline = time.monotonic() + 30
            # held until ``release`` is set or its tree leaves ``hold``
            while str(request.tree_id) in self.hold and not self.release.is_set() and time.monotonic() < deadline:
                if context.cancelled.is_set() and not self.ignore_cancel:
                    raise TimeoutError("canceled")
                self.release.wait(0.01)
        return Settlement.succeeded({"value": 1})

    def trees(self) -> list[str]:
        return [c["tree"] for c in self.log.calls()]


def kinds(store: EventStore, tree_id: Any) -> list[str]:
    return [type(r.event).__name__ for r in store.read(tree_id)]


def program_with(calls: Calls, name: str) -> Program:
    return chain_program(calls, name=name)


@contextlib.contextmanager
def one_slot_held(
    tmp_path: Path, name: str, *, url: str | None = None, n: int = 1, ignore_cancel: bool = False, **kwargs: Any,
) -> Iterator[tuple[Calls, Program, EventStore, Runtime, RunHandle]]:
    """A runtime with one call slot, held by the run ``<name>-holder`` (a chain of ``n``
    calls) until ``calls.release`` is set."""
    holder_start = f"{name}-holder"
    calls = Calls(tmp_path / "calls.jsonl", {str(TreeID.for_start(StartID(holder_start)))}, ignore_cancel=ignore_cancel)
    program = program_with(calls, f"slots.{name}")
    store = EventStore(url or f"sqlite:///{tmp_path / (name + '.db')}")
    runtime = Runtime(store, Catalog([program]), poll_interval=0, dispatch_workers=1, **kwargs)
    try:
        holder = runtime.start(program, {"n": n}, start_id=holder_start)
        assert calls.entered.wait(30)
        yield calls, program, store, runtime, holder
    finally:
        calls.release.set()
        runtime.close()
        store.close()


def test_a_run_canceled_while_its_call_waits_for_a_slot_never_has_it_made(durable_store_url: str, tmp_path: Path) -> None:
    with one_slot_held(tmp_path, "cancel", url=durable_store_url) as (calls, program, store, runtime, a):
        b = runtime.start(program, {"n": 1}, start_id="slots-waiter")
        # B's Effect is declared, not permitted: nothing was promised to a dispatcher.
        assert kinds(store, b.tree_id)[-1] == "EffectDeclared"
        assert runtime.runs_waiting_for_calls() == 1 and runtime.dispatches_running() == 1
        runtime.cancel(b.root_process_id)
        assert b.result(30).status == "canceled"
        calls.release.set()
        assert a.result(30).status == "completed"
        time.sleep(0.3)  # a call B still had queued would have been made by now
        b_events = kinds(store, b.tree_id)
        assert calls.trees() == [str(a.tree_id)], calls.log.calls()  # B's call was never made
        assert "EffectDispatched" not in b_events and "EffectSettled" not in b_events, b_events
        head = store.head(b.tree_id)
        assert head is not None and not head.unknown_effect_ids  # nothing for a host to resolve


def test_runs_waiting_for_a_slot_take_turns_call_by_call(tmp_path: Path) -> None:
    with one_slot_held(tmp_path, "turns", n=3) as (calls, program, _store, runtime, a):
        b = runtime.start(program, {"n": 3}, start_id="turns-b")
        c = runtime.start(program, {"n": 3}, start_id="turns-c")
        calls.hold.clear()
        calls.release.set()
        for handle in (a, b, c):
            assert handle.result(30).status == "completed"
        names = {str(a.tree_id): "a", str(b.tree_id): "b", str(c.tree_id): "c"}
        order = "".join(names[t] for t in calls.trees())
    # One call at a time, each run in its turn; before, run a made all its calls first ("aaabbbccc").
    assert order == "abcabcabc", order


def test_a_draining_owner_leaves_a_waiting_call_declared_and_the_next_owner_makes_it(
    durable_store_url: str, tmp_path: Path,
) -> None:

    holder = str(TreeID.for_start(StartID("drain-holder")))
    calls = Calls(tmp_path / "calls.jsonl", {holder})
    program = program_with(calls, "slots.drain")
    store = EventStore(durable_store_url)
    runtime = Runtime(store, Catalog([program]), poll_interval=0, dispatch_workers=1)
    a = runtime.start(program, {"n": 1}, start_id="drain-holder")
    assert calls.entered.wait(30)
    b = runtime.start(program, {"n": 2}, start_id="drain-waiter")
    drained: list[bool] = []
    draining = threading.Thread(target=lambda: drained.append(runtime.drain(10.0)))
    draining.start()
    time.sleep(0.2)
    calls.release.set()  # A's call returns during the drain: recorded; B gets the slot but may not use it
    draining.join(30)
    runtime.close()
    assert drained == [True]
    assert calls.trees() == [holder]  # nothing started after the drain began
    b_events = kinds(store, b.tree_id)
    assert b_events[-1] == "EffectDeclared" and "EffectDispatched" not in b_events, b_events
    assert kinds(store, a.tree_id)[-1] == "ProcessTerminated"
    calls.hold.clear()
    with Runtime(store, Catalog([program]), poll_interval=0, dispatch_workers=1) as next_owner:
        assert len(next_owner.recover(b.tree_id)) == 1
        result = next_owner.result(b.tree_id, timeout=30)
    assert result.status == "completed" and result.output == {"total": 2, "effects": 2}
    head = store.head(b.tree_id)
    assert head is not None and not head.unknown_effect_ids  # the waiting call was never unknown
    assert calls.trees().count(str(b.tree_id)) == 2
    store.close()


def test_a_call_abandoned_after_the_grace_gives_its_slot_back(tmp_path: Path) -> None:
    with one_slot_held(tmp_path, "hung", ignore_cancel=True, cancel_grace=0.2) as (calls, program, _store, runtime, a):
        b = runtime.start(program, {"n": 1}, start_id="behind-the-hung-call")
        runtime.cancel(a.root_process_id)
        # The hung dispatcher never returns; after the grace its call is recorded unknown and
        # its slot goes to B (before, the only dispatch thread stayed stuck and B never ran).
        assert b.result(30).status == "completed"
        assert a.result(30).status == "canceled"
        assert calls.trees() == [str(a.tree_id), str(b.tree_id)]


def test_the_limit_is_checked() -> None:
    import pytest

    from agentfold.domain.errors import InvalidInput

    store = EventStore("memory:")
    for bad in (0, -1, 5000, "3", 2.0, True):
        with pytest.raises(InvalidInput, match="dispatch_workers") as refused:
            Runtime(store, dispatch_workers=bad)
        assert refused.value.code == "runtime.invalid"
    store.close()


def test_a_released_owner_line_gives_back_the_slot_of_its_hung_call(tmp_path: Path) -> None:
    """``Runtime.release`` (as a lost lease or a fence) abandons the line's calls: nobody here
    records them now, so a dispatcher that never returns must not keep a call slot."""
    with one_slot_held(tmp_path, "released", ignore_cancel=True, cancel_grace=0.2) as (_calls, program, _s, runtime, a):
        runtime.release(a.tree_id)
        b = runtime.start(program, {"n": 1}, start_id="after-the-release")
        assert b.result(30).status == "completed"  # before: B waited until the hung call returned


def test_an_activation_that_loses_its_race_while_waiting_for_a_slot_appends_nothing(tmp_path: Path) -> None:
    """A runtime at its limit adopts a tree (``recover``): the activation's owner line waits in
    line for a slot. During its append, another writer appends to the tree (the activation
    conflicts and retries with a new line) and a call returns, handing its slot to the first
    line. That line is discarded; before, the wake-up that came with the slot still ran it,
    and it drove the tree beside the new line (same incarnation): a call made twice, or the
    new line's lease released and a never-made call left unknown."""
    import agentfold.adapters.runtime as rt
    from agentfold.domain.events import WriterActivated

    holder = str(TreeID.for_start(StartID("race-holder")))
    calls = Calls(tmp_path / "calls.jsonl", {holder})
    program = program_with(calls, "slots.race")
    url = f"sqlite:///{tmp_path / 'race.db'}"
    first = EventStore(url)
    with Runtime(first, Catalog([program]), poll_interval=0) as starter:
        starter.stop_dispatching()  # B: its Effect declared, not permitted, nobody owns it
        b = starter.start(program, {"n": 1}, start_id="race-b")
    first.close()

    appends: list[tuple[bool, list[str]]] = []  # to B: (by the registered line?, event kinds)
    original_append = rt._Driver._append

    def traced_append(self: Any, events: list[Any]) -> None:
        if self.tree_id == b.tree_id:
            appends.append((self.runtime._drivers.get(self.tree_id) is self, [type(e).__name__ for e in events]))
        original_append(self, events)

    store, other_store = EventStore(url), EventStore(url)
    runtime = Runtime(store, Catalog([program]), poll_interval=0, dispatch_workers=1)
    other = Runtime(other_store, Catalog([program]), poll_interval=0, adopt_on_admit=False)
    rt._Driver._append = traced_append  # type: ignore[method-assign]
    try:
        runtime.start(program, {"n": 1}, start_id="race-holder")
        assert calls.entered.wait(30)
        store_append = store.append
        raced = threading.Event()

        def racing_append(tree_id: Any, expected: int, events: list[Any], **kw: Any) -> Any:
            if tree_id == b.tree_id and not raced.is_set() and any(isinstance(e, WriterActivated) for e in events):
                raced.set()
                other.pause(b.root_process_id)  # another writer appends: this append will conflict
                other.resume(b.root_process_id)
                calls.release.set()  # the holder's call returns: its slot goes to the activating line
                deadline = time.monotonic() + 10
                while not runtime._slots._reserved and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert runtime._slots._reserved, "the slot was not handed to the activating line"
            return store_append(tree_id, expected, events, **kw)

        store.append = racing_append  # type: ignore[method-assign,assignment]
        assert len(runtime.recover(str(b.tree_id))) == 1
        assert raced.is_set()
        assert runtime.result(b.tree_id, 30).status == "completed"
        time.sleep(0.3)  # a discarded line's wake-up would have run by now
    finally:
        rt._Driver._append = original_append  # type: ignore[method-assign]
        runtime.close()
        other.close()
    # Only the activation (WriterActivated) comes from a line not yet registered.
    strays = [kinds for registered, kinds in appends if not registered and "WriterActivated" not in kinds]
    assert not strays, appends
    assert calls.trees().count(str(b.tree_id)) == 1
    head = store.head(b.tree_id)
    assert head is not None and not head.unknown_effect_ids
    store.close()
    other_store.close()


def test_a_paused_run_leaves_the_line(tmp_path: Path) -> None:
    with one_slot_held(tmp_path, "pause") as (calls, program, _store, runtime, _holder):
        b = runtime.start(program, {"n": 1}, start_id="pause-b")
        assert runtime.runs_waiting_for_calls() == 1
        runtime.pause(b.root_process_id)
        assert runtime.wait_idle(b.tree_id, 10).root.status == "paused"
        assert runtime.runs_waiting_for_calls() == 0  # a paused run waits for nobody's call
        calls.release.set()
        runtime.resume(b.root_process_id)
        assert b.result(30).status == "completed"


def test_past_the_spare_threads_an_abandoned_call_keeps_its_slot(tmp_path: Path, monkeypatch: Any) -> None:
    """An abandoned call gives its slot back while its dispatcher runs on, on one of the pool's
    spare threads (256). Once they are all taken by hung calls, another abandoned call keeps
    its slot until its dispatcher returns: a permission granted then would find no thread,
    and its call waited in the pool's queue (canceled meanwhile: recorded unknown although
    never started, then made after its run ended). Here with 1 spare thread."""
    import agentfold.adapters.runtime as rt

    monkeypatch.setattr(rt, "SPARE_DISPATCH_THREADS", 1)
    with one_slot_held(tmp_path, "spare", ignore_cancel=True, cancel_grace=0.2) as (calls, program, store, runtime, a):
        calls.hold.update({str(TreeID.for_start(StartID("spare-second")))})
        runtime.cancel(a.root_process_id)  # abandoned after the grace: its slot goes back (1 spare thread used)
        assert a.result(30).status == "canceled"
        b = runtime.start(program, {"n": 1}, start_id="spare-second")
        deadline = time.monotonic() + 30
        while calls.trees().count(str(b.tree_id)) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        runtime.cancel(b.root_process_id)  # abandoned too, but no spare thread is left: it keeps its slot
        assert b.result(30).status == "canceled"
        c = runtime.start(program, {"n": 1}, start_id="spare-third")
        time.sleep(0.3)
        assert "EffectDispatched" not in kinds(store, c.tree_id)  # waits in line, nothing promised
        runtime.cancel(c.root_process_id)
        assert c.result(30).status == "canceled"
        calls.release.set()  # the hung dispatchers return
        d = runtime.start(program, {"n": 1}, start_id="spare-fourth")
        assert d.result(30).status == "completed"
        time.sleep(0.3)
        assert str(c.tree_id) not in calls.trees()  # C's call was never made
        head = store.head(c.tree_id)
        assert head is not None and not head.unknown_effect_ids


def test_an_abandoned_call_that_kept_its_slot_gives_it_back_when_a_spare_thread_frees(
    tmp_path: Path, monkeypatch: Any,
) -> None:
    """With the spare threads taken, an abandoned call keeps its slot; when one of the hung
    calls on a spare thread returns, the call that kept its slot takes that spare and its
    slot goes back (before, the runtime granted nothing while it hung, a thread idle)."""
    import agentfold.adapters.runtime as rt

    monkeypatch.setattr(rt, "SPARE_DISPATCH_THREADS", 1)
    with one_slot_held(tmp_path, "kept", ignore_cancel=True, cancel_grace=0.2) as (calls, program, store, runtime, a):
        second = str(TreeID.for_start(StartID("kept-second")))
        calls.hold.add(second)
        runtime.cancel(a.root_process_id)  # abandoned: its slot goes back (the one spare thread)
        assert a.result(30).status == "canceled"
        b = runtime.start(program, {"n": 1}, start_id="kept-second")
        deadline = time.monotonic() + 30
        while second not in calls.trees():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        runtime.cancel(b.root_process_id)  # abandoned too: no spare left, it keeps its slot
        assert b.result(30).status == "canceled"
        c = runtime.start(program, {"n": 1}, start_id="kept-third")
        time.sleep(0.3)
        assert "EffectDispatched" not in kinds(store, c.tree_id)
        calls.hold.discard(str(a.tree_id))  # A's hung dispatcher returns; B's still hangs (30 s)
        assert c.result(10).status == "completed"
        assert calls.trees().count(str(c.tree_id)) == 1


def test_a_permitted_call_is_not_made_once_its_owner_line_stopped(tmp_path: Path) -> None:
    """A permission is committed; before its call starts (the line works through the rest of
    its queue first), a later cycle of the same pass fails its append and the line stops,
    giving up the tree. The call used to be made anyway, after the stop and without the
    lease; now the next owner decides it, as after a crash."""
    import agentfold.adapters.runtime as rt
    from agentfold.domain.errors import StoreFailure

    calls = Calls(tmp_path / "calls.jsonl")
    program = program_with(calls, "slots.stopped")
    store = EventStore(f"sqlite:///{tmp_path / 'stopped.db'}")
    runtime = Runtime(store, Catalog([program]), poll_interval=0, dispatch_workers=4)
    fail_next = threading.Event()
    store_append = store.append

    def failing_append(*args: Any, **kwargs: Any) -> Any:
        if fail_next.is_set():
            fail_next.clear()
            raise StoreFailure("store.unavailable", "injected: the store went away")
        return store_append(*args, **kwargs)

    launches: list[int] = []
    original_launch = rt._Driver._launch

    def launch(self: Any, dispatches: Any, permits: Any = None) -> None:
        original_launch(self, dispatches, permits)
        if not dispatches:
            return
        launches.append(1)
        if len(launches) == 2:  # the second call's permission is committed, its job not started
            root = self.tree.root.process_id
            refusals: list[Exception] = []

            def cancel() -> None:
                try:
                    runtime.cancel(root)
                except Exception as exc:  # noqa: BLE001 - the line stops under it (the injected failure)
                    refusals.append(exc)

            threading.Thread(target=cancel, daemon=True).start()
            deadline = time.monotonic() + 10
            while not self._inbox and time.monotonic() < deadline:  # the cancel is queued behind it
                time.sleep(0.001)
            fail_next.set()  # the cancel's cycle fails its append: the line stops

    store.append = failing_append  # type: ignore[method-assign,assignment]
    rt._Driver._launch = launch  # type: ignore[method-assign]
    try:
        handle = runtime.start(program, {"n": 3}, start_id="stopped-line")
        deadline = time.monotonic() + 10
        while runtime._drivers.get(handle.tree_id) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # a call started after the stop would have been made by now
        assert [c["index"] for c in calls.log.calls()] == [0], calls.log.calls()
        assert runtime._slots.in_use == 0 and runtime._slots.abandoned == 0
    finally:
        rt._Driver._launch = original_launch  # type: ignore[method-assign]
        runtime.close()
        store.close()

"""Runtime calls with arguments of the wrong shape are refused with a classified error and
store nothing (found by a review: a budget or capabilities of the wrong type raised pydantic's
raw ValidationError from inside the start, a bare string of capabilities was taken as one
capability per letter, and signals given as dicts or a start without a Program raised a bare
AttributeError from inside the runtime)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentfold.adapters.catalog import Catalog
from agentfold.adapters.eventstore import EventStore
from agentfold.adapters.host import Host
from agentfold.adapters.runtime import Runtime
from agentfold.domain.budget import Budget, Quota
from agentfold.domain.errors import InvalidInput
from agentfold.domain.ids import StartID, TreeID
from agentfold.domain.program import SignalRequest
from tests.kernel_programs import asker_program, chain_program


@pytest.mark.parametrize(("arguments", "code", "named"), [
    ({"budget": {"steps": 5}}, "budget.invalid", "dict"),
    ({"budget": 5}, "budget.invalid", "int"),
    ({"capabilities": "payments"}, "capabilities.invalid", "'payments'"),
    ({"capabilities": [1]}, "capabilities.invalid", "[1]"),
    ({"capabilities": ["payments", ""]}, "capabilities.invalid", "''"),
    ({"capabilities": b"payments"}, "capabilities.invalid", "b'payments'"),
])
def test_a_start_with_a_wrong_shaped_argument_is_refused_and_stores_nothing(
    tmp_path: Path, arguments: dict[str, Any], code: str, named: str
) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'start.db'}")
    program = chain_program(name="test.start_arguments")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            with pytest.raises(InvalidInput) as refused:
                runtime.start(program, {"n": 1}, start_id="wrong", **arguments)
            assert refused.value.code == code
            assert named in refused.value.message and refused.value.hint
            assert store.head(TreeID.for_start(StartID("wrong"))) is None
            assert store.max_notification_id() == 0
            # the right shapes start
            ok = runtime.start(program, {"n": 1}, start_id="right", budget=Budget(steps=Quota(50)),
                               capabilities=["payments"])
            assert ok.result(timeout=30).status == "completed"
            assert runtime.capture(ok.tree_id).root.capabilities == ("payments",)
    finally:
        store.close()


def test_a_start_without_a_program_is_refused(tmp_path: Path) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'start.db'}")
    try:
        with Runtime(store, Catalog([])) as runtime:
            with pytest.raises(InvalidInput) as refused:
                runtime.start(None, {"n": 1}, start_id="none")  # type: ignore[arg-type]
            assert refused.value.code == "program.invalid" and "NoneType" in refused.value.message
            assert store.max_notification_id() == 0
    finally:
        store.close()


@pytest.mark.parametrize("signals", [
    [{"signal_id": "s-1", "payload": 1}], "s-1", None, {"s-1": 1}, [SignalRequest("s-1", 1), ("s-2", 2)],
])
def test_signals_that_are_not_signal_requests_are_refused_and_admit_nothing(tmp_path: Path, signals: Any) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'signals.db'}")
    program = asker_program()
    try:
        with Runtime(store, Catalog([program])) as runtime:
            handle = runtime.start(program, None, start_id="signals")
            assert runtime.wait_idle(handle.tree_id).root.status == "waiting"  # it takes signals
            before = store.max_notification_id()
            with pytest.raises(InvalidInput) as refused:
                runtime.deliver_signals(handle.root_process_id, signals)
            assert refused.value.code == "signal.invalid" and "SignalRequest" in refused.value.hint
            assert store.max_notification_id() == before
            assert runtime.status(handle.tree_id) == "waiting"
    finally:
        store.close()


@pytest.mark.parametrize(("build", "code", "named"), [
    (lambda store: EventStore(5), "store.url_invalid", "int"),  # type: ignore[arg-type]
    (lambda store: EventStore(None), "store.url_invalid", "NoneType"),  # type: ignore[arg-type]
    (lambda store: Runtime(None), "runtime.invalid", "EventStore"),  # type: ignore[arg-type]
    (lambda store: Runtime(store, [chain_program()]), "runtime.invalid", "Catalog"),  # type: ignore[arg-type]
    (lambda store: Runtime(store, owner_workers=0), "runtime.invalid", "owner_workers"),
    (lambda store: Runtime(store, snapshot_every=-1), "runtime.invalid", "snapshot_every"),
    (lambda store: Runtime(store, poll_interval=-0.5), "runtime.invalid", "poll_interval"),
    (lambda store: Runtime(store, cancel_grace=float("nan")), "runtime.invalid", "cancel_grace"),
    (lambda store: Runtime(store, adopt_orphans_every="10"), "runtime.invalid", "adopt_orphans_every"),  # type: ignore[arg-type]
    (lambda store: Catalog([None]), "program.invalid", "NoneType"),  # type: ignore[list-item]
    (lambda store: Catalog("x"), "program.invalid", "str"),  # type: ignore[arg-type]
    (lambda store: Host(store), "runtime.invalid", "EventStore"),  # type: ignore[arg-type]
])
def test_a_store_runtime_catalog_or_host_built_with_wrong_arguments_is_refused(
    tmp_path: Path, build: Any, code: str, named: str
) -> None:
    # They raised a bare AttributeError or TypeError from inside, or (a negative snapshot
    # interval, a negative grace) were taken.
    store = EventStore(f"sqlite:///{tmp_path / 'built.db'}")
    try:
        with pytest.raises(InvalidInput) as refused:
            build(store)
        assert refused.value.code == code and named in refused.value.message and refused.value.hint
        with Runtime(store, Catalog([chain_program()]), poll_interval=0, cancel_grace=0) as runtime:  # 0s are fine
            assert runtime.start(chain_program(), {"n": 1}, start_id="fine").result(timeout=30).status == "completed"
    finally:
        store.close()


@pytest.mark.parametrize("quota", [5, "5", None, {"maximum": 5}])
def test_a_budget_of_plain_numbers_is_refused_when_built(quota: Any) -> None:
    """``Budget(steps=5)`` was taken, and the start failed with a bare AttributeError
    ('int' object has no attribute 'allows') at the first Step's budget check."""
    with pytest.raises(InvalidInput) as refused:
        Budget(steps=quota)
    assert refused.value.code == "budget.invalid"
    assert "steps is a Quota" in refused.value.message and "Budget.of(steps=5)" in refused.value.hint
    assert Budget.of(steps=5) == Budget(steps=Quota(5))


@contextlib.contextmanager
def parked_asker(tmp_path: Path) -> Iterator[tuple[Runtime, Any]]:
    """A runtime on a fresh SQLite store, and a run of it parked on a wait (start id ``parked``)."""
    store = EventStore(f"sqlite:///{tmp_path / 'parked.db'}")
    program = asker_program()
    try:
        with Runtime(store, Catalog([program])) as runtime:
            run = runtime.start(program, {"n": 1}, start_id="parked")
            runtime.wait_idle(run.tree_id)
            yield runtime, run
    finally:
        store.close()


@pytest.mark.parametrize(("call", "argument"), [
    ("wait_idle", None), ("wait_idle", -1), ("wait_idle", float("nan")), ("wait_idle", float("inf")),
    ("wait_idle", True), ("wait_idle", "1"), ("result", "1"), ("result", float("inf")), ("result", -5),
    ("wait_quiet", None), ("horizon", "x"), ("result", 1e10), ("wait_idle", 10**400),
])
def test_a_wait_bound_that_is_no_number_of_seconds_is_refused(tmp_path: Path, call: str, argument: Any) -> None:
    """A parked run waited for with a bound of the wrong type raised a bare TypeError,
    ValueError or OverflowError; ``True`` was one second, and a negative bound on a busy run
    waited for good."""
    with parked_asker(tmp_path) as (runtime, run):
        with pytest.raises(InvalidInput) as refused:
            if call == "horizon":
                runtime.wait_idle(run.tree_id, 1, horizon=argument)
            elif call == "wait_quiet":
                runtime.wait_quiet(run.tree_id, argument)
            else:
                getattr(runtime, call)(run.tree_id, argument)
        assert refused.value.code == "runtime.invalid", refused.value
        assert repr(argument)[:3] in refused.value.message and refused.value.hint
        assert runtime.wait_idle(run.tree_id, 5).classification() == "parked"


def test_drain_and_close_refuse_a_bound_that_is_no_number_before_they_change_anything(tmp_path: Path) -> None:
    """``drain(None)`` raised a TypeError after it had stopped dispatching: a run started
    afterwards never made its first call."""
    store = EventStore(f"sqlite:///{tmp_path / 'drain.db'}")
    program = chain_program(name="test.drain_arguments")
    try:
        with Runtime(store, Catalog([program])) as runtime:
            for bad in (None, "5", float("nan"), 10**400, 1e10):
                with pytest.raises(InvalidInput) as refused:
                    runtime.drain(bad)  # type: ignore[arg-type]
                assert refused.value.code == "runtime.invalid"
                with pytest.raises(InvalidInput):
                    runtime.close(bad)  # type: ignore[arg-type]
            run = runtime.start(program, {"n": 3}, start_id="after")
            assert run.result(timeout=30).status == "completed"
    finally:
        store.close()


def test_a_host_with_sources_of_the_wrong_type_and_gates_of_no_text_are_refused(tmp_path: Path) -> None:
    store = EventStore(f"sqlite:///{tmp_path / 'host.db'}")
    try:
        with Runtime(store) as runtime:
            for sources in ("x", [1], {"programs": ()}):
                with pytest.raises(InvalidInput) as refused:
                    Host(runtime, sources=sources)  # type: ignore[arg-type]
                assert refused.value.code == "runtime.invalid" and "ProgramSources" in refused.value.message
            for tree in (5, b"p10"):
                with pytest.raises(InvalidInput) as refused:
                    Host(runtime).gates(tree)  # type: ignore[arg-type]
                # as host.run(5): the run's name is no text (it was "no tree '5'")
                assert refused.value.code == "identity.invalid", refused.value
            assert Host(runtime).gates(None) == []  # no run named: every run's, as pending(None)
    finally:
        store.close()


def test_release_adopt_orphans_and_stored_far_timers_refuse_what_they_silently_ignored(tmp_path: Path) -> None:
    """``release(None)``, ``release(<start id>)``, ``adopt_orphans("x")`` and
    ``stored_far_timers(tree, None)`` did nothing and said nothing (a review of the Python API)."""
    with parked_asker(tmp_path) as (runtime, run):
        assert runtime.owns(run.tree_id)
        with pytest.raises(InvalidInput) as refused:
            runtime.release(None)  # type: ignore[arg-type]
        assert refused.value.code == "identity.invalid"
        for call in (lambda: runtime.adopt_orphans("x"), lambda: runtime.stored_far_timers(run.tree_id, None)):
            with pytest.raises(InvalidInput) as refused:
                call()
            assert refused.value.code == "runtime.invalid", refused.value
        runtime.release("parked")  # a start id names the run, as everywhere else
        assert not runtime.owns(run.tree_id)
